#!/usr/bin/env bash
# Installs CRIU 4.1 into a private prefix (default /opt/tine-criu), idempotently.
#
# Debian 12's CRIU 3.17 cannot run on kernels >= 6.13 (it does not know the
# [vvar_vclock] mapping), so this takes the Debian 13 "trixie" package and its
# libraries through a separate apt configuration, unpacks them with dpkg -x and
# points the binary's interpreter and library path at the prefix with patchelf.
# The system's own libc and packages are never touched.
#
# Prints the path of the criu binary on success. tine finds it through
# TINE_CRIU or at /opt/tine-criu/criu.
set -euo pipefail

PREFIX="${TINE_CRIU_PREFIX:-/opt/tine-criu}"
BIN="$PREFIX/criu"
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q 'Version: 4\.'; then
  echo "$BIN"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-criu.sh: needs root (CRIU itself only runs as root here)" >&2
  exit 1
fi
command -v apt-get >/dev/null || { echo "install-criu.sh: needs apt-get (Debian)" >&2; exit 1; }
command -v patchelf >/dev/null || {
  apt-get update -qq && apt-get install -y -qq patchelf >/dev/null
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/root"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  >"$work/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
  -o Dir::State::status=/dev/null -o Debug::NoLocking=1 -o APT::Sandbox::User=root
)
apt-get "${apt_opts[@]}" update -qq
# The whole dependency closure against an empty status file: every library
# criu needs comes from trixie, including its libc.
mapfile -t pkgs < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends criu |
  grep -v '^ ' | grep -v '^<' | sort -u)
(cd "$work/debs" && apt-get "${apt_opts[@]}" download -qq "${pkgs[@]}")
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/root"; done

stage="$PREFIX.new"
rm -rf "$stage"
mkdir -p "$stage"
cp -a "$work/root/." "$stage/root/"
libs="$PREFIX/root/usr/lib/x86_64-linux-gnu:$PREFIX/root/lib/x86_64-linux-gnu"
cp "$stage/root/usr/sbin/criu" "$stage/criu"
patchelf --set-interpreter "$PREFIX/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" \
  --force-rpath --set-rpath "$libs" "$stage/criu"
rm -rf "$PREFIX"
mv "$stage" "$PREFIX"
"$BIN" --version >/dev/null
echo "$BIN"

#!/usr/bin/env bash
# Installs CRIU 4.2 (else 4.1) into a private prefix (default /opt/tine-criu),
# idempotently.
#
# Debian 12's CRIU 3.17 cannot run on kernels >= 6.13 (it does not know the
# [vvar_vclock] mapping), and 4.1 (Debian 13 "trixie") cannot dump a process
# holding a TCP or UDP socket on kernels >= 6.16 (`sockets: Can't get 1:34
# opt`, fixed in 4.2). So this takes the package of the first suite of
# $TINE_CRIU_SUITES (default: "forky trixie") that has one, with its libraries,
# through a separate apt configuration, unpacks them with dpkg -x and points
# the binary's interpreter and library path at the prefix with patchelf.
# The system's own libc and packages are never touched.
#
# Prints the path of the criu binary on success. tine finds it through
# TINE_CRIU or at /opt/tine-criu/criu.
set -euo pipefail

PREFIX="${TINE_CRIU_PREFIX:-/opt/tine-criu}"
BIN="$PREFIX/criu"
# 4.2 or later is kept; an older one is replaced when a newer one is found.
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -Eq 'Version: (4\.([2-9]|[1-9][0-9])|[5-9]\.)'; then
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

# Installs the package of suite $1 into $PREFIX; fails without touching it.
install_from() {
  local suite="$1" work
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' RETURN
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/root"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" \
    >"$work/sources.list"
  local apt_opts=(
    -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
    -o Dir::State::status=/dev/null -o Debug::NoLocking=1 -o APT::Sandbox::User=root
  )
  apt-get "${apt_opts[@]}" update -qq || return 1
  # The whole dependency closure against an empty status file: every library
  # criu needs comes from that suite, including its libc.
  local pkgs
  mapfile -t pkgs < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends criu |
    grep -v '^ ' | grep -v '^<' | sort -u)
  [ "${#pkgs[@]}" -gt 0 ] || return 1
  (cd "$work/debs" && apt-get "${apt_opts[@]}" download -qq "${pkgs[@]}") || return 1
  for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/root" || return 1; done

  local stage="$PREFIX.new"
  rm -rf "$stage"
  mkdir -p "$stage"
  cp -a "$work/root/." "$stage/root/"
  local libs="$PREFIX/root/usr/lib/x86_64-linux-gnu:$PREFIX/root/lib/x86_64-linux-gnu"
  cp "$stage/root/usr/sbin/criu" "$stage/criu"
  patchelf --set-interpreter "$PREFIX/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" \
    --force-rpath --set-rpath "$libs" "$stage/criu"
  # Checked in place (its paths name the prefix) before it replaces what was there.
  local old="$PREFIX.old"
  rm -rf "$old"
  [ -e "$PREFIX" ] && mv "$PREFIX" "$old"
  mv "$stage" "$PREFIX"
  if ! "$BIN" --version 2>/dev/null | grep -q 'Version: [4-9]\.'; then
    rm -rf "$PREFIX"
    [ -e "$old" ] && mv "$old" "$PREFIX"
    return 1
  fi
  rm -rf "$old"
}

for suite in ${TINE_CRIU_SUITES:-forky trixie}; do
  if install_from "$suite"; then
    echo "$BIN"
    exit 0
  fi
  echo "install-criu.sh: no working CRIU from Debian $suite; trying the next suite" >&2
done
echo "install-criu.sh: no suite of ${TINE_CRIU_SUITES:-forky trixie} gave a working CRIU" >&2
exit 1

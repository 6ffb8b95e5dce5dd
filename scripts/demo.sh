#!/usr/bin/env bash
# A short tour of tine's main job on a throwaway directory: snapshot a workspace,
# change it, see the difference, roll it back, and fork it. Needs only cargo.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
echo "== building tine (release)"
cargo build --release --quiet --manifest-path "$here/Cargo.toml" -p tine-cli
tine="$here/target/release/tine"
demo="$(mktemp -d -t tine-demo-XXXXXX)"
cleanup() {
  # Sandboxes outlive the commands that started them: remove them before their files.
  for s in agent try-1 try-2; do
    "$tine" --repo "$demo/project/.tine" rm -f "$s" >/dev/null 2>&1 || true
  done
  rm -rf "$demo"
}
trap cleanup EXIT
cd "$demo"
mkdir project && cd project
step() {
  local shown=("${@:2}")
  [ "${shown[0]}" = "$tine" ] && shown[0]=tine
  printf '\n== %s\n$' "$1"
  printf ' %q' "${shown[@]}"
  printf '\n'
  "${@:2}"
}

step "create a repository (.tine/ in this directory)" "$tine" init
mkdir -p src
printf 'def greet(name):\n    return "hello " + name\n' > src/app.py
printf 'notes\n' > README.md
printf '{"role": "user", "content": "add a test"}\n' > ../trace.jsonl
step "snapshot before the agent acts (with its chat trace attached)" \
  "$tine" snapshot -m "before the agent acts" --tag base --attach trace=../trace.jsonl

printf 'def greet(name):\n    return "HELLO " + name.upper()\n' > src/app.py
printf 'import app\nassert app.greet("x")\n' > src/test_app.py
rm README.md
step "the agent edited, added and deleted files; snapshot again" "$tine" snapshot -m "agent attempt 1"
step "what changed since base" "$tine" diff base -p
step "history" "$tine" log --graph
step "roll back to base: only the changed paths are touched" "$tine" restore base
step "the workspace is back" ls -A
step "the chat trace travels with the snapshot" "$tine" show base --attachment trace
step "fork base into 3 independent directories" "$tine" fork base -n 3 --into ../forks
echo "fork 1 diverges" > ../forks/1/README.md
step "forks are independent" cat ../forks/2/README.md
if [ "$(id -u)" = 0 ]; then
  # One bash process counting in memory (builtins only: no child process, so
  # native fork can copy it), writing its count to the workspace every 50 ms.
  step "a live sandbox over the project (isolated; the project directory is never modified)" \
    "$tine" run --name agent --workspace . -- bash -c \
    'mkfifo /tmp/tick; exec 9<>/tmp/tick; n=0; while :; do n=$((n+1)); echo "$n" > /workspace/counter; read -t 0.05 -u 9; done'
  step "run a command inside it" "$tine" exec agent -- sh -c 'echo "pid $$ in $(hostname), sees:"; ls /workspace'
  sleep 0.3
  step "snapshot the running sandbox: its files and its process (paused a few ms)" \
    "$tine" snapshot --sandbox agent -m "sandbox checkpoint" --tag live
  step "the count, just after the checkpoint" "$tine" exec agent -- cat /workspace/counter
  sleep 0.5
  "$tine" exec agent -- sh -c 'echo "oops" > /workspace/src/app.py'
  step "half a second later the count is higher, and the agent broke a file" \
    "$tine" exec agent -- cat /workspace/counter /workspace/src/app.py
  step "roll the running sandbox back: files and process" "$tine" restore live
  step "the file is back, and the process counts on from the checkpoint" \
    "$tine" exec agent -- cat /workspace/src/app.py /workspace/counter
  step "fork the checkpoint into 2 more running sandboxes" "$tine" fork live -n 2 --name try
  step "sandboxes" "$tine" ps
else
  printf '\n== (live sandboxes need root: run this demo as root to see them)\n'
fi
step "maintenance: recompress the snapshots' packs densely, off the critical path" "$tine" gc
step "verify every stored object" "$tine" fsck
printf '\n== done: the demo ran in %s (removed on exit)\n' "$demo"

#!/usr/bin/env bash
# The main job on the embedded fixture model, end to end: start the daemon (both processes),
# wait until it reports ready, stream one completion through the Unix socket, print the
# daemon's status, then stop it with SIGTERM (a clean drain, exit 0).
#   tools/demo.sh ["prompt"] [extra specd options...]
# The completion is greedy with a repetition penalty of 1.2 (DEMO_REPETITION_PENALTY=1 turns
# it off): without one the small fixture's greedy output falls into a loop (from this prompt
# it repeats `self.tk.call(` to the end); the daemon's own default stays 1 (none).
set -euo pipefail
prompt=${1:-"def fibonacci(n):"}
shift || true
dir=$(mktemp -d)
export SPECD_SOCKET="$dir/specd.sock"
specd --socket "$SPECD_SOCKET" --log-level warning "$@" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$dir"' EXIT
echo "specd (pid $pid) starting on $SPECD_SOCKET ..." >&2
for _ in $(seq 1 600); do
  if specctl status --json 2>/dev/null | grep -q '"state": "ready"'; then break; fi
  kill -0 $pid 2>/dev/null || { echo "specd exited during start-up" >&2; exit 1; }
  sleep 0.5
done
specctl generate "$prompt" --max-tokens 96 --repetition-penalty "${DEMO_REPETITION_PENALTY:-1.2}"
echo
specctl status

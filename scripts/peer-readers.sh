#!/usr/bin/env bash
# Install (once) the peers' own offline readers that the export tests run on synthq's
# output (tests/training/test_export_features.py): speculators' ArrowDataset
# (speculators.train.data, with hs-connectors' FileTransfer) and SpecForge's
# list_local_files + OfflineEagle3Dataset (specforge.data.preprocessing), pinned.
# They go into a folder outside the clone, without their dependencies: speculators pins
# datasets/transformers below synthq's and pulls torchvision/torchaudio, SpecForge pins
# torch 2.11, transformers 5.8.1 and sglang; their readers import only what synthq's
# venv has (torch, datasets, safetensors, openai). Prints the folder on its last line.
# The machine's python3 installs them (pure Python, --target), so this runs before
# .venv exists in a fresh clone (.ci/run calls it before the tests make .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PINS="speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0"
DIR="${SYNTHQ_PEER_READERS:-${XDG_CACHE_HOME:-$HOME/.cache}/synthq/peer-readers-speculators-0.9.0-specforge-0.2.0}"
if [ -f "$DIR/.ready" ]; then
  echo "$DIR"
  exit 0
fi
mkdir -p "$(dirname "$DIR")"
rm -rf "$DIR"  # no .ready: an earlier install was cut short
# shellcheck disable=SC2086
python3 -m pip install -q --disable-pip-version-check --no-deps --target "$DIR" $PINS
touch "$DIR/.ready"
echo "$DIR"

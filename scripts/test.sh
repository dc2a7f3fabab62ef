#!/usr/bin/env bash
# The test command: set up .venv (once) and run the suite against the local
# PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379).
#
#   bash scripts/test.sh            the whole suite (CI runs this): lint, types, the docs
#                                   site (mkdocs build --strict), every tier
#   bash scripts/test.sh --fast     the fast tier, within 3 minutes: unit tests, SQLite
#                                   integration and one end-to-end path (a killed
#                                   `synthq run` resumed); no PostgreSQL, Redis, vLLM
#   bash scripts/test.sh -m engine  any pytest arguments are passed on
#
# A test outside the fast tier carries a marker that says why (tests/conftest.py reads
# most of them from the fixtures it uses): postgres, redis, processes, engine, chaos,
# browser, training, slow. The order is random (pytest-randomly prints its seed first:
# `--randomly-seed=N` repeats an order, `-p no:randomly` keeps the files' order).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
.venv/bin/ruff check synthq worker api tests bench
if [ "$fast" = 1 ]; then
  # A test in this tier that starts a process fails at once (tests/conftest.py): it
  # must carry the `processes` marker, and so leave the tier.
  # --dist loadfile: a module on one process, its fixtures (six tokenizers) loaded once.
  SYNTHQ_FAST_TIER=1 exec .venv/bin/python -m pytest -n "${SYNTHQ_TEST_PROCESSES:-2}" --dist loadfile \
    -m "smoke or not (postgres or redis or processes or engine or chaos or browser or training or slow)" \
    "$@"
fi
if command -v docker-compose >/dev/null 2>&1; then
  # Validate docker-compose.yml with the example environment.
  docker-compose --env-file .env.example config -q
  docker-compose --env-file .env.example --profile vllm --profile sim config -q
  echo "docker-compose.yml: valid"
fi
# mypy's cache is kept per machine, outside the clone (a fresh clone's cold check took
# 47 s of the 64 s before the tests, a warm one 1 s): mypy rechecks a module whose
# bytes differ from the cached one's, so a cache of another commit is only slower.
MYPY_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/synthq/mypy" .venv/bin/mypy
# The docs site (mkdocs.yml): a broken link, a missing page or anchor fails it (strict).
# Not -q: mkdocs then drops the warnings before --strict counts them, and passes.
docs_out="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$docs_out" 2>&1 | { grep -v '^INFO ' || true; }
rm -rf "$docs_out"
# Three processes by default (pytest-xdist; the two cores were 16 % idle on two: 986 s of
# pytest on three against 1,075 s on two, quiet fresh clones, 2026-12-06). The engine
# tier runs in three groups, each on one process (one vLLM start per configuration):
# the plain server's modules, the capture server's, the real target's. Those groups go
# first, one to each process (tests/conftest.py orders them), the rest is shared out one
# test at a time. Each process has its own
# PostgreSQL database (named by its pid) and Redis database (SYNTHQ_TEST_REDIS's for the
# first, the one below it for the second, and so on). SYNTHQ_TEST_PROCESSES=1 runs
# everything in one process.
procs="${SYNTHQ_TEST_PROCESSES:-3}"
if [ "$procs" -gt 1 ]; then
  exec .venv/bin/python -m pytest -n "$procs" --dist loadgroup --no-loadscope-reorder "$@"
fi
exec .venv/bin/python -m pytest "$@"

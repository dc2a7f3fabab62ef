#!/usr/bin/env bash
# The test command: set up .venv (once) and run the whole suite against the
# local PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if command -v docker-compose >/dev/null 2>&1; then
  # Validate docker-compose.yml with the example environment.
  docker-compose --env-file .env.example config -q
  docker-compose --env-file .env.example --profile vllm --profile sim config -q
  echo "docker-compose.yml: valid"
fi
.venv/bin/ruff check synthq worker api tests bench
.venv/bin/mypy
# Two processes by default (pytest-xdist): the engine tier's tests stay on one of them
# (one vLLM start; they are the largest group, so they go first), the rest are shared
# out one test at a time. Each process has its own PostgreSQL database (named by its
# pid) and Redis database (SYNTHQ_TEST_REDIS's for the first, the one below it for the
# second). SYNTHQ_TEST_PROCESSES=1 runs everything in one process.
procs="${SYNTHQ_TEST_PROCESSES:-2}"
if [ "$procs" -gt 1 ]; then
  exec .venv/bin/python -m pytest -n "$procs" --dist loadgroup "$@"
fi
exec .venv/bin/python -m pytest "$@"

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
exec .venv/bin/python -m pytest "$@"

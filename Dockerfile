# synthq image: CLI, Celery worker/beat, REST API, Flower, simulator.
#
# torch is deliberately NOT installed by default (the `train` extra makes the
# separate GPU image); generation and the API only need the tokenizer side of
# transformers.
#
#   docker build -t synthq .
#   docker run --rm synthq                 # synthq --help
#   docker compose up -d                   # see docker-compose.yml
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, from pyproject.toml alone, so that editing the code
# does not reinstall them (this layer is rebuilt only when pyproject changes).
# SYNTHQ_EXTRAS: optional dependency groups; `api` (REST API, job page,
# metrics) by default, `api,train` for the training worker's image.
ARG SYNTHQ_EXTRAS=api
COPY pyproject.toml ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = [e for e in os.environ['SYNTHQ_EXTRAS'].split(',') if e]; \
print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself, editable: synthq/migrate.py finds alembic.ini and
# migrations/ beside the package, i.e. in /app.
COPY . .
RUN pip install --no-deps -e . \
    && python -m compileall -q synthq worker api

# Run as an unprivileged user. The code stays root-owned (read-only to the
# service); writable are its home (the Hugging Face tokenizer cache) and the
# state directory (celery beat's schedule, embedded-mode SQLite).
RUN groupadd --system --gid 10001 synthq \
    && useradd --system --uid 10001 --gid synthq --create-home --home-dir /home/synthq \
        --shell /usr/sbin/nologin synthq \
    && mkdir -p /app/synthq-data \
    && chown synthq:synthq /app/synthq-data
USER synthq

ENV SYNTHQ_DATA_DIR=/app/synthq-data

CMD ["synthq", "--help"]

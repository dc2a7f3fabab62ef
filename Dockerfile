# synthq generation image: CLI, Celery worker/beat, Flower, simulator.
#
# torch is deliberately NOT installed here (the `train` extra is a separate,
# GPU image); generation only needs the tokenizer side of transformers.
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
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
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

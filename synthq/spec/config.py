"""One settings object, read from the environment (prefix ``SYNTHQ_``).

Defaults give the embedded mode: a SQLite file under ``./synthq-data/`` and no
broker. Production sets ``SYNTHQ_DATABASE_URL`` (PostgreSQL) and
``SYNTHQ_BROKER_URL`` (Redis).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from synthq.core import defaults

__all__ = ["Settings", "get_settings"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SYNTHQ_", extra="ignore")

    #: Where the embedded SQLite file and other local state live.
    data_dir: Path = Path(defaults.DATA_DIR)
    #: SQLAlchemy URL; empty means ``sqlite:///<data_dir>/synthq.db``.
    database_url: str = ""
    #: Celery broker (Redis) URL; empty means embedded mode (no broker).
    broker_url: str = ""
    #: Seconds a running sample's lease lasts beyond the job's stall timeout.
    #: A worker renews it while tokens arrive; the sweep reclaims expired ones.
    lease_margin: float = 30.0
    #: Seconds a queued sample may wait for a worker before the sweep returns
    #: it to ``pending`` (its broker message may have been lost). Short: the
    #: dispatcher queues no more than the live workers' free slots.
    queued_timeout: float = 30.0
    #: Seconds between dispatcher/sweep runs (Celery beat and embedded loop).
    dispatch_interval: float = 1.0
    #: Most samples one dispatcher run moves to ``queued`` per server.
    dispatch_batch: int = 1000
    #: Most samples in one ``generate`` message (a batch one worker runs at once).
    batch_size: int = 32
    #: Bounds on what one sample may cost, whatever its row or its server says. A row with
    #: more assistant turns than this to regenerate (``--regenerate all``) is skipped at
    #: enqueue, with its reason; a request body over this many bytes (a long history,
    #: carried reasoning) fails as ``request_too_large`` before it is sent.
    max_regenerated_turns: int = Field(default=64, gt=0)
    max_request_bytes: int = Field(default=16 << 20, gt=0)
    #: Seconds between a worker's heartbeats, and silence after which it counts
    #: as dead (its capacity is freed, its running samples go back to pending).
    heartbeat_interval: float = 2.0
    worker_timeout: float = defaults.WORKER_TIMEOUT
    #: Seconds one heartbeat waits for the database on its own connection before it
    #: drops it and connects again; 0: a fifth of ``worker_timeout``, at least 0.5 s. A
    #: worker whose heartbeat is older than half of ``worker_timeout`` starts no call
    #: (synthq.queue.heartbeat).
    heartbeat_timeout: float = Field(default=0.0, ge=0)
    #: Calls one generation process holds in flight; 0: the worker's ``-c``.
    worker_capacity: int = 0
    #: A worker's refill claims the samples for its own freed slots in the
    #: dispatch's transaction and starts them, without a ``generate`` message
    #: (no broker round trip, no second transaction). Those samples are
    #: then no Celery tasks: False shows every batch in Flower.
    local_refill: bool = True
    #: Seconds between a worker's refill dispatches while its slots free up: a refill
    #: then claims the slots freed meanwhile in one transaction (5 statements),
    #: not one dispatch per finished sample.
    refill_interval: float = Field(default=0.02, ge=0, le=1)
    #: Seconds a sample may stay queued while a worker has free slots before that
    #: worker claims it from SQL itself (its message stuck in a half-open broker
    #: connection, or lost); 0: twice the heartbeat interval, at least 1 s.
    adopt_after: float = Field(default=0.0, ge=0)
    #: Seconds a worker told to stop (SIGTERM) lets its calls finish; then it
    #: cuts them and returns their samples to pending (due at once).
    shutdown_grace: float = 60.0
    #: Seconds the batch writer keeps retrying through a database outage
    #: before it gives a write up (the sample's lease then returns it).
    write_retry_seconds: float = 600.0
    #: Redis redelivers an unacknowledged message after this many seconds;
    #: keep it above the longest total timeout of any job.
    visibility_timeout: float = 4 * 3600.0
    #: Database connections one process keeps (PostgreSQL), and how many more it
    #: may open under load. Threads wait for a free one; transactions are short.
    db_pool_size: int = 8
    db_max_overflow: int = 16
    #: PostgreSQL connections of every synthq process: TCP keepalives (an idle
    #: connection is probed after ``db_keepalive_idle`` s, every
    #: ``db_keepalive_interval`` s, and dropped after ``db_keepalive_count`` unanswered
    #: probes), ``tcp_user_timeout`` (data sent and not acknowledged for that many
    #: seconds drops the connection) and the connect timeout: a peer that vanished
    #: (a half-open connection) costs seconds, not forever.
    db_keepalive_idle: int = 10
    db_keepalive_interval: int = 3
    db_keepalive_count: int = 3
    db_tcp_user_timeout: float = 20.0
    db_connect_timeout: int = 10
    #: The service processes' sessions (generation workers, beat, ``synthq run``),
    #: set on the server: a statement may run ``db_statement_timeout`` s and wait
    #: ``db_lock_timeout`` s for a lock, and a transaction left idle for
    #: ``db_idle_in_transaction_timeout`` s is ended by the server (a dead worker's
    #: session must not hold the dispatch lock for good). Such a process also gives
    #: up on any answer after ``db_statement_timeout`` + ``db_answer_margin`` s: a
    #: connection whose answers stopped (stranded by a proxy or a NAT) is dropped and
    #: the transaction retried on a fresh one. 0 turns a limit off.
    db_statement_timeout: float = 20.0
    db_lock_timeout: float = 10.0
    db_idle_in_transaction_timeout: float = 20.0
    db_answer_margin: float = 5.0
    #: Redis (broker), every connection: a command waits ``broker_socket_timeout`` s for
    #: its answer (a publish on a dead connection fails instead of hanging the beat tick
    #: or the refill), a connect ``broker_connect_timeout`` s; TCP keepalives on; and a
    #: worker's BRPOP connection silent for its timeout plus ``broker_health_check_interval``
    #: s is dropped and made again (kombu): a half-open broker costs seconds.
    broker_socket_timeout: float = 10.0
    broker_connect_timeout: float = 5.0
    broker_health_check_interval: int = 10
    #: Training runs: seconds without a heartbeat before a running run counts as
    #: orphaned (its worker died) and is handed to another worker, which resumes
    #: it from its last checkpoint; and seconds a pending run waits before its
    #: ``train`` message is sent again (it may have died with the broker).
    train_lease: float = defaults.TRAIN_LEASE
    train_resend_after: float = 900.0
    #: Processes per training run (DDP under torchrun, rank 0 writes): 0 = one per
    #: CUDA GPU of the machine, so one without CUDA; 2 or more on the CPU use gloo.
    train_procs: int = 0
    #: Dollars per GPU-hour for the cost report of jobs enqueued without --gpu-hour-price.
    gpu_hour_price: float | None = defaults.GPU_HOUR_PRICE
    #: Hidden-state capture (synthq.capture): where the store lives (empty:
    #: ``<data_dir>/hidden-states``), seconds one capture request may take, seconds
    #: the engine's file may take to appear whole after the answer, and the bytes
    #: a stage leaves free on the store's disk.
    capture_store: Path | None = None
    capture_timeout: float = 120.0
    capture_file_timeout: float = 60.0
    capture_reserve_bytes: int = 1 << 30
    #: Identical failures in a row of a class that names the server's configuration
    #: (``bad_request``; for capture also ``capture_mismatch``) after which a server's
    #: stage stops (synthq.queue.streaks); 0: never.
    stop_after: int = Field(default=5, ge=0)
    #: Seconds one Celery ``capture`` task runs a job's stage before it returns.
    capture_task_seconds: float = 60.0
    #: API key sent to inference servers (vLLM accepts any unless started with --api-key).
    api_key: str = "EMPTY"
    #: Hosts the API's users may name as servers, and the only ones the workers send
    #: ``api_key`` to: ``host[:port]`` patterns, comma-separated (``vllm-*.internal:8000,
    #: 10.0.0.*``; see synthq.core.secrets.parse_server_patterns). Empty: the API accepts no
    #: server URL, and the workers send the key to every server (only the CLI names them).
    allowed_servers: str = ""

    @field_validator("database_url")
    @classmethod
    def _normalise_db_url(cls, url: str) -> str:
        url = url.strip()
        # Users paste libpq-style URLs; SQLAlchemy needs the driver named.
        for prefix in ("postgres://", "postgresql://"):
            if url.startswith(prefix):
                return "postgresql+psycopg://" + url[len(prefix):]
        return url

    @field_validator("broker_url")
    @classmethod
    def _check_broker(cls, url: str) -> str:
        url = url.strip()
        if url and not url.startswith(("redis://", "rediss://")):
            raise ValueError(f"SYNTHQ_BROKER_URL must be a redis:// URL, got {url!r}")
        return url

    @field_validator("allowed_servers")
    @classmethod
    def _check_allowed_servers(cls, text: str) -> str:
        from synthq.core.secrets import parse_server_patterns

        parse_server_patterns(text)  # a malformed entry stops the service at start
        return text

    @property
    def allowed_server_patterns(self) -> tuple[tuple[str, str | None], ...]:
        from synthq.core.secrets import parse_server_patterns

        return parse_server_patterns(self.allowed_servers)

    def sends_key_to(self, url: str) -> bool:
        """Whether a worker sends ``api_key`` to the server ``url``: a host of
        ``allowed_servers``, or any when that is empty."""
        from synthq.core.secrets import server_allowed

        patterns = self.allowed_server_patterns
        return not patterns or server_allowed(url, patterns)

    @model_validator(mode="after")
    def _default_db(self) -> Settings:
        from synthq.core.secrets import check_secret, check_url

        # A copy of .env.example left unchanged must not start a service.
        check_url("SYNTHQ_DATABASE_URL", self.database_url)
        check_url("SYNTHQ_BROKER_URL", self.broker_url)
        check_secret("SYNTHQ_API_KEY", self.api_key, required=False)
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'synthq.db'}"
        return self

    @property
    def embedded(self) -> bool:
        """True when no broker is configured: everything runs in one process."""
        return not self.broker_url

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (tests clear the cache after changing env)."""
    return Settings()


def status_settings() -> defaults.StatusSettings:
    """What a status and its cost report read of the settings, from the environment."""
    settings = get_settings()
    return defaults.StatusSettings(
        worker_timeout=settings.worker_timeout, gpu_hour_price=settings.gpu_hour_price,
        capture_store=str(defaults.store_root(settings.capture_store, settings.data_dir)),
        train_lease=settings.train_lease)

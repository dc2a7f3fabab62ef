"""One settings object, read from the environment (prefix ``SYNTHQ_``).

Defaults give the embedded mode: a SQLite file under ``./synthq-data/`` and no
broker. Production sets ``SYNTHQ_DATABASE_URL`` (PostgreSQL) and
``SYNTHQ_BROKER_URL`` (Redis).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from synthq import defaults

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
    #: Seconds between a worker's heartbeats, and silence after which it counts
    #: as dead (its capacity is freed, its running samples go back to pending).
    heartbeat_interval: float = 2.0
    worker_timeout: float = defaults.WORKER_TIMEOUT
    #: Calls one generation process holds in flight; 0: the worker's ``-c``.
    worker_capacity: int = 0
    #: A worker's refill claims the samples for its own freed slots in the
    #: dispatch's transaction and starts them, without a ``generate`` message
    #: (no broker round trip, no second transaction). Those samples are
    #: then no Celery tasks: False shows every batch in Flower.
    local_refill: bool = True
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
    #: Training runs: seconds without a heartbeat before a running run counts as
    #: orphaned (its worker died) and is handed to another worker, which resumes
    #: it from its last checkpoint; and seconds a pending run waits before its
    #: ``train`` message is sent again (it may have died with the broker).
    train_lease: float = 120.0
    train_resend_after: float = 900.0
    #: Dollars per GPU-hour for the cost report of jobs enqueued without --gpu-hour-price.
    gpu_hour_price: float | None = defaults.GPU_HOUR_PRICE
    #: API key sent to inference servers (vLLM accepts any unless started with --api-key).
    api_key: str = "EMPTY"

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

    @model_validator(mode="after")
    def _default_db(self) -> Settings:
        from synthq.secrets import check_secret, check_url

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
    return defaults.StatusSettings(worker_timeout=settings.worker_timeout,
                                   gpu_hour_price=settings.gpu_hour_price)

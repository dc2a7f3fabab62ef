"""The API's own settings (prefix ``SYNTHQ_``), checked when the app starts."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from pydantic import SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from synthq.core.secrets import check_secret
from synthq.spec.config import get_settings

__all__ = ["ApiSettings", "api_settings"]


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SYNTHQ_", extra="ignore")

    #: Bearer token every route but /health and /ready requires.
    api_token: SecretStr = SecretStr("")
    #: Development: start without a token (no auth at all) or with a placeholder.
    api_dev: bool = False
    #: Largest dataset file an upload may be.
    api_upload_max_bytes: int = 512 * 1024 * 1024
    #: Mark the UI's cookie Secure (it is anyway over HTTPS or behind X-Forwarded-Proto: https).
    api_secure_cookie: bool = False
    #: Hours a job-page login lasts.
    api_session_hours: float = 12.0

    @field_validator("api_session_hours")
    @classmethod
    def _hours(cls, value: float) -> float:
        if not math.isfinite(value) or not 0 < value <= 24 * 366:
            raise ValueError("must be a number of hours, more than 0 and at most 8784 (a year)")
        return value

    @field_validator("api_upload_max_bytes")
    @classmethod
    def _upload_max(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be a positive number of bytes")
        return value

    def check(self) -> None:
        """Refuse to start without a real token, unless in development mode."""
        if self.api_dev:
            return
        try:
            check_secret("SYNTHQ_API_TOKEN", self.api_token.get_secret_value())
        except ValueError as exc:
            raise RuntimeError(f"{exc} (or set SYNTHQ_API_DEV=1 for development)") from None
        if len(self.api_token.get_secret_value()) < 16:
            raise RuntimeError("SYNTHQ_API_TOKEN must be at least 16 characters")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_token.get_secret_value())

    @property
    def data_dir(self) -> Path:
        return get_settings().data_dir

    @property
    def exports_dir(self) -> Path:
        return self.data_dir / "exports"

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "uploads"


@lru_cache(maxsize=1)
def api_settings() -> ApiSettings:
    return ApiSettings()

"""Front ends: `synthq api` (REST API and job page) and `synthq flower` (task dashboard)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from synthq.cli import app, err, fail


def _dev(flag: bool) -> bool:
    return flag or os.environ.get("SYNTHQ_API_DEV", "").lower() in ("1", "true", "yes")


@app.command()
def api(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    dev: Annotated[bool, typer.Option("--dev", help="Development: start without a token "
                   "(same as SYNTHQ_API_DEV=1).")] = False,
) -> None:
    """Serve the REST API, its OpenAPI docs (/docs), the job page (/ui) and /metrics.

    Needs SYNTHQ_API_TOKEN (a bearer token, at least 16 characters; not the
    .env.example placeholder) unless --dev.

    Example: `SYNTHQ_API_TOKEN=$(openssl rand -hex 24) synthq api --host 0.0.0.0 --port 8080`
    """
    if dev:
        os.environ["SYNTHQ_API_DEV"] = "1"
    if not 0 < port < 65536:
        raise fail("--port must be 1..65535")
    from synthq.core.secrets import check_secret

    if not _dev(dev):
        try:
            check_secret("SYNTHQ_API_TOKEN", os.environ.get("SYNTHQ_API_TOKEN"))
            if len(os.environ.get("SYNTHQ_API_TOKEN", "")) < 16:
                raise ValueError("SYNTHQ_API_TOKEN must be at least 16 characters "
                                 "(e.g. $(openssl rand -hex 24))")
        except ValueError as exc:
            raise fail(f"{exc}: the API refuses to start without a real token "
                       "(--dev or SYNTHQ_API_DEV=1 for development)") from None
    from pydantic import ValidationError

    from api.config import ApiSettings

    try:
        ApiSettings()
    except ValidationError as exc:  # e.g. SYNTHQ_API_SESSION_HOURS=abc: one line, not a traceback
        first = exc.errors()[0]
        reason = str(first["msg"]).removeprefix("Value error, ")
        raise fail(f"invalid setting SYNTHQ_{str(first['loc'][0]).upper()}: {reason}") from None
    # The API must not import torch; transformers would whenever it is installed.
    os.environ["SYNTHQ_API_HIDE_TORCH"] = "1"
    import uvicorn

    err.print(f"synthq API on http://{host}:{port} (docs /docs, job page /ui)")
    uvicorn.run("api.app:app", host=host, port=port, proxy_headers=True, log_level="info")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def flower(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="TCP port.")] = 5555,
    address: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    dev: Annotated[bool, typer.Option("--dev", help="Development: allow no basic auth "
                   "(same as SYNTHQ_API_DEV=1).")] = False,
) -> None:
    """Start Flower (Celery tasks and workers) behind basic auth. Extra args go to flower.

    Basic auth comes from FLOWER_BASIC_AUTH=user:password (several: comma-separated),
    never from the command line (it would show in `ps`). Flower's /metrics
    needs it too; only /healthcheck is open.

    Example: `FLOWER_BASIC_AUTH=admin:$(openssl rand -hex 12) synthq flower --address 0.0.0.0`
    """
    from synthq.core.secrets import check_secret
    from synthq.spec.config import get_settings

    if get_settings().embedded:
        raise fail("SYNTHQ_BROKER_URL is not set: Flower watches a Redis broker's workers")
    auth = os.environ.get("FLOWER_BASIC_AUTH", "")
    if any(arg.startswith("--basic-auth") or arg.startswith("--basic_auth") for arg in ctx.args):
        raise fail("pass basic auth in FLOWER_BASIC_AUTH, not on the command line")
    if os.environ.get("FLOWER_UNAUTHENTICATED_API", "").lower() in ("1", "true", "yes"):
        raise fail("FLOWER_UNAUTHENTICATED_API is set: unset it")
    if not _dev(dev):
        pairs = [p for p in auth.split(",") if p]
        try:
            if not pairs:
                raise ValueError("FLOWER_BASIC_AUTH is not set")
            for pair in pairs:
                user, sep, password = pair.partition(":")
                if not user or not sep:
                    raise ValueError("FLOWER_BASIC_AUTH must be user:password (several: "
                                     "comma-separated, so a password may not hold a comma)")
                check_secret("the FLOWER_BASIC_AUTH password", password)
        except ValueError as exc:
            raise fail(f"{exc}: Flower refuses to start without basic auth "
                       "(--dev or SYNTHQ_API_DEV=1 for development)") from None
    os.execv(sys.executable, [sys.executable, "-m", "worker.flower",
                              *flower_args(port, address, ctx.args)])


#: Tasks Flower keeps in memory unless --max-tasks is given (docs/operations.md, "Sizing").
FLOWER_MAX_TASKS = 1_000_000


def flower_args(port: int, address: str, extra: list[str]) -> list[str]:
    """Flower's arguments: ours, then the user's; a --max-tasks of the user's replaces ours
    (not a second one that Flower might read first)."""
    own = [f"--port={port}", f"--address={address}"]
    if not any(a.replace("_", "-").startswith("--max-tasks") for a in extra):
        own.append(f"--max-tasks={FLOWER_MAX_TASKS}")
    return [*own, *extra]

"""The acceptance length a real engine serves with a run's drafter (``synthq serve-check``).

The engine (vLLM started with ``--speculative-config '{"method": "eagle3", "model":
OUT/final, "num_speculative_tokens": K}'``, ``"method": "dflash"`` for a DFlash run) is
sent the run's own held-out prompts, as token ids (``/v1/completions``: no template
applied twice, the very tokens the run's ``eval_acceptance_length`` drafted from),
greedily, for as many tokens as that evaluation generates. The figure is vLLM's own:
its spec-decode counters before and after, ``1 + Δaccepted / Δdrafts``.

The held-out split is read with ``synthq.training.data`` (so torch is imported), the
same code that made it during training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from synthq.core.errors import UserError

__all__ = ["Served", "held_out_prompts", "measure", "spec_counters", "engine_version",
           "describe", "wait_serving"]

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@dataclass
class Served:
    mean: float  # 1 + accepted / drafts: vLLM's mean acceptance length
    drafts: int
    accepted: int
    prompts: int
    tokens: int  # completion tokens the engine generated
    engine: str
    version: str | None


def spec_counters(root: str, client: httpx.Client) -> tuple[float, float]:
    """(drafts, accepted tokens) so far, summed over label sets; raises UserError when
    the server has no spec-decode counters (not started with a draft model)."""
    from synthq.serving.gauges import metrics_url

    body = client.get(metrics_url(root)).text
    found: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith(("#", " ")) or not line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (DRAFTS, ACCEPTED):
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if DRAFTS not in found or ACCEPTED not in found:
        raise UserError(f"{root} reports no {DRAFTS}: is it vLLM started with "
                        "--speculative-config '{\"method\": \"eagle3\" (or \"dflash\"), "
                        "\"model\": RUN/final, ...}'?")
    return found[DRAFTS], found[ACCEPTED]


def wait_serving(root: str, model: str, timeout: float,
                 notice: Callable[[str], None] = lambda _: None) -> None:
    """Wait until the server lists ``model`` (``GET /models``), for at most ``timeout``
    seconds: a vLLM started in the background a moment ago takes minutes to load the
    target and its drafter, and the walkthrough starts serve-check right after it.
    Raises UserError naming the last answer or error when the time is up."""
    deadline = time.monotonic() + timeout
    told = False
    last = "no answer"
    with httpx.Client(timeout=10.0) as client:
        while True:
            try:
                r = client.get(f"{root.rstrip('/')}/models")
                if r.status_code == 200:
                    names = [m.get("id") for m in r.json().get("data", [])]
                    if model in names:
                        return
                    raise UserError(f"{root} serves {names}, not {model!r} (-m)")
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            except (ValueError, AttributeError) as exc:
                raise UserError(f"{root}/models is not an OpenAI model list: {exc}") from None
            if time.monotonic() >= deadline:
                raise UserError(f"{root} did not answer within {timeout:.0f} s ({last}); "
                                "is the engine started (--wait SECONDS waits longer)?")
            if not told:
                notice(f"waiting for {root} to serve {model} (up to {timeout:.0f} s: "
                       f"{last})")
                told = True
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def engine_version(root: str, client: httpx.Client) -> str | None:
    """vLLM's ``/version`` (None when the server has none)."""
    base = root.removesuffix("/").removesuffix("/v1")
    try:
        r = client.get(f"{base}/version")
        return str(r.json()["version"]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def held_out_prompts(output_dir: str | Path, settings: dict[str, Any]
                     ) -> list[tuple[list[int], int]]:
    """The run's held-out prompts and the tokens its evaluation generates after each:
    the same split (seed, ids) and the same rule as ``speculate.acceptance_length``."""
    from synthq.training.config import TrainConfig
    from synthq.training.data import load_examples, split_eval

    cfg = TrainConfig.from_dict(settings)
    data = Path(output_dir) / "data"
    if not (data / "manifest.json").is_file():
        raise UserError(f"{data} holds no exported data: has the run started?")
    _, held = split_eval(load_examples(data, cfg.max_len), cfg.eval_fraction, cfg.seed)
    out = []
    for ex in held:
        ids = [int(t) for t in ex.input_ids]
        first = next((i for i, m in enumerate(ex.loss_mask) if m), len(ids))
        first = max(first, 2)
        n = min(cfg.eval_max_new, len(ids) - first)
        if n >= 1:
            out.append((ids[:first], n))
    if not out:
        raise UserError("the run holds out no examples (eval_fraction 0?): nothing to send")
    return out


def measure(base_url: str, model: str, prompts: Sequence[tuple[list[int], int]], *,
            concurrency: int = 4, timeout: float = 600.0) -> Served:
    """Send every prompt greedily and read the engine's counters around them. Nothing
    else may use the server meanwhile (its counters are global)."""
    base = base_url.rstrip("/")
    with httpx.Client(timeout=timeout) as client:
        version = engine_version(base, client)
        d0, a0 = spec_counters(base, client)

        def one(item: tuple[list[int], int]) -> int:
            ids, n = item
            r = client.post(f"{base}/completions", json={
                "model": model, "prompt": ids, "max_tokens": n, "temperature": 0.0})
            if r.status_code != 200:
                raise UserError(f"{base}/completions answered {r.status_code}: "
                                f"{r.text[:300]}")
            return int(r.json()["usage"]["completion_tokens"])

        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            tokens = sum(pool.map(one, prompts))
        d1, a1 = spec_counters(base, client)
    drafts, accepted = int(d1 - d0), int(a1 - a0)
    return Served(mean=1.0 + accepted / drafts if drafts else 1.0, drafts=drafts,
                  accepted=accepted, prompts=len(prompts), tokens=tokens, engine="vllm",
                  version=version)


def describe(s: Served) -> dict[str, Any]:
    return {"served_acceptance_length": s.mean, "drafts": s.drafts, "accepted": s.accepted,
            "prompts": s.prompts, "tokens": s.tokens, "engine": s.engine,
            "version": s.version}

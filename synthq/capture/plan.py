"""What a capture stage will write, before it writes it.

Bytes per token = captured layers × hidden size × the stored dtype's size; times
the tokens of the job's samples to capture. The hidden size and layer count
come from the target's ``config.json`` (the job's ``--train-target`` or its
tokenizer folder); without one, from the first captured file.

The stored dtype ``auto`` (the default) keeps the engine's own: the plan counts the
dtype of the job's first captured file, else the target's ``config.json`` dtype (what
an engine serving it with ``--dtype auto`` computes in), else float32, and its line
says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from synthq.core.eagle3 import aux_layer_ids
from synthq.core.errors import UserError

__all__ = ["AUTO", "DTYPES", "Plan", "drafter_layers", "target_config", "layers_for",
           "check_space", "auto_dtype"]

#: Stored dtypes and their sizes in bytes.
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1}
#: The stored dtype that keeps the engine's own (the job's default).
AUTO = "auto"


def drafter_layers(num_layers: int) -> list[int]:
    """The drafter's three features (synthq.core.eagle3's rule) and the last layer's output
    (index N, before the final norm), from which training recomputes the target's own
    distribution with its norm and ``lm_head``."""
    return [*aux_layer_ids(num_layers), num_layers]


def target_config(*candidates: str | None) -> dict[str, Any] | None:
    """The first local ``config.json`` among the candidate folders (no hub lookups)."""
    for where in candidates:
        if not where:
            continue
        path = Path(where) / "config.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            text = config.get("text_config", config)  # multimodal wrappers nest it
            if isinstance(text, dict) and "num_hidden_layers" in text:
                for key in ("dtype", "torch_dtype"):  # a wrapper states it at its top
                    if key not in text and key in config:
                        text = {**text, key: config[key]}
                return text
    return None


def layers_for(job: Any) -> list[int]:
    """The job's capture layers: as set, else the drafter's (from the target's config)."""
    if job.capture_layers:
        return [int(i) for i in job.capture_layers]
    config = target_config(job.train_target, job.tokenizer)
    if config is None:
        raise UserError(
            "capture needs the target's layer count: pass --layers (output_hidden_states "
            "indices, e.g. 2,30,58,61) or a --train-target folder with a config.json")
    return drafter_layers(int(config["num_hidden_layers"]))


def auto_dtype(config: dict[str, Any] | None, captured: str | None) -> tuple[str, str]:
    """The dtype ``auto`` stores and why: the engine's, as its first file showed
    (``captured``), else the target's config.json dtype, else float32."""
    if captured in DTYPES:
        return str(captured), "auto: the engine's, as its files hold it"
    for key in ("dtype", "torch_dtype"):
        named = (config or {}).get(key)
        if named in DTYPES:
            return str(named), ("auto: the engine's own, counted as the target's "
                                "config.json dtype until its first file")
    return "float32", "auto: the engine's own, counted as float32 until its first file"


@dataclass(frozen=True, slots=True)
class Plan:
    samples: int
    tokens: int
    layers: list[int]
    #: The dtype the files are stored as (``auto`` resolved: :func:`auto_dtype`).
    dtype: str
    hidden_size: int | None
    free: int
    #: Why that dtype: ``--dtype`` set it, or what ``auto`` read.
    dtype_source: str = "set with --dtype"

    @property
    def bytes_per_token(self) -> int | None:
        if self.hidden_size is None:
            return None
        return len(self.layers) * self.hidden_size * DTYPES[self.dtype]

    @property
    def projected(self) -> int | None:
        per = self.bytes_per_token
        return None if per is None else per * self.tokens

    def line(self) -> str:
        if self.projected is None:
            return (f"capture: {self.samples:,} samples, {self.tokens:,} tokens, layers "
                    f"{self.layers} as {self.dtype} ({self.dtype_source}); size unknown "
                    f"until the first file ({_gb(self.free)} free)")
        return (f"capture: {self.samples:,} samples, {self.tokens:,} tokens × "
                f"{self.bytes_per_token:,} B/token ({len(self.layers)} layers × "
                f"{self.hidden_size} × {DTYPES[self.dtype]} B: {self.dtype}, "
                f"{self.dtype_source}) = about {_gb(self.projected)} ({_gb(self.free)} free)")


def check_space(plan: Plan, *, reserve: int) -> None:
    """Refuse a stage that would not fit, keeping ``reserve`` bytes free (before its
    size is known: refuse when not even ``reserve`` is free)."""
    if plan.projected is None and reserve > plan.free:
        raise UserError(f"the store has {_gb(plan.free)} free, under the {_gb(reserve)} a "
                        "capture keeps spare: free space or set SYNTHQ_CAPTURE_STORE")
    if plan.projected is not None and plan.projected + reserve > plan.free:
        raise UserError(
            f"capture needs about {_gb(plan.projected)} but the store has {_gb(plan.free)} "
            f"free (keeping {_gb(reserve)} spare): free space, point SYNTHQ_CAPTURE_STORE "
            "elsewhere, or store --dtype bfloat16")


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n < 10**11 else f"{n / 1e12:.2f} TB"

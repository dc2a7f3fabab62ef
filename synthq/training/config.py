"""Training hyperparameters (a dataclass saved inside every checkpoint) and ``train_when``.

Each setting's range (or choices) is declared once, beside it in :class:`TrainConfig`
(:func:`_bounded`, :func:`_choice`); :data:`BOUNDS` makes a
:class:`synthq.spec.jobspec.Setting` of each, and :meth:`TrainConfig.check` refuses a value
out of it with the one line that refuses a generation setting (``--epochs is out of
range: ...``). ``synthq train`` checks before it touches the database or torch; the
readiness check and every run check the stored settings again.

No torch here: the CLI and the beat tick validate settings with this module.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from synthq.core.errors import UserError
from synthq.spec import jobspec
from synthq.spec.jobspec import MAX_TOKENS, Setting

__all__ = ["TrainConfig", "When", "parse_when", "parse_size", "DEFAULT_WHEN", "SUPERVISE", "BOUNDS",
           "MAX_COUNT", "MAX_DRAFT_TOKENS", "MAX_SEED"]

#: The default readiness threshold.
DEFAULT_WHEN = "ready"

#: ``TrainConfig.supervise``'s values.
SUPERVISE = ("assistant", "all")

#: Steps, examples and intervals in steps: a run's step counters are ``INTEGER`` columns.
MAX_COUNT = 1_000_000_000
#: Draft tokens a step unrolls or a block drafts (EAGLE-3 trains 7, a DFlash block 15).
MAX_DRAFT_TOKENS = 64
#: The largest seed: a DFlash step seeds its anchors' generator with ``(seed * 1_000_003
#: + rank) * 1_000_033 + step``, which must stay below 2**64 (10**8 overflowed it).
MAX_SEED = 10_000_000


def _bounded(default: float, low: float, high: float, *, low_open: bool = False,
             high_open: bool = False, must: str | None = None) -> Any:
    """A numeric field and its range, inclusive unless open, read by :data:`BOUNDS`."""
    return field(default=default, metadata={"bounds": dict(
        low=low, high=high, low_open=low_open, high_open=high_open, must=must)})


def _choice(default: str, choices: tuple[str, ...]) -> Any:
    """A text field and the values it may take, read by :data:`BOUNDS`."""
    return field(default=default, metadata={"bounds": dict(choices=choices)})


@dataclass
class TrainConfig:
    """Everything that shapes a run. Defaults follow SpecForge/EAGLE-3. Every field carries
    its range: a value a run cannot use (0, a negative, 1e12 epochs, NaN, inf) is refused
    by :meth:`check` before a run row exists."""

    #: The drafter family: ``eagle3`` (vLLM ``method: eagle3``) or ``dflash`` (block
    #: diffusion, vLLM ``method: dflash``), trained from the same features.
    drafter: str = _choice("eagle3", ("eagle3", "dflash"))
    #: The N most frequent supervised token ids (capped to the target's vocabulary).
    draft_vocab_size: int = _bounded(32_000, 1, 1_000_000)
    #: Examples are cut to this many tokens (no longer than a job's example may be).
    max_len: int = _bounded(2048, 3, MAX_TOKENS, must=f"an integer from 3 (the draft "
                            f"predicts two tokens ahead) to {MAX_TOKENS:,}")
    #: Sequences per optimizer step (per process under DDP).
    batch_size: int = _bounded(1, 1, 4096)
    #: SpecForge's default: one epoch leaves a drafter that barely beats an untrained one.
    epochs: int = _bounded(10, 1, 10_000)
    #: Stop after this many steps (0: run all epochs).
    max_steps: int = _bounded(0, 0, MAX_COUNT)
    #: Train on the first N examples of the training split only (0: all of them); the
    #: held-out split is the same whatever N is, so runs of a data curve compare.
    max_examples: int = _bounded(0, 0, MAX_COUNT)
    lr: float = _bounded(1e-4, 0, 1, low_open=True, high_open=True)
    #: Linear warmup steps as a share of all steps, then cosine decay to 0.
    warmup_ratio: float = _bounded(0.02, 0, 1, high_open=True)
    weight_decay: float = _bounded(0.0, 0, 1)
    grad_clip: float = _bounded(0.5, 0, 1e6, low_open=True)
    #: Training-time test: unrolled draft steps and the loss weight decay per step.
    #: DFlash: the draft tokens of a block (its mask slots; block size ttt_steps + 1)
    #: and the loss weight decay per slot.
    ttt_steps: int = _bounded(7, 1, MAX_DRAFT_TOKENS)
    ttt_decay: float = _bounded(0.8, 0, 1, low_open=True)
    #: Which positions the loss covers: ``assistant`` (the loss mask: the tokens the
    #: model generated) or ``all`` (every real position with a next token, prompts and
    #: template included: the labels are the target's own distribution, valid on any
    #: text). Either way only where the target's choice is in the draft vocabulary; the
    #: draft vocabulary and the evaluation do not change.
    supervise: str = _choice("assistant", SUPERVISE)
    #: DFlash only: decoder layers, and blocks (anchors) trained per sequence a step.
    dflash_layers: int = _bounded(2, 1, 32)
    dflash_anchors: int = _bounded(256, 1, 1_000_000)
    #: A resumable checkpoint every this many steps (and at the end).
    save_every: int = _bounded(500, 1, MAX_COUNT)
    #: Metrics written to SQL every this many steps.
    log_every: int = _bounded(10, 1, MAX_COUNT)
    #: ``online``: the target runs inside every step; ``offline``: its hidden
    #: states and logits are computed once per sample and cached as safetensors;
    #: ``captured``: the files of ``synthq capture``; ``stream``: captured through the
    #: job's capture servers ahead of the trainer into a spool of at most ``spool`` bytes
    #: (synthq.training.stream).
    hidden_states: str = _choice("online", ("online", "offline", "captured", "stream"))
    #: ``stream``: the spool's bound in bytes (shared evenly by the DDP ranks; other
    #: features ignore it).
    spool: int = _bounded(0, 0, 10**12 - 1)
    seed: int = _bounded(0, 0, MAX_SEED)
    #: Share of the job's examples held out (never trained on) to measure the
    #: served acceptance length: at least 50 examples, at most a tenth of the job;
    #: 0 turns evaluation off.
    eval_fraction: float = _bounded(0.02, 0, 0.5, high_open=True)
    #: Measure it every this many steps (0: only at the end, which always runs).
    eval_every: int = _bounded(1000, 0, MAX_COUNT)
    #: Draft tokens per verify round, like vLLM's ``num_speculative_tokens``.
    eval_draft_tokens: int = _bounded(4, 1, MAX_DRAFT_TOKENS)
    #: New tokens generated per held-out prompt (at most; EOS stops sooner).
    eval_max_new: int = _bounded(256, 1, MAX_TOKENS)
    #: Step directories kept under checkpoints/ (older ones are deleted).
    keep_checkpoints: int = _bounded(2, 1, 1000)

    def check(self) -> None:
        """Raise :class:`UserError` for a value that cannot work: one out of its declared
        range or choices (:data:`BOUNDS`), or settings that do not go together."""
        for s in BOUNDS.values():
            jobspec.check(s, getattr(self, s.name))
        if self.hidden_states == "stream" and self.spool <= 0:
            raise UserError("--features stream needs --spool SIZE: the most bytes of "
                            "captured features kept on disk at once (e.g. 2G)")
        if self.drafter == "dflash" and self.eval_draft_tokens > self.ttt_steps:
            raise UserError(f"a DFlash block drafts ttt-steps={self.ttt_steps} tokens: "
                            f"eval-draft-tokens {self.eval_draft_tokens} is more than it "
                            "was trained for")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Known fields only (a newer checkpoint's extra keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


#: Each setting of :class:`TrainConfig` as a :class:`synthq.spec.jobspec.Setting` (its type,
#: default, range or choices), by name: what :meth:`TrainConfig.check` holds a value to.
BOUNDS: dict[str, Setting] = {
    f.name: Setting(f.name, type(f.default), f.default, required=True, **f.metadata["bounds"])
    for f in fields(TrainConfig)}


@dataclass(frozen=True)
class When:
    """A parsed ``train_when``: see :func:`parse_when`."""

    kind: str  # ready | done | count | never
    value: float = 0.0

    def met(self, *, done: int, total: int, skipped: int, inflight: int) -> bool:
        """Whether a job with these sample counts should get its training run now."""
        if self.kind == "never" or done == 0:
            return False
        if self.kind == "count":
            return done >= self.value
        fraction = 0.98 if self.kind == "ready" else self.value
        return inflight == 0 and done >= fraction * (total - skipped)

    def __str__(self) -> str:
        if self.kind in ("ready", "never"):
            return self.kind
        return f"{self.kind}:{int(self.value) if self.kind == 'count' else self.value:g}"


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``2G``, ``512M``, ``64k``, ``1.5GiB``, ``1000000``: bytes (binary units). Raises
    :class:`UserError`."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise UserError(f"--spool must be a size such as 2G, 512M or 1000000 (bytes), got "
                        f"{text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_when(text: str) -> When:
    """``ready`` (at least 98 % of non-skipped samples done, none queued or running),
    ``done:F`` (the same with the share F, 0 < F <= 1), ``count:N`` (N samples done,
    whatever is still in flight; N up to :data:`MAX_COUNT`), or ``never``. Raises
    :class:`UserError`."""
    text = text.strip().lower()
    if text in ("ready", "never"):
        return When(text)
    m = re.fullmatch(r"(done|count):([0-9.e+-]+)", text)
    if m:
        try:
            value = float(m.group(2))
        except ValueError:
            value = float("nan")
        if m.group(1) == "done" and 0 < value <= 1:
            return When("done", value)
        if m.group(1) == "count" and 1 <= value <= MAX_COUNT and value == int(value):
            return When("count", value)
    raise UserError(f"train-when must be ready, done:F (0 < F <= 1), count:N (1 <= N <= "
                    f"{MAX_COUNT:,}) or never, got {text!r}")

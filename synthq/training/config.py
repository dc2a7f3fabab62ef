"""Training hyperparameters (a dataclass saved inside every checkpoint) and ``train_when``.

No torch here: the CLI and the beat tick validate settings with this module.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from synthq.errors import UserError

__all__ = ["TrainConfig", "When", "parse_when", "DEFAULT_WHEN", "SUPERVISE"]

#: The default readiness threshold.
DEFAULT_WHEN = "ready"

#: ``TrainConfig.supervise``'s values.
SUPERVISE = ("assistant", "all")


@dataclass
class TrainConfig:
    """Everything that shapes a run. Defaults follow SpecForge/EAGLE-3."""

    #: The drafter family: ``eagle3`` (vLLM ``method: eagle3``) or ``dflash`` (block
    #: diffusion, vLLM ``method: dflash``), trained from the same features.
    drafter: str = "eagle3"
    #: The N most frequent supervised token ids (capped to the target's vocabulary).
    draft_vocab_size: int = 32_000
    #: Examples are cut to this many tokens.
    max_len: int = 2048
    #: Sequences per optimizer step (per process under DDP).
    batch_size: int = 1
    #: SpecForge's default: one epoch leaves a drafter that barely beats an untrained one.
    epochs: int = 10
    #: Stop after this many steps (0: run all epochs).
    max_steps: int = 0
    #: Train on the first N examples of the training split only (0: all of them); the
    #: held-out split is the same whatever N is, so runs of a data curve compare.
    max_examples: int = 0
    lr: float = 1e-4
    #: Linear warmup steps as a share of all steps, then cosine decay to 0.
    warmup_ratio: float = 0.02
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    #: Training-time test: unrolled draft steps and the loss weight decay per step.
    #: DFlash: the draft tokens of a block (its mask slots; block size ttt_steps + 1)
    #: and the loss weight decay per slot.
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    #: Which positions the loss covers: ``assistant`` (the loss mask: the tokens the
    #: model generated) or ``all`` (every real position with a next token, prompts and
    #: template included: the labels are the target's own distribution, valid on any
    #: text). Either way only where the target's choice is in the draft vocabulary; the
    #: draft vocabulary and the evaluation do not change.
    supervise: str = "assistant"
    #: DFlash only: decoder layers, and blocks (anchors) trained per sequence a step.
    dflash_layers: int = 2
    dflash_anchors: int = 256
    #: A resumable checkpoint every this many steps (and at the end).
    save_every: int = 500
    #: Metrics written to SQL every this many steps.
    log_every: int = 10
    #: ``online``: the target runs inside every step; ``offline``: its hidden
    #: states and logits are computed once per sample and cached as safetensors.
    hidden_states: str = "online"
    seed: int = 0
    #: Share of the job's examples held out (never trained on) to measure the
    #: served acceptance length: at least 50 examples, at most a tenth of the job;
    #: 0 turns evaluation off.
    eval_fraction: float = 0.02
    #: Measure it every this many steps (0: only at the end, which always runs).
    eval_every: int = 1000
    #: Draft tokens per verify round, like vLLM's ``num_speculative_tokens``.
    eval_draft_tokens: int = 4
    #: New tokens generated per held-out prompt (at most; EOS stops sooner).
    eval_max_new: int = 256
    #: Step directories kept under checkpoints/ (older ones are deleted).
    keep_checkpoints: int = 2

    def check(self) -> None:
        """Raise :class:`UserError` for a value that cannot work."""
        positive = ("draft_vocab_size", "max_len", "batch_size", "epochs", "ttt_steps",
                    "save_every", "log_every", "eval_draft_tokens", "eval_max_new",
                    "keep_checkpoints", "dflash_layers", "dflash_anchors")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be at least 1, "
                                f"got {getattr(self, name)}")
        if self.max_len < 3:
            raise UserError("max-len must be at least 3 (the draft predicts two tokens ahead)")
        if self.max_steps < 0:
            raise UserError("max-steps must be 0 (all epochs) or more")
        if self.max_examples < 0:
            raise UserError("max-examples must be 0 (all of them) or more")
        if not 0 < self.lr < 1:
            raise UserError(f"lr must be between 0 and 1, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise UserError("warmup-ratio must be in [0, 1)")
        if self.grad_clip <= 0 or self.weight_decay < 0 or not 0 < self.ttt_decay <= 1:
            raise UserError("grad-clip must be > 0, weight-decay >= 0, ttt-decay in (0, 1]")
        if not 0 <= self.eval_fraction < 0.5:
            raise UserError(f"eval-fraction must be in [0, 0.5), got {self.eval_fraction}")
        if self.eval_every < 0:
            raise UserError("eval-every must be 0 (only at the end) or more")
        if self.drafter not in ("eagle3", "dflash"):
            raise UserError(f"drafter must be eagle3 or dflash, got {self.drafter!r}")
        if self.drafter == "dflash" and self.eval_draft_tokens > self.ttt_steps:
            raise UserError(f"a DFlash block drafts ttt-steps={self.ttt_steps} tokens: "
                            f"eval-draft-tokens {self.eval_draft_tokens} is more than it "
                            "was trained for")
        if self.supervise not in SUPERVISE:
            raise UserError(f"supervise must be {' or '.join(SUPERVISE)}, got "
                            f"{self.supervise!r}")
        if self.hidden_states not in ("online", "offline", "captured"):
            raise UserError(f"hidden-states must be online, offline or captured, got "
                            f"{self.hidden_states!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Known fields only (a newer checkpoint's extra keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


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


def parse_when(text: str) -> When:
    """``ready`` (at least 98 % of non-skipped samples done, none queued or running),
    ``done:F`` (the same with the share F, 0 < F <= 1), ``count:N`` (N samples done,
    whatever is still in flight), or ``never``. Raises :class:`UserError`."""
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
        if m.group(1) == "count" and value >= 1 and value == int(value):
            return When("count", value)
    raise UserError(f"train-when must be ready, done:F (0 < F <= 1), count:N (N >= 1) or "
                    f"never, got {text!r}")

"""The drafter families a run can train, and the vLLM method that serves each.

``eagle3`` (:class:`~synthq.training.model.Eagle3Drafter`, vLLM ``method: eagle3``)
drafts one token per step; ``dflash`` (:class:`~synthq.training.dflash.DFlashDrafter`,
vLLM ``method: dflash``) drafts a block in one forward. Both read the same three
target features, so one job's captured or online features train either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from synthq.core.errors import UserError
from synthq.training.config import TrainConfig
from synthq.training.dflash import DFlashConfig, DFlashDrafter
from synthq.training.model import DraftConfig, Eagle3Drafter

__all__ = ["Drafter", "make_drafter", "vllm_method", "speculative_config"]

#: Either family; both answer ``d2t``, ``t2d``, ``draft_to_target``, ``lm_head``,
#: ``config.vllm_config(dtype)`` and ``vllm_state_dict()``.
Drafter = Eagle3Drafter | DFlashDrafter

#: config.json architecture -> vLLM's ``--speculative-config`` method.
_METHODS = {"LlamaForCausalLMEagle3": "eagle3", "DFlashDraftModel": "dflash"}


def make_drafter(cfg: TrainConfig, target_config: Any, draft_vocab_size: int) -> Drafter:
    """An untrained drafter of the run's family, shaped from the target's config."""
    if cfg.drafter == "dflash":
        return DFlashDrafter(DFlashConfig.dflash_from_target(
            target_config, draft_vocab_size, layers=cfg.dflash_layers,
            block_size=cfg.ttt_steps + 1))
    return Eagle3Drafter(DraftConfig.from_target(target_config, draft_vocab_size))


def vllm_method(checkpoint: str | Path) -> str:
    """``eagle3`` or ``dflash``: the method vLLM serves the checkpoint directory with
    (from its config.json); raises UserError for a directory that is no drafter."""
    path = Path(checkpoint) / "config.json"
    try:
        archs = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"{path}: not a drafter checkpoint ({exc})") from None
    for arch in archs:
        if arch in _METHODS:
            return _METHODS[arch]
    raise UserError(f"{path}: architectures {archs} are neither EAGLE-3 nor DFlash")


def speculative_config(checkpoint: str | Path, draft_tokens: int) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for a synthq checkpoint."""
    return {"method": vllm_method(checkpoint), "model": str(checkpoint),
            "num_speculative_tokens": draft_tokens}

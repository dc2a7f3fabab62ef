"""EAGLE-3's training objective: the unrolled training-time test's weighted forward KL
against the target, restricted to the draft vocabulary (DFlash's:
:mod:`synthq.training.dflash_loss`).

Shapes as in :mod:`synthq.training.model`: B batch, L sequence, H hidden size,
T target vocabulary, V draft vocabulary.
"""

from __future__ import annotations

import torch

from synthq.training.data import TargetFeatures, step_mask

__all__ = ["ttt_loss"]


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """``out[:, i] = x[:, i + s]``; the last ``s`` positions are zero."""
    out = torch.zeros_like(x)
    if x.shape[1] > s:
        out[:, :x.shape[1] - s] = x[:, s:]
    return out


def ttt_loss(logits: list[torch.Tensor], feats: TargetFeatures, loss_mask: torch.Tensor,
             draft_to_target: torch.Tensor, decay: float, head: torch.Tensor,
             t2d: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Weighted forward KL of the unrolled steps, and (correct, counted) per step.

    Step k's logits at position i [B, L, V] learn the target's distribution at
    position i+1+k (which predicts token i+2+k), restricted to the draft
    vocabulary and renormalised (its logits recomputed from the last hidden
    state and the draft rows ``head`` [V, H] of its lm_head); supervised where
    ``loss_mask[i+2+k]`` and the target's own choice there is in the draft
    vocabulary (``t2d`` [T] bool, as SpecForge masks). Accuracy counts every
    supervised position (an out-of-vocabulary one is a miss: the drafter cannot
    propose it). Cross-entropy against the target's probabilities equals the
    forward KL up to the target's entropy, a constant.
    """
    total = torch.zeros((), device=logits[0].device)
    target_logits = feats.logits(head.to(logits[0].device))  # [B, L, V]
    in_vocab = t2d.to(feats.top.device)[feats.top]  # [B, L] target argmax in the draft vocab
    stats = []
    for k, lk in enumerate(logits):
        m = step_mask(loss_mask, k).to(lk.device)  # [B, L]
        n = int(m.sum())
        if k == 0 and n == 0:
            raise RuntimeError("a batch with no supervised token reached the loss")
        lm = m & _shift(in_vocab, 1 + k).to(lk.device)  # OOV positions: no loss, no gradient
        p = torch.softmax(_shift(target_logits, 1 + k).float(), dim=-1)
        logq = torch.log_softmax(lk.float(), dim=-1)
        ce = -(p * logq).sum(-1)  # [B, L]
        total = total + (decay ** k) * torch.where(lm, ce, 0.0).sum() / max(int(lm.sum()), 1)
        with torch.no_grad():
            guess = draft_to_target[lk.argmax(-1)]  # [B, L] target ids
            want = _shift(feats.top, 1 + k).to(guess.device)
            stats.append((int(((guess == want) & m).sum()), n))
    return total, stats

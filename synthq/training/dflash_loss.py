"""DFlash's training objective: random anchors per sequence, one block each, a loss per slot.

Shapes as in :mod:`synthq.training.dflash`. A block anchored at position a holds
the data's token x_a and K masks; slot j (1..K) learns the target's distribution
at position a+j-1 (the one that predicts x_{a+j}), where ``loss_mask[a+j]``
says x_{a+j} is a generated token. An anchor is usable when the first slot is
supervised (``loss_mask[a+1]``) and it has context (a >= 1): the same positions
vLLM drafts from, after every verified token.
"""

from __future__ import annotations

import torch

from synthq.training.data import TargetFeatures

__all__ = ["sample_anchors", "block_loss"]


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` distinct usable anchors per row of loss_mask [B, L], drawn at random
    (all of them when fewer): ``(anchors [B, N], keep [B, N] bool)``; a row with fewer
    than N pads with anchor 1, not kept. Raises when the batch has none (a batch with
    no supervised token must not train silently)."""
    B, L = loss_mask.shape
    usable = torch.zeros_like(loss_mask, dtype=torch.bool)  # [B, L]
    if L > 2:
        usable[:, 1:L - 1] = loss_mask[:, 2:].bool()
    counts = usable.sum(1)  # [B]
    if int(counts.sum()) == 0:
        raise RuntimeError("a batch with no supervised token reached the DFlash loss")
    N = min(n, int(counts.max()))
    # Random keys on usable positions, -1 elsewhere: the top N are a uniform sample.
    keys = torch.rand(B, L, generator=generator, device=loss_mask.device)
    keys = torch.where(usable, keys, torch.full_like(keys, -1.0))
    top, idx = keys.topk(N, dim=1)  # [B, N]
    keep = top >= 0
    anchors = torch.where(keep, idx, torch.ones_like(idx))
    order = anchors.argsort(dim=1)  # in position order: easier to read, same loss
    return anchors.gather(1, order), keep.gather(1, order)


def block_loss(logits: torch.Tensor, feats: TargetFeatures, loss_mask: torch.Tensor,
               anchors: torch.Tensor, keep: torch.Tensor, draft_to_target: torch.Tensor,
               decay: float, head: torch.Tensor, t2d: torch.Tensor
               ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Weighted forward KL per slot, and (correct, counted) per slot.

    logits [B, N, K, V] from :meth:`DFlashDrafter.blocks`; the target's features
    [B, L, ...] of the same batch; head [V, H] the draft rows of the target's
    lm_head. Slot j's loss is the cross-entropy against the target's distribution
    (restricted to the draft vocabulary, renormalised) at a+j-1, weighted
    ``decay ** (j-1)`` (later slots are harder and matter less: a draft is cut at
    its first miss), averaged over its supervised positions whose target choice
    is in the draft vocabulary. Accuracy counts every supervised position.
    """
    B, N, K, V = logits.shape
    L = loss_mask.shape[1]
    dev = logits.device
    t = anchors[:, :, None].to(dev) + torch.arange(1, K + 1, device=dev)  # [B, N, K] x_{a+j}
    inside = t < L
    src = (t - 1).clamp(max=L - 1)  # [B, N, K] the target position predicting x_{a+j}
    lm = loss_mask.to(dev).gather(1, t.clamp(max=L - 1).view(B, -1)).view(B, N, K)
    m = lm.bool() & inside & keep.to(dev)[:, :, None]  # [B, N, K] supervised slots
    last = feats.last.to(dev, head.dtype)  # [B, L, H]
    h = last.gather(1, src.view(B, -1, 1).expand(-1, -1, last.shape[-1])).view(B, N, K, -1)
    top = feats.top.to(dev).gather(1, src.view(B, -1)).view(B, N, K)  # [B, N, K] target ids
    in_vocab = t2d.to(dev)[top]
    p = torch.softmax((h @ head.to(dev).T).float(), dim=-1)  # [B, N, K, V]
    ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, N, K]
    total = torch.zeros((), device=dev)
    stats = []
    guess = draft_to_target.to(dev)[logits.detach().argmax(-1)]  # [B, N, K] target ids
    for j in range(K):
        mj, lj = m[:, :, j], m[:, :, j] & in_vocab[:, :, j]
        total = total + (decay ** j) * torch.where(lj, ce[:, :, j], 0.0).sum() \
            / max(int(lj.sum()), 1)
        stats.append((int(((guess[:, :, j] == top[:, :, j]) & mj).sum()), int(mj.sum())))
    if stats[0][1] == 0:
        raise RuntimeError("a batch with no supervised token reached the DFlash loss")
    return total, stats

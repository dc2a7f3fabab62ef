"""The DFlash draft model (block diffusion), tensor for tensor like vLLM's ``qwen3_dflash.py``.

Shapes: B batch, L sequence, Lc context positions, H hidden size (the target's),
T target vocabulary, V draft vocabulary, K draft tokens per block (mask slots),
Q = K + 1 queries per block, N blocks (anchors) per sequence, n draft layers,
nh/nkv query/key-value heads, d head size.

How vLLM drafts with it (``vllm/v1/spec_decode/dflash.py``, 0.32): the target
has verified x_0..x_{a-1} and sampled x_a (the bonus token, the *anchor*). One
forward of the drafter proposes x_{a+1}..x_{a+K} at once::

    ctx    = hidden_norm(fc(concat(3 target layers at 0..a-1)))   [Lc=a, H]  keys/values only
    x      = [embed(x_a), mask, ..., mask]                          [Q, H]     at positions a..a+K
    per layer (pre-norm, Qwen3 attention with q_norm/k_norm per head):
      h    = input_layernorm(x)
      q    = rope(q_norm(q_proj(h)))                                [Q, nh, d]
      keys = [rope(k_norm(k_proj(ctx))), rope(k_norm(k_proj(h)))]  [a + Q, nkv, d]
      vals = [v_proj(ctx), v_proj(h)]
      x    = x + o_proj(attention(q, keys, vals))                  non-causal: every query
      x    = x + mlp(post_attention_layernorm(x))                  sees all context and its block
    logits = lm_head(norm(x))[1:]                                   [K, V]  slot j drafts x_{a+j}

The context is the same ``hidden_norm(fc(aux))`` for every layer (vLLM projects
it once per layer straight into the KV cache); ``mask`` is a learned vector,
shipped as ``mask_embedding.pt`` for ``dflash_config.mask_token_id`` (vLLM swaps
it in for that id); the token embeddings are the target's, frozen and not
shipped (vLLM shares the target's). Training (:meth:`DFlashDrafter.blocks`)
runs N blocks of one sequence in one pass: block b's queries see the context
before its anchor and their own block only.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from synthq.training.model import (
    MLP,
    DraftConfig,
    Eagle3Drafter,
    RMSNorm,
    _rotate_half,
    sglang_layer_ids,
)

__all__ = ["DFlashConfig", "DFlashDrafter", "block_attn_mask", "MASK_EMBEDDING"]

#: The file vLLM reads the mask embedding from (``qwen3_dflash.py``).
MASK_EMBEDDING = "mask_embedding.pt"


@dataclass
class DFlashConfig(DraftConfig):
    """EAGLE-3's shape fields (the target's attention shape, hidden size, RoPE base,
    vocabularies) and DFlash's own."""

    num_layers: int = 2  # draft decoder layers
    block_size: int = 8  # Q: the anchor and K = block_size - 1 mask slots
    mask_token_id: int = 0  # an id of the target's vocabulary; its embedding is replaced

    @classmethod
    def dflash_from_target(cls, cfg: Any, draft_vocab_size: int, *, layers: int,
                           block_size: int) -> DFlashConfig:
        """The drafter's shape from the target's transformers config, ``layers`` decoder
        layers; the mask token is the target's pad id (else its last id)."""
        base = DraftConfig.from_target(cfg, draft_vocab_size)
        pad = getattr(cfg, "pad_token_id", None)
        mask_id = int(pad) if isinstance(pad, int) and 0 <= pad < cfg.vocab_size \
            else cfg.vocab_size - 1
        return cls(**asdict(base), num_layers=layers, block_size=block_size,
                   mask_token_id=mask_id)

    def vllm_config(self, dtype: str) -> dict[str, Any]:
        """``config.json`` as vLLM's DFlash loader reads it.

        ``dflash_config.target_layer_ids`` are the layers whose *output* is a
        feature (vLLM adds one to get ``output_hidden_states`` indices): the
        ``[1, N//2-1, N-4]`` of SpecForge, the same features as EAGLE-3's ``[2,
        N//2, N-3]``, so both families train on the same captured files.
        ``rope_parameters`` is explicit: vLLM's DFlash layer defaults a missing
        RoPE base to 1e6, which would silently rotate differently than training.
        """
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "num_target_layers": self.target_num_layers,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "block_size": self.block_size,
            "dflash_config": {
                "target_layer_ids": sglang_layer_ids(self.target_num_layers),
                "mask_token_id": self.mask_token_id,
                "use_aux_hidden_state": True,
            },
        }

    @classmethod
    def from_vllm(cls, cfg: dict[str, Any]) -> DFlashConfig:
        """Back from a checkpoint's ``config.json``."""
        shape = {f.name: cfg[f.name] for f in fields(DraftConfig) if f.name in cfg}
        return cls(**shape, target_num_layers=cfg["num_target_layers"],
                   num_layers=cfg["num_hidden_layers"], block_size=cfg["block_size"],
                   mask_token_id=cfg["dflash_config"]["mask_token_id"])


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE (vLLM's default) of x [B, heads, P, d] at positions [B, P]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    freqs = positions.float()[..., None] * inv  # [B, P, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, P, d]
    return x * emb.cos().to(x.dtype) + _rotate_half(x) * emb.sin().to(x.dtype)


class Attention(nn.Module):
    """Qwen3 attention: q/k/v over H, a per-head RMSNorm on q and k before RoPE."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.theta = c.rope_theta

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x [B, P, H] at pos [B, P]: [B, nkv, P, d]."""
        B, P, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, P, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, P, self.nkv, self.d).transpose(1, 2)
        return _rope(k, pos, self.theta), v

    def forward(self, h: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor,
                ctx_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h [B, P, H] the queries' states at pos [B, P]; ctx [B, Lc, H] at ctx_pos
        [B, Lc]; mask [B, P, Lc + P] bool (which keys each query sees)."""
        B, P, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(B, P, self.nh, self.d)).transpose(1, 2)
        q = _rope(q, pos, self.theta)  # [B, nh, P, d]
        kc, vc = self._kv(ctx, ctx_pos)  # [B, nkv, Lc, d]
        kq, vq = self._kv(h, pos)  # [B, nkv, P, d]
        rep = self.nh // self.nkv
        k = torch.cat([kc, kq], dim=2).repeat_interleave(rep, dim=1)  # [B, nh, Lc + P, d]
        v = torch.cat([vc, vq], dim=2).repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, nh, P, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, P, self.nh * self.d))


class Layer(nn.Module):
    """One pre-norm decoder layer (``layers.i.*`` in the checkpoint and in vLLM)."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor,
                ctx_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), pos, ctx, ctx_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_attn_mask(anchors: torch.Tensor, ctx_len: int, q: int) -> torch.Tensor:
    """[B, N*Q, Lc + N*Q] bool: block b's Q queries see the context positions before
    its anchor (anchors [B, N]) and the Q keys of their own block, none of another's."""
    B, N = anchors.shape
    dev = anchors.device
    ctx = torch.arange(ctx_len, device=dev)[None, None, :] < anchors[:, :, None]  # [B, N, Lc]
    ctx = ctx.repeat_interleave(q, dim=1)  # [B, N*Q, Lc]
    block = torch.arange(N, device=dev).repeat_interleave(q)  # [N*Q] block of each query
    own = (block[:, None] == block[None, :]).expand(B, -1, -1)  # [B, N*Q, N*Q]
    return torch.cat([ctx, own], dim=2)


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the target's features, ``n`` layers, norm, lm_head over the
    draft vocabulary; the target's embeddings (frozen) and a learned mask embedding."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))  # [H]
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)  # 3H -> H
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # Draft id -> target id is draft id + d2t[draft id]; t2d marks target ids kept.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[V] target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def init_from_target(self, target: nn.Module, draft_ids: torch.Tensor) -> None:
        """As EAGLE-3's: the target's embeddings (frozen) and its lm_head rows of the draft
        vocabulary; and the mask embedding at the mean of the target's embeddings."""
        Eagle3Drafter.init_from_target(self, target, draft_ids)  # type: ignore[arg-type]
        embed = target.get_input_embeddings().weight  # type: ignore[operator]
        with torch.no_grad():
            self.mask_embedding.copy_(embed.detach().float().mean(0).to(self.mask_embedding))

    def blocks(self, input_ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor,
               q: int | None = None) -> torch.Tensor:
        """The draft logits of N blocks per sequence: [B, N, K, V] (slot j = 1..K of block
        b drafts the token at ``anchors[b] + j``).

        input_ids [B, L] (L > every anchor), aux [B, Lc, 3H] the target's features at
        positions 0..Lc-1 (each block uses those before its anchor), anchors [B, N]
        (each >= 1: a block needs context). ``q``: queries per block (default the
        trained block size; vLLM serves ``num_speculative_tokens + 1``)."""
        q = q or self.config.block_size
        B, N = anchors.shape
        dev = aux.device
        ctx = self.hidden_norm(self.fc(aux))  # [B, Lc, 3H] -> [B, Lc, H]
        ctx_pos = torch.arange(ctx.shape[1], device=dev).expand(B, -1)  # [B, Lc]
        first = self.embed_tokens(input_ids.gather(1, anchors))  # [B, N, H] the anchors
        masks = self.mask_embedding.to(first.dtype).expand(B, N, q - 1, -1)  # [B, N, K, H]
        x = torch.cat([first[:, :, None], masks], dim=2).reshape(B, N * q, -1)  # [B, N*Q, H]
        pos = (anchors[:, :, None] + torch.arange(q, device=dev)).reshape(B, N * q)
        mask = block_attn_mask(anchors, ctx.shape[1], q)  # [B, N*Q, Lc + N*Q]
        for layer in self.layers:
            x = layer(x, pos, ctx, ctx_pos, mask)
        logits = self.lm_head(self.norm(x)).view(B, N, q, -1)  # [B, N, Q, V]
        return logits[:, :, 1:]  # slot 0 (the anchor itself) drafts nothing

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        return self.blocks(input_ids, aux, anchors)

    @torch.no_grad()
    def propose(self, tokens: list[int], aux: torch.Tensor, k: int) -> list[int]:
        """``k`` draft tokens after ``tokens`` (x_0..x_a, x_a the anchor), given aux
        [1, a, 3H] of x_0..x_{a-1}: one forward, as vLLM drafts (``k`` + 1 queries)."""
        device = self.d2t.device
        a = len(tokens) - 1
        ids = torch.tensor([tokens], device=device)
        anchors = torch.tensor([[a]], device=device)
        logits = self.blocks(ids, aux.to(device, self.fc.weight.dtype), anchors, q=k + 1)
        return [int(t) for t in self.draft_to_target[logits[0, 0].argmax(-1)]]

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors of ``model.safetensors``, named as vLLM's DFlash loader loads them:
        no embeddings (the target's are shared) and no mask embedding (its own file)."""
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()
              if not k.startswith("embed_tokens.") and k != "mask_embedding"}
        if self.config.draft_vocab_size == self.config.vocab_size:
            # As for EAGLE-3: vLLM makes no draft_id_to_target_id when the vocabularies
            # are equal, and a d2t tensor would then fail the load.
            del sd["d2t"], sd["t2d"]
        return sd

    def mask_embedding_file(self) -> bytes:
        """``mask_embedding.pt``: ``{"mask_token_id", "embedding" [H]}`` (vLLM checks the id
        against ``dflash_config.mask_token_id``)."""
        buf = io.BytesIO()
        torch.save({"mask_token_id": self.config.mask_token_id,
                    "embedding": self.mask_embedding.detach().float().cpu().clone()}, buf)
        return buf.getvalue()

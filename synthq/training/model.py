"""The EAGLE-3 draft model, laid out tensor for tensor like vLLM's ``llama_eagle3.py``.

Shapes: B batch, L sequence, H hidden size (the target's), T target vocabulary,
V draft vocabulary, nh/nkv query/key-value heads, d head size.

One draft step over positions ``i``::

    embeds  = embed_tokens(token at i+1+k)            [B, L, H]  frozen copy of the target's
    hidden  = fc(concat(3 target layers at i)) (k=0)  [B, L, H]  fc: 3H -> H
            | the previous step's output      (k>0)
    x       = concat(input_layernorm(embeds), hidden_norm(hidden))   [B, L, 2H]
    h       = hidden + o_proj(attention(q/k/v_proj(x)))              q/k/v take 2H
    h       = h + mlp(post_attention_layernorm(h))                   [B, L, H]
    logits  = lm_head(norm(h))                                       [B, L, V]

``h`` (before the final norm) is the next step's ``hidden``. Training-time test
(:meth:`Eagle3Drafter.unroll`) runs ``k = 0..K-1`` the way vLLM drafts: step k
at position i attends to step 0's keys at positions <= i (causal) and to its
own and earlier steps' keys at position i only, at RoPE position i + k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from synthq.core.eagle3 import aux_layer_ids

__all__ = ["DraftConfig", "Eagle3Drafter", "aux_layer_ids", "sglang_layer_ids", "StepCache",
           "step_attn_mask"]


def sglang_layer_ids(num_layers: int) -> list[int]:
    """The same features in SGLang's and SpecForge's convention (the nested
    ``eagle_config`` key): the index of the layer whose *output* is captured.

    SGLang captures the input of layer ``val + 1`` (``layers_to_capture = [val + 1
    ...]``), SpecForge hooks the output of layer ``val``: both land on vLLM's
    ``output_hidden_states`` index ``val + 1``.
    """
    return [i - 1 for i in aux_layer_ids(num_layers)]


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    max_position_embeddings: int
    target_num_layers: int

    @classmethod
    def from_target(cls, cfg: Any, draft_vocab_size: int) -> DraftConfig:
        """The drafter's shape from the target's transformers config."""
        heads = cfg.num_attention_heads
        rope = getattr(cfg, "rope_theta", None)
        if rope is None:
            rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   num_attention_heads=heads,
                   num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(rope),
                   vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab_size,
                   max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
                   target_num_layers=cfg.num_hidden_layers)

    def vllm_config(self, dtype: str) -> dict[str, Any]:
        """``config.json`` of the checkpoint, for every engine.

        Each engine reads the aux layers from a different key with a different rule:

        - vLLM: the top-level ``eagle_aux_hidden_state_layer_ids``, used as-is as
          ``output_hidden_states`` indices (the input of layer i): ``[2, N//2, N-3]``.
        - SGLang: the nested ``eagle_config.eagle_aux_hidden_state_layer_ids``, plus
          one (it captures the input of layer ``val + 1``): so the nested key holds
          ``[1, N//2-1, N-4]``.
        - SpecForge (training further): the nested key, as the layers whose output
          it hooks: ``[1, N//2-1, N-4]``, the same features.
        """
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "eagle_aux_hidden_state_layer_ids": aux_layer_ids(self.target_num_layers),
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(self.target_num_layers),
                "use_aux_hidden_state": True,
            },
        }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rope(nn.Module):
    """Neox-style rotary embedding (vLLM's Llama default)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [B, heads, P, d]; positions [P]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [P, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # q/k/v read the 2H concat of normed embeddings and normed hidden states.
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, c.hidden_size, bias=False)
        self.rope = Rope(self.d, c.rope_theta)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The one decoder layer (``midlayer.*`` in the checkpoint, ``layers.0`` in vLLM)."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on embeddings
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on hidden states
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


@dataclass
class StepCache:
    """Keys/values of the steps run so far: step 0 over all positions, later steps per position."""

    k0: torch.Tensor  # [B, nkv, L, d]  step 0, RoPE at positions 0..L-1
    v0: torch.Tensor
    ks: list[torch.Tensor]  # steps 1..: [B, nkv, P, d] at the last P positions
    vs: list[torch.Tensor]


#: Queries per SDPA call: the transient scores are [ATTN_CHUNK, L + k*ATTN_CHUNK].
ATTN_CHUNK = 512


def _attend(q: torch.Tensor, L: int, *kv: torch.Tensor) -> torch.Tensor:
    """Attention of draft step k's queries q [B, nh, P, d] (the last P of L positions)
    over step 0's keys/values [B, nh, L, d] (causal) and steps 1..k's [B, nh, P, d]
    (each at the query's own position): ``kv`` is the k+1 keys then the k+1 values.

    SDPA with the step mask, over chunks of ATTN_CHUNK queries: a chunk needs only
    the causal keys up to its last position and the diagonal keys of its own
    positions, so the transient scores stay [chunk, L + k*chunk] (linear in L)."""
    n = len(kv) // 2
    keys, values = kv[:n], kv[n:]
    P = q.shape[2]
    outs = []
    for a in range(0, P, ATTN_CHUNK):
        b = min(P, a + ATTN_CHUNK)
        end = L - P + b  # causal keys 0..end-1
        kc = torch.cat([keys[0][:, :, :end], *(kj[:, :, a:b] for kj in keys[1:])], dim=2)
        vc = torch.cat([values[0][:, :, :end], *(vj[:, :, a:b] for vj in values[1:])], dim=2)
        mask = step_attn_mask(end, b - a, n - 1, q.device)  # [b-a, end + k*(b-a)]
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], kc, vc, attn_mask=mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def step_attn_mask(L: int, P: int, k: int, device: torch.device) -> torch.Tensor:
    """[P, L + k*P] bool: which keys the queries of draft step k (at the last P of L
    positions) see. Step 0's keys causally (key j <= query position), and each
    later step's key at the query's own position only (the diagonal)."""
    qpos = torch.arange(L - P, L, device=device)
    causal = torch.arange(L, device=device)[None, :] <= qpos[:, None]  # [P, L]
    diag = torch.eye(P, dtype=torch.bool, device=device).repeat(1, k)  # [P, k*P]
    return torch.cat([causal, diag], dim=1)


class Eagle3Drafter(nn.Module):
    """fc + one decoder layer over 2H inputs + norm + lm_head over the draft vocabulary."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
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
        """Copy the target's embeddings (frozen) and its lm_head rows of the draft vocabulary."""
        embed = target.get_input_embeddings().weight  # type: ignore[operator]
        head = target.get_output_embeddings().weight  # type: ignore[operator]
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.detach().to(self.embed_tokens.weight))
            self.lm_head.weight.copy_(head.detach()[draft_ids.to(head.device)]
                                      .to(self.lm_head.weight))

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, k: int,
             cache: StepCache | None) -> tuple[torch.Tensor, torch.Tensor, StepCache]:
        """One draft step at the last P positions of an L-long sequence.

        token_ids [B, P] (the token at i+1+k), hidden [B, P, H] (3H for k=0: fc
        applies). Step 0 needs P = L and no cache. Returns logits [B, P, V],
        the new hidden [B, P, H] and the cache extended by this step.
        """
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)  # [B, P, 3H] -> [B, P, H]
        layer = self.midlayer
        attn = layer.self_attn
        B, P, _ = hidden.shape
        x = torch.cat([layer.input_layernorm(self.embed_tokens(token_ids)),
                       layer.hidden_norm(hidden)], dim=-1)  # [B, P, 2H]
        q = attn.q_proj(x).view(B, P, attn.nh, attn.d).transpose(1, 2)  # [B, nh, P, d]
        kk = attn.k_proj(x).view(B, P, attn.nkv, attn.d).transpose(1, 2)  # [B, nkv, P, d]
        vv = attn.v_proj(x).view(B, P, attn.nkv, attn.d).transpose(1, 2)
        L = P if cache is None else cache.k0.shape[2]
        pos = torch.arange(L - P, L, device=x.device) + k  # RoPE position of step k: i + k
        q, kk = attn.rope(q, pos), attn.rope(kk, pos)
        if cache is None:
            if k != 0:
                raise ValueError("step k > 0 needs the cache of step 0")
            cache = StepCache(kk, vv, [], [])
        else:
            cache = StepCache(cache.k0, cache.v0, [*cache.ks, kk], [*cache.vs, vv])
        rep = attn.nh // attn.nkv
        ks = [kj.repeat_interleave(rep, dim=1) for kj in (cache.k0, *cache.ks)]
        vs = [vj.repeat_interleave(rep, dim=1) for vj in (cache.v0, *cache.vs)]
        if torch.is_grad_enabled() and P > ATTN_CHUNK:
            # Recomputed in backward: only q/k/v are kept, never a step's [P, L] scores.
            out = checkpoint(_attend, q, L, *ks, *vs, use_reentrant=False)
        else:
            out = _attend(q, L, *ks, *vs)  # [B, nh, P, d]
        out = attn.o_proj(out.transpose(1, 2).reshape(B, P, attn.nh * attn.d))
        h = hidden + out  # residual over the hidden input (vLLM: residual = hidden_states)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)), h, cache

    def unroll(self, input_ids: torch.Tensor, aux: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
        """Training-time test over a batch: the logits of steps 0..steps-1.

        input_ids [B, L] the tokens, aux [B, L, 3H] the target features at each
        position. Step k's logits at position i predict token i+2+k, from the
        token at i+1+k (teacher-forced: the data's own token) and step k-1's
        hidden state at i. Positions whose input token lies past the end get a
        0 token (they are masked out of the loss).
        """
        B, L = input_ids.shape
        hidden: torch.Tensor = aux
        cache: StepCache | None = None
        out = []
        for k in range(steps):
            tokens = torch.zeros_like(input_ids)
            if L - 1 - k > 0:
                tokens[:, :L - 1 - k] = input_ids[:, 1 + k:]  # token i+1+k at position i
            logits, hidden, cache = self.step(tokens, hidden, k, cache)
            out.append(logits)
        return out

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
        return self.unroll(input_ids, aux, steps)

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors of the checkpoint, named as vLLM's llama_eagle3 loads them."""
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()
              if not k.startswith("embed_tokens.")}  # vLLM takes the target's embeddings
        if self.config.draft_vocab_size == self.config.vocab_size:
            # vLLM makes no draft_id_to_target_id parameter when the vocabularies are
            # equal, and a d2t tensor then fails its load ("no module or parameter
            # named 'draft_id_to_target_id'"): the draft ids are the target's.
            del sd["d2t"], sd["t2d"]
        return sd

"""An EAGLE-3 drafter written from vLLM's ``llama_eagle3.py`` semantics, sharing no code
with ``synthq.training``: its own RMSNorm, RoPE, attention with a per-position KV cache,
its own weight-name remapping, and its own draft-and-verify loop.

What it follows (vLLM ``model_executor/models/llama_eagle3.py`` and the EAGLE proposer):

- parameters after ``load_weights``: ``model.fc``, ``model.layers.0.self_attn.qkv_proj``
  (q, k, v stacked), ``o_proj``, ``model.layers.0.mlp.gate_up_proj`` (gate, up stacked),
  ``down_proj``, ``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``,
  ``model.norm``, ``lm_head``; ``draft_id_to_target_id`` only when ``draft_vocab_size``
  differs from the *target's* vocabulary (``Eagle3LlamaForCausalLM.__init__``: it is
  None otherwise, so a ``d2t`` tensor then fails the load; when it exists and the file
  has no ``d2t`` it keeps its zeros, the identity); ``model.embed_tokens`` optional
  (the target's when absent). Renames: ``midlayer.`` -> ``layers.0.``, ``d2t`` ->
  ``draft_id_to_target_id``, every name but ``lm_head`` gets ``model.``; ``t2d`` is
  skipped; any other name has no parameter and fails the load.
- layer 0: ``embeds = input_layernorm(embed(tokens))``, ``residual = hidden``,
  ``hidden = hidden_norm(hidden)``, attention over ``cat(embeds, hidden)``, then
  ``h = attn + residual``, ``h = h + mlp(post_attention_layernorm(h))``; logits from
  ``lm_head(norm(h))``; the pre-norm ``h`` is the next draft step's hidden state.
- the first draft pass runs over the verified tokens shifted left by one at their
  own positions, with ``fc`` over the target's aux hidden states; draft step j runs
  one token at position ``L - 1 + j`` and attends to every cached key at a position
  <= its own (a KV cache indexed by position, as vLLM's paged cache is).
- a draft id maps to target id ``id + draft_id_to_target_id[id]``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


class RefDrafter:
    def __init__(self, directory: Path, target: Any) -> None:
        from safetensors.torch import load_file

        self.cfg = json.loads((directory / "config.json").read_text())
        c = self.cfg
        self.H, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], \
            c["num_key_value_heads"]
        self.d = c.get("head_dim") or self.H // self.nh
        self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]
        q, kv, inter = self.nh * self.d, self.nkv * self.d, c["intermediate_size"]
        fc_in = 3 * c.get("target_hidden_size", self.H)
        shapes = {
            "model.fc.weight": (self.H, fc_in),
            "model.layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, 2 * self.H),
            "model.layers.0.self_attn.o_proj.weight": (self.H, q),
            "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, self.H),
            "model.layers.0.mlp.down_proj.weight": (self.H, inter),
            "model.layers.0.input_layernorm.weight": (self.H,),
            "model.layers.0.hidden_norm.weight": (self.H,),
            "model.layers.0.post_attention_layernorm.weight": (self.H,),
            "model.norm.weight": (self.H,),
            "model.embed_tokens.weight": (c["vocab_size"], self.H),
            "lm_head.weight": (c["draft_vocab_size"], self.H),
        }
        self.p = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        # vLLM compares the draft vocabulary with the target model's config, not the
        # drafter's own vocab_size.
        self.mapped = c["draft_vocab_size"] != target.config.vocab_size
        if self.mapped:
            self.p["draft_id_to_target_id"] = torch.zeros(c["draft_vocab_size"],
                                                          dtype=torch.long)
        self.loaded: set[str] = set()
        stacked = [(".q_proj", ".qkv_proj", (0, q)), (".k_proj", ".qkv_proj", (q, q + kv)),
                   (".v_proj", ".qkv_proj", (q + kv, q + 2 * kv)),
                   (".gate_proj", ".gate_up_proj", (0, inter)),
                   (".up_proj", ".gate_up_proj", (inter, 2 * inter))]
        has_embed = False
        for name, w in load_file(str(directory / "model.safetensors")).items():
            if "t2d" in name:
                continue
            if "d2t" in name:
                name = name.replace("d2t", "draft_id_to_target_id")
            elif "lm_head" not in name:
                name = "model." + name
            name = name.replace("midlayer.", "layers.0.")
            has_embed |= "embed_tokens" in name
            for shard, fused, (a, b) in stacked:
                if shard in name:
                    name = name.replace(shard, fused)
                    param = self.p[name]  # KeyError: vLLM has no such parameter
                    if tuple(w.shape) != (b - a, param.shape[1]):
                        raise ValueError(f"{name} shard {shard}: shape {tuple(w.shape)}")
                    param[a:b] = w.to(param.dtype)
                    self.loaded.add(f"{name}{shard}")
                    break
            else:
                param = self.p[name]  # KeyError: vLLM has no such parameter
                if tuple(w.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: shape {tuple(w.shape)}, wants {param.shape}")
                self.p[name] = w.to(param.dtype).clone()
                self.loaded.add(name)
        if not has_embed:
            self.p["model.embed_tokens.weight"] = \
                target.get_input_embeddings().weight.detach().float().clone()

    def unloaded(self) -> list[str]:
        """Parameters vLLM would leave uninitialised (embed_tokens comes from the target)."""
        out = []
        for name, value in self.p.items():
            if name == "model.embed_tokens.weight":
                continue
            if value.is_floating_point() and bool(torch.isnan(value).any()):
                out.append(name)
        return out

    # --- the forward, written from vLLM's semantics --------------------------------------

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.p[name] * (x.float() / torch.sqrt(var + self.eps))

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        # x [heads, d], neox style: the first half pairs with the second half
        half = self.d // 2
        out = torch.empty_like(x)
        for i in range(half):
            angle = pos / (self.theta ** (2 * i / self.d))
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[:, i], x[:, i + half]
            out[:, i] = a * c - b * s
            out[:, i + half] = b * c + a * s
        return out

    def _forward_one(self, token: int, hidden: torch.Tensor, pos: int,
                     kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token at ``pos``: writes its key/value at ``pos`` into ``kv``, attends to
        every cached position <= pos. hidden [H]. Returns (logits [V], pre-norm h [H])."""
        pre = "model.layers.0."
        embeds = self._norm(self.p["model.embed_tokens.weight"][token],
                            pre + "input_layernorm.weight")
        residual = hidden
        x = torch.cat([embeds, self._norm(hidden, pre + "hidden_norm.weight")])
        qkv = self.p[pre + "self_attn.qkv_proj.weight"] @ x
        qd, kvd = self.nh * self.d, self.nkv * self.d
        q = self._rope(qkv[:qd].view(self.nh, self.d), pos)
        k = self._rope(qkv[qd:qd + kvd].view(self.nkv, self.d), pos)
        v = qkv[qd + kvd:].view(self.nkv, self.d)
        kv[pos] = (k, v)
        seen = sorted(p for p in kv if p <= pos)
        keys = torch.stack([kv[p][0] for p in seen])  # [S, nkv, d]
        vals = torch.stack([kv[p][1] for p in seen])
        group = self.nh // self.nkv
        heads = []
        for h in range(self.nh):
            scores = keys[:, h // group] @ q[h] / math.sqrt(self.d)  # [S]
            w = torch.softmax(scores, dim=0)
            heads.append(w @ vals[:, h // group])
        attn = self.p[pre + "self_attn.o_proj.weight"] @ torch.cat(heads)
        h1 = attn + residual
        y = self._norm(h1, pre + "post_attention_layernorm.weight")
        inter = self.cfg["intermediate_size"]
        gu = self.p[pre + "mlp.gate_up_proj.weight"] @ y
        mlp = self.p[pre + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(gu[:inter])
                                                     * gu[inter:])
        h2 = h1 + mlp
        logits = self.p["lm_head.weight"] @ self._norm(h2, "model.norm.weight")
        return logits, h2

    def to_target(self, draft_id: int) -> int:
        if not self.mapped:  # the logits are over the target's vocabulary already
            return draft_id
        return int(draft_id + self.p["draft_id_to_target_id"][draft_id])

    @torch.no_grad()
    def propose(self, tokens: list[int], aux: torch.Tensor, k: int) -> list[int]:
        """``k`` drafts after ``tokens`` (x_0..x_L); aux [L, 3H] of x_0..x_{L-1}."""
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        fc = self.p["model.fc.weight"]
        L = len(tokens) - 1
        logits = hidden = torch.empty(0)
        for i in range(L):  # the first pass: token i+1 at position i
            logits, hidden = self._forward_one(tokens[i + 1], fc @ aux[i].float(), i, kv)
        drafts = [self.to_target(int(logits.argmax()))]
        for j in range(1, k):
            logits, hidden = self._forward_one(drafts[-1], hidden, L - 1 + j, kv)
            drafts.append(self.to_target(int(logits.argmax())))
        return drafts


def target_step(target: Any, tokens: list[int], layer_ids: list[int]
                ) -> tuple[list[int], torch.Tensor]:
    """The target's greedy choice after each prefix, and [L, 3H] aux states read with
    vLLM's rule (``output_hidden_states`` index i = the input of layer i)."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([tokens]), output_hidden_states=True,
                     use_cache=False)
    aux = torch.cat([out.hidden_states[i][0] for i in layer_ids], dim=-1)
    return out.logits[0].argmax(-1).tolist(), aux


def ref_speculate(target: Any, ref: RefDrafter, prompt: list[int], max_new: int, k: int
                  ) -> tuple[list[int], list[int]]:
    """Greedy draft-and-verify with the reference drafter (vLLM's rejection rule at
    temperature 0: accept while the draft equals the target's argmax, then the
    target's own token). Returns the new tokens and the tokens gained per round."""
    layer_ids = ref.cfg["eagle_aux_hidden_state_layer_ids"]
    preds, aux = target_step(target, prompt, layer_ids)
    seq = [*prompt, preds[-1]]
    new, lengths = [preds[-1]], []
    while len(new) < max_new:
        drafts = ref.propose(seq, aux[:len(seq) - 1], k)
        preds, aux = target_step(target, seq + drafts, layer_ids)
        t = len(seq) - 1
        m = 0
        while m < k and drafts[m] == preds[t + m]:
            m += 1
        gained = [*drafts[:m], preds[t + m]]
        seq += gained
        new += gained
        lengths.append(len(gained))
    return new[:max_new], lengths

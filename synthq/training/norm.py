"""The target's own final norm, as transformers computes it for the target's model type.

Captured features hold the last layer's output *before* the final norm (the engine
captures layer outputs); training and the SpecForge export apply the norm themselves.
RMSNorms differ by model type in how they use their weight ``w`` on
``x̂ = x / sqrt(mean(x²) + eps)``:

* ``weight``: ``w · x̂`` (Llama, Qwen2/3, Mistral, DeepSeek-V3, Kimi, gpt-oss ...);
* ``one_plus_weight``: ``(1 + w) · x̂`` (Gemma, Gemma 2/3, Qwen3.5, Qwen3-Next ...;
  their weights are stored around zero, so a ``w · x̂`` reading all but zeroes them).

The style is not guessed from a name list: :func:`norm_style` builds transformers'
own RMSNorm class of the model type with known weights and reads which of the two it
computes. A model type transformers does not know, or a norm that is neither (a
LayerNorm with a mean and a bias), fails loudly instead of training on wrong targets.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from functools import lru_cache
from typing import Any

import torch

from synthq.core.errors import UserError

__all__ = ["STYLES", "norm_style", "apply_norm"]

#: The RMSNorm weight styles synthq computes.
STYLES = ("weight", "one_plus_weight")


def _norm_class(model_type: str, architectures: tuple[str, ...]) -> type[Any]:
    """transformers' RMSNorm class of the model type's causal LM (``<Prefix>RMSNorm``,
    the class its ``model.norm`` is made of); for a model type transformers does not
    ship (remote code), that of a class its ``architectures`` name that it does."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers = importlib.import_module("transformers")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or next(
        (a for a in architectures if hasattr(transformers, a)), None)
    if not name:
        raise UserError(f"the target's model type {model_type!r} has no transformers causal "
                        "LM here, so its final norm is unknown: synthq applies only norms it "
                        "has checked (Llama's w·x̂, Gemma's (1+w)·x̂)")
    module = sys.modules[getattr(transformers, name).__module__]
    prefix = name.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration")
    classes = {n: c for n, c in vars(module).items() if inspect.isclass(c)}
    found = classes.get(f"{prefix}RMSNorm") or next(
        (c for n, c in classes.items() if n.endswith("RMSNorm")), None)
    if found is None:
        raise UserError(f"the target's model type {model_type!r} has no RMSNorm in "
                        f"{module.__name__}: its final norm is not one synthq computes")
    return found


@lru_cache(maxsize=64)
def _probe(model_type: str, architectures: tuple[str, ...]) -> str:
    cls = _norm_class(model_type, architectures)
    hidden, eps = 8, 1e-6
    try:
        norm = cls(hidden, eps=eps)
    except TypeError:
        norm = cls(hidden)
        eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", eps)))
    params = dict(norm.named_parameters())
    if set(params) != {"weight"}:
        raise UserError(f"{cls.__name__} (model type {model_type!r}) has parameters "
                        f"{sorted(params)}, not one weight: not a norm synthq computes")
    x = torch.linspace(-2.0, 3.0, 3 * hidden).reshape(3, hidden)
    w = torch.linspace(-0.5, 1.5, hidden)
    with torch.no_grad():
        params["weight"].copy_(w)
        got = norm(x).float()
    for style in STYLES:
        if torch.allclose(got, apply_norm(style, w, x, eps), atol=1e-5, rtol=1e-5):
            return style
    raise UserError(f"{cls.__name__} (model type {model_type!r}) computes neither w·x̂ nor "
                    "(1+w)·x̂: synthq does not know this target's final norm")


def norm_style(config: Any) -> str:
    """``weight`` or ``one_plus_weight`` for the target's (text) config; UserError for a
    norm synthq does not compute."""
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    if not model_type:
        raise UserError("the target's config has no model_type: its final norm is unknown")
    architectures = tuple(str(a) for a in getattr(config, "architectures", None) or ())
    return _probe(str(model_type), architectures)


def apply_norm(style: str, weight: torch.Tensor, hidden: torch.Tensor,
               eps: float) -> torch.Tensor:
    """The final RMSNorm of ``hidden`` [..., H] in float32 with ``weight`` [H]."""
    h = hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "weight":
        return weight.float() * h
    if style == "one_plus_weight":
        return (1.0 + weight.float()) * h
    raise ValueError(f"unknown norm style {style!r}")

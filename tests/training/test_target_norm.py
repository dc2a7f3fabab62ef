"""The target's own final norm (synthq.training.norm): the style is read from
transformers' norm of the model type, and the captured last layer through it and the
target's ``lm_head`` gives transformers' logits, for Llama's ``w·x̂`` and Gemma's
``(1+w)·x̂``, on targets whose norm weights are far from ones (saved, loaded back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from training_support import VOCAB, capture_file

from synthq.core.errors import UserError
from synthq.training.captured import load_target_head
from synthq.training.norm import norm_style


@pytest.mark.parametrize("style", ["weight", "one_plus_weight"])
def test_the_captured_last_layer_through_the_targets_norm_gives_its_logits(
        norm_targets: dict[str, tuple[Path, Any]], style: str, tmp_path: Path) -> None:
    path, target = norm_targets[style]
    head = load_target_head(str(path))
    assert head.norm_style == style
    ids = np.random.default_rng(0).integers(3, VOCAB, 48).astype(np.int64)
    capture_file(target, ids, tmp_path / "c.safetensors")
    pre = load_file(str(tmp_path / "c.safetensors"))["hidden_states"][:, 3]
    with torch.no_grad():
        out = target(input_ids=torch.from_numpy(ids)[None], output_hidden_states=True)
    normed = head.final_norm(pre)
    torch.testing.assert_close(normed, out.hidden_states[-1][0], atol=1e-5, rtol=1e-5)
    logits = normed @ head.head.T
    assert torch.equal(logits.argmax(-1), out.logits[0].argmax(-1))
    # The other style would not: the weights are far from ones, so the test can see it.
    other = "weight" if style == "one_plus_weight" else "one_plus_weight"
    head.norm_style = other
    assert not torch.equal((head.final_norm(pre) @ head.head.T).argmax(-1),
                           out.logits[0].argmax(-1))


def test_a_norm_synthq_does_not_compute_fails_loudly() -> None:
    from transformers import AutoConfig, CohereConfig

    assert norm_style(AutoConfig.for_model("qwen3_next")) == "one_plus_weight"
    assert norm_style(AutoConfig.for_model("deepseek_v3")) == "weight"
    with pytest.raises(UserError, match="not one synthq computes"):
        norm_style(CohereConfig())  # a LayerNorm
    # Remote code (Kimi-K2's kimi_k2) names a class transformers ships: its norm.
    remote = type("C", (), {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]})
    assert norm_style(remote()) == "weight"
    with pytest.raises(UserError, match="no transformers causal LM"):
        norm_style(type("C", (), {"model_type": "no-such-model"})())

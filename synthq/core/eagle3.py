"""EAGLE-3's layer rule, torch-free: which target layers a drafter reads.

The drafter is fed the target's hidden states at three ``output_hidden_states``
indices, ``[2, N//2, N-3]`` for a target of N layers (vLLM's default
``eagle_aux_hidden_state_layer_ids``). Index i is the input of layer i (the output
of layer i-1), so they are the outputs of layers ``[1, N//2-1, N-4]``; distinct
for N >= 7. Training (synthq.training.model) and the capture stage's plan
(synthq.capture.plan) both read it here.
"""

from __future__ import annotations

__all__ = ["aux_layer_ids"]


def aux_layer_ids(num_layers: int) -> list[int]:
    """``output_hidden_states`` indices of the three target features (vLLM's default)."""
    return [2, num_layers // 2, num_layers - 3]

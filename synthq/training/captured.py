"""Training features from the capture stage's files: no target model in this process.

The capture stage (synthq.capture) stored, per sample, the hidden states that
the serving engine computed at ``[2, N//2, N-3, N]``: the drafter's three
features and the last layer's output before the final norm. Training needs
three more things from the target, loaded alone from its safetensors shards:
its embeddings (the drafter's, frozen), its final norm and its ``lm_head``
(the target's distribution is ``lm_head(norm(h_N))``, as the target computes it:
the norm's style is its model type's, synthq.training.norm).

So a target that only a serving engine can run (1T parameters on 8 GPUs) trains
a drafter on one GPU: the embeddings, norm and head of such a model are a few GB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from synthq.core.errors import UserError
from synthq.training.data import Example, FeatureCache
from synthq.training.norm import apply_norm, norm_style

__all__ = ["TargetHead", "load_target_head", "CapturedFeatures", "captured_paths"]

_EMBED = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
          "embed_tokens.weight")
_NORM = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")
_HEAD = ("lm_head.weight",)


class _Weight:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


@dataclass
class TargetHead:
    """What training takes from the target when the features were captured: its config,
    embeddings [Vt, H], final RMSNorm weight [H] and its style (synthq.training.norm:
    ``weight`` or ``one_plus_weight``, read from transformers' norm of the model type)
    and ``lm_head`` [Vt, H]. It answers
    ``get_input_embeddings()`` / ``get_output_embeddings()`` like a transformers model,
    so the drafter's initialisation and the draft head take it as they take a target."""

    config: Any
    embed: torch.Tensor
    norm: torch.Tensor
    head: torch.Tensor
    norm_style: str = "weight"

    def get_input_embeddings(self) -> _Weight:
        return _Weight(self.embed)

    def get_output_embeddings(self) -> _Weight:
        return _Weight(self.head)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own final RMSNorm, in float32 (``w·x̂`` or ``(1+w)·x̂``)."""
        eps = float(getattr(self.config, "rms_norm_eps", 1e-6))
        return apply_norm(self.norm_style, self.norm, hidden, eps)


def _shards(path: Path) -> dict[str, Path]:
    """Tensor name → shard file, from the index (or the one ``model.safetensors``)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise UserError(f"{path} has no model.safetensors(.index.json): --hidden-states "
                        "captured reads the target's embeddings, norm and lm_head from them")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator


def load_target_head(path: str) -> TargetHead:
    """The target's config, embeddings, final norm and head, read alone from its shards."""
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"--hidden-states captured needs the target's local folder (its "
                        f"config.json and safetensors shards), not {path!r}")
    config = AutoConfig.from_pretrained(folder)
    config = getattr(config, "text_config", None) or config
    shards = _shards(folder)

    def one(names: tuple[str, ...], what: str) -> torch.Tensor:
        name = next((n for n in names if n in shards), None)
        if name is None:
            raise UserError(f"the target in {path} has no {what} tensor ({', '.join(names)})")
        with safe_open(str(shards[name]), "pt") as f:
            return f.get_tensor(name).float()

    embed = one(_EMBED, "embedding")
    norm = one(_NORM, "final norm")
    tied = getattr(config, "tie_word_embeddings", False) and not any(n in shards for n in _HEAD)
    head = embed if tied else one(_HEAD, "lm_head")
    return TargetHead(config=config, embed=embed, norm=norm, head=head,
                      norm_style=norm_style(config))


def captured_paths(job_id: int, layers: list[int]) -> dict[str, tuple[Path, int]]:
    """Example id → its captured file and the row its tokens start at, for the job's done
    captures; the captures must hold ``layers`` (the drafter's three and the last
    layer's). A sample's examples (``--examples per-turn``: ids ``SAMPLE:TURN``, as the
    export names them) share the sample's file, each from its own offset."""
    from sqlalchemy import select

    from synthq.capture.stage import store
    from synthq.core.enums import CaptureState
    from synthq.store.db import session_scope
    from synthq.store.models import Capture, Sample

    root = store()
    out: dict[str, tuple[Path, int]] = {}
    other: set[tuple[int, ...]] = set()
    with session_scope() as s:
        for sample_id, path, layer_ids, examples in s.execute(select(
                Capture.sample_id, Capture.path, Capture.layer_ids, Sample.examples)
                .join(Sample, Sample.id == Capture.sample_id).where(
                Capture.job_id == job_id, Capture.state == CaptureState.DONE)):
            if list(layer_ids or []) != layers:
                other.add(tuple(layer_ids or []))
                continue
            if not path:
                continue
            if not examples:
                out[str(sample_id)] = (root.path(path), 0)
                continue
            offset = 0
            for e in examples:
                out[f"{sample_id}:{int(e['turn'])}"] = (root.path(path), offset)
                offset += int(e["tokens"])
    if not out:
        hint = f" (captured layers {sorted(other)})" if other else ""
        raise UserError(f"no captured features with layers {layers} for this job{hint}: run "
                        f"`synthq capture JOB --layers {','.join(map(str, layers))}` first")
    return out


class CapturedFeatures(FeatureCache):
    """A :class:`FeatureCache` over the capture stage's files: ``aux`` = the three drafter
    layers side by side, ``last`` = the final norm of the last layer's output, ``top`` =
    the target's greedy token over its whole vocabulary."""

    def __init__(self, paths: dict[str, tuple[Path, int]], head: TargetHead) -> None:
        self.paths = paths
        self.target = head

    def path(self, example_id: str) -> Path:
        return self.paths[example_id][0]

    def missing(self, examples: list[Example]) -> list[int]:
        return [i for i, ex in enumerate(examples) if ex.id not in self.paths]

    def fill(self, target: Any, examples: list[Example], heartbeat: Any = None,
             say: Any = None) -> int:
        missing = self.missing(examples)
        if missing:
            raise UserError(f"{len(missing)} of {len(examples)} examples have no captured "
                            "features: run `synthq capture JOB` (it resumes) and train again")
        return 0

    @torch.no_grad()
    def read(self, example: Example) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path, start = self.paths[example.id]
        data = load_file(str(path))
        n = len(example.input_ids)  # examples are cut to max_len; files hold them whole
        rows = slice(start, start + n)  # a per-turn example's rows within its sample's file
        ids = data["token_ids"][rows].numpy()
        # A capture taken from the answer's own call (--capture inline, synthq.capture.inline)
        # ends one token short: the engine never computed the state of the last token it
        # generated. That state would only predict past the example's end, which no loss
        # supervises (synthq.training.data.step_mask), so it is read as zeros.
        short = len(ids) == n - 1 and start + len(ids) == len(data["token_ids"])
        if not np.array_equal(ids, example.input_ids[:len(ids)] if short
                              else example.input_ids):
            raise UserError(f"example {example.id}: its captured token ids differ from its "
                            "input_ids (retokenized since the capture?): run `synthq capture "
                            "JOB` again")
        hidden = data["hidden_states"][rows].float()  # [L, 4, H] ([L-1, 4, H] when short)
        if "hidden_states_scale" in data:  # float8 (synthq.capture.files): its scale back
            hidden = hidden * data["hidden_states_scale"].float()[0]
        if short:
            hidden = torch.cat([hidden, hidden.new_zeros(1, *hidden.shape[1:])])
        last = self.target.final_norm(hidden[:, 3])  # [L, H]
        top = (last @ self.target.head.T).argmax(-1)  # [L] over the target's whole vocabulary
        return {"aux": hidden[:, :3].reshape(n, -1).contiguous(), "last": last, "top": top}

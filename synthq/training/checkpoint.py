"""Checkpoints: resumable training states, and the final drafter in vLLM's layout.

::

    OUT/checkpoints/step-00000500/   state.pt (drafter, optimizer, scheduler, step,
                                     TrainConfig) + the drafter in vLLM's layout
    OUT/final/                       config.json, model.safetensors, training_config.json,
                                     metrics.png

Every directory is written under a temporary name and renamed: a killed run
leaves whole checkpoints only. vLLM's ``llama_eagle3`` loads ``final/`` (or
any step directory) with ``--speculative-config '{"method": "eagle3",
"model": "OUT/final", ...}'``; a DFlash run's (``--drafter dflash``) has a
``mask_embedding.pt`` beside them and is served with ``"method": "dflash"``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from synthq.training.dflash import MASK_EMBEDDING, DFlashConfig, DFlashDrafter
from synthq.training.drafters import Drafter
from synthq.training.model import DraftConfig, Eagle3Drafter

__all__ = ["save_state", "latest_state", "prune_states", "save_drafter", "load_drafter",
           "plot_metrics", "STEP_PREFIX"]

STEP_PREFIX = "step-"


def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))


def _install(tmp: Path, final: Path) -> None:
    if final.exists():  # an earlier (killed) try wrote the same step: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)


def _write_drafter(directory: Path, drafter: Drafter, config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    dtype = "bfloat16" if drafter.lm_head.weight.is_cuda else "float32"
    tensors = drafter.vllm_state_dict()
    if dtype == "bfloat16":  # what vLLM serves; d2t/t2d keep their integer/bool types
        tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                   for k, v in tensors.items()}
    save_file({k: v.cpu() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(
        json.dumps(drafter.config.vllm_config(dtype), indent=2) + "\n")
    if isinstance(drafter, DFlashDrafter):
        (directory / MASK_EMBEDDING).write_bytes(drafter.mask_embedding_file())
    (directory / "training_config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_drafter(directory: Path, drafter: Drafter, config: dict[str, Any]) -> Path:
    """The drafter alone, in vLLM's layout, atomically at ``directory``."""
    tmp = _atomic_dir(directory)
    try:
        _write_drafter(tmp, drafter, config)
        _install(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def save_state(root: Path, step: int, drafter: Drafter, optimizer: Any, scheduler: Any,
               config: dict[str, Any], extra: dict[str, Any]) -> Path:
    """``root/step-NNNNNNNN``: everything to resume at ``step``, plus the drafter itself."""
    final = root / f"{STEP_PREFIX}{step:08d}"
    tmp = _atomic_dir(final)
    try:
        trainable = {k: v for k, v in drafter.state_dict().items()
                     if not k.startswith("embed_tokens.")}
        torch.save({"step": step, "drafter": trainable, "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "config": config, **extra},
                   tmp / "state.pt")
        _write_drafter(tmp, drafter, config)
        _install(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def latest_state(root: Path) -> Path | None:
    """The newest complete step directory under ``root``, or None."""
    if not root.is_dir():
        return None
    steps = sorted(p for p in root.iterdir()
                   if p.name.startswith(STEP_PREFIX) and (p / "state.pt").is_file())
    return steps[-1] if steps else None


def prune_states(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete step directories (and any
    half-written temporary one of an earlier step); returns what was removed.
    The newest is always kept, so a resume still finds its state."""
    if not root.is_dir():
        return []
    steps = sorted(p for p in root.iterdir()
                   if p.name.startswith(STEP_PREFIX) and (p / "state.pt").is_file())
    gone = steps[:-max(1, keep)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def load_drafter(directory: Path, target: Any) -> Drafter:
    """A drafter (either family) from a vLLM-layout directory, with the target's embeddings."""
    from safetensors.torch import load_file

    cfg = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    drafter: Drafter
    if "DFlashDraftModel" in (cfg.get("architectures") or []):
        drafter = DFlashDrafter(DFlashConfig.from_vllm(cfg))
        mask = torch.load(directory / MASK_EMBEDDING, weights_only=True)
        tensors["mask_embedding"] = mask["embedding"]
    else:
        drafter = Eagle3Drafter(DraftConfig(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
            rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
            vocab_size=cfg["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            target_num_layers=target.config.num_hidden_layers))
    c = drafter.config
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    # d2t/t2d are absent when the draft vocabulary is the target's (vLLM refuses them
    # then): d2t's zeros are the identity mapping, and every target id is kept.
    same = c.draft_vocab_size == c.vocab_size
    if same:
        drafter.t2d.fill_(True)
    expected = {"embed_tokens.weight", *(("d2t", "t2d") if same else ())}
    if unexpected or set(missing) != expected:
        raise ValueError(f"checkpoint {directory}: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float().cpu())
    return drafter.float().eval()


def plot_metrics(metrics: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Loss and per-position accuracy per step as a PNG; None without matplotlib or data."""
    if not metrics:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [m["step"] for m in metrics]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ax1.plot(steps, [m["loss"] for m in metrics])
    ax1.set(title="loss (weighted forward KL)", xlabel="step")
    for k in range(len(metrics[0]["acc"])):
        ax2.plot(steps, [m["acc"][k] for m in metrics], label=f"position {k}")
    ax2.set(title="draft accuracy per position", xlabel="step", ylim=(0, 1))
    ax2.legend(fontsize=7)
    ax3.plot(steps, [m["accept"] for m in metrics], label="training estimate (teacher-forced)")
    evals = [(m["step"], m["eval_accept"]) for m in metrics if m.get("eval_accept") is not None]
    if evals:
        ax3.plot([e[0] for e in evals], [e[1] for e in evals], "o-",
                 label="eval: draft-and-verify on held-out prompts (trust this)")
    ax3.set(title="acceptance length", xlabel="step")
    ax3.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path

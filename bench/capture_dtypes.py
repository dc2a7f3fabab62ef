"""Bytes per token of the captured hidden states in each stored dtype, their error
against float32, and whether lossless compression pays (issue 30 item 4).

Setup: a seeded random tiny Llama (``--layers`` 8, ``--hidden`` 256, vocab 4096) run by
transformers over ``--samples`` (64) prompts of 64-512 random tokens; its hidden states
at ``[2, N//2, N-3, N]`` (the capture layers) go through synthq's own conversion
(:func:`synthq.capture.files.convert_scaled`) and file layout
(:func:`synthq.capture.files.dumps`, ``token_ids`` included), as the capture stage
stores them. Figures per dtype: bytes per token of the files (header included), the
largest and the mean relative error of the values against float32 (over values above
1 % of the tensor's max), and the size after ``zlib`` (level 6) and ``lzma`` (preset 6)
of the whole files, with and without a byte shuffle (each byte plane apart). A codec
"pays" when it saves at least 10 %: random weights give no outliers, so treat the
compression figures as an upper bound of what real models' states give (they are
heavier-tailed: fp8's per-tensor scale spends more of its range on outliers).

    .venv/bin/python bench/capture_dtypes.py [--samples 64] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import time
import zlib

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from synthq.capture import files
    from synthq.capture.plan import DTYPES, drafter_layers

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    layers = drafter_layers(args.layers)
    rng = np.random.default_rng(0)
    states: list[tuple[np.ndarray, np.ndarray]] = []
    with torch.no_grad():
        for _ in range(args.samples):
            ids = rng.integers(0, 4096, int(rng.integers(64, 513)))
            out = model.model(torch.from_numpy(ids)[None], output_hidden_states=True)
            hs = torch.stack([out.hidden_states[i][0] for i in layers], 1).numpy()
            states.append((ids, hs.astype(np.float32)))
    tokens = sum(len(ids) for ids, _ in states)
    rows = {}
    for dtype in DTYPES:
        blobs, worst, errs = [], 0.0, []
        for ids, hs in states:
            t = files.Tensor("F32", hs.shape, hs.tobytes())
            stored, scale = files.convert_scaled(t, dtype)
            tensors = {"hidden_states": stored, "token_ids": files.Tensor(
                "I64", (len(ids),), ids.astype("<i8").tobytes())}
            if scale is not None:
                tensors["hidden_states_scale"] = files.Tensor(
                    "F32", (1,), np.float32(scale).tobytes())
            blobs.append(files.dumps(tensors, {"dtype": dtype}))
            back = files.hidden_states(tensors)
            big = np.abs(hs) > 0.01 * np.abs(hs).max()
            rel = np.abs(back - hs)[big] / np.abs(hs)[big]
            worst = max(worst, float(rel.max()))
            errs.append(float(rel.mean()))
        raw = sum(len(b) for b in blobs)
        width = DTYPES[dtype]
        started = time.perf_counter()
        z = sum(len(zlib.compress(b, 6)) for b in blobs)
        z_s = time.perf_counter() - started
        x = sum(len(lzma.compress(b, preset=6)) for b in blobs)
        shuffled = [np.frombuffer(b[: len(b) - len(b) % width], np.uint8).reshape(-1, width)
                    .T.tobytes() for b in blobs]
        zs = sum(len(zlib.compress(b, 6)) for b in shuffled)
        rows[dtype] = {"bytes_per_token": round(raw / tokens, 1),
                       "max_rel_err": round(worst, 5),
                       "mean_rel_err": round(float(np.mean(errs)), 6),
                       "zlib": round(z / raw, 3), "zlib_shuffled": round(zs / raw, 3),
                       "lzma": round(x / raw, 3), "zlib_MB_s": round(raw / 1e6 / z_s, 1)}
        print(f"{dtype:12s} {raw / tokens:8.1f} B/token  max rel err {worst:.4f}  "
              f"mean {np.mean(errs):.5f}  zlib {z / raw:.3f}  zlib+shuffle {zs / raw:.3f}  "
              f"lzma {x / raw:.3f} of the bytes")
    print(json.dumps({"tokens": tokens, "layers": layers, "hidden": args.hidden,
                      "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], **rows}))


if __name__ == "__main__":
    main()

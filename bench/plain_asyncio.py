"""The peer synthq is measured against: a plain asyncio + openai generation script.

Equivalent to the seed's fixed ``01b_generate_synthetic.py``: a semaphore of
``--concurrency`` requests, a long timeout, the client's retries, each answer
appended to a JSONL file as it arrives. ``--stream`` reads the answer as
streamed chunks through the openai client (``stream=True``), like synthq does.
It prints one JSON line: done, wall seconds, its own CPU seconds, and the
done/s between the 10th and 90th percentile of completion times.

Run by ``bench/seed_scenario.py``; alone: ``python bench/plain_asyncio.py
--url http://127.0.0.1:8000/v1 --n 2000 --concurrency 128 [--stream]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import openai


async def run(args: argparse.Namespace) -> dict[str, float]:
    client = openai.AsyncOpenAI(base_url=args.url, api_key="EMPTY", timeout=3600.0,
                                max_retries=3)
    sem = asyncio.Semaphore(args.concurrency)
    finished: list[float] = []
    failed = 0
    with open(args.out, "a") as out:

        async def one(i: int) -> None:
            nonlocal failed
            messages = [{"role": "user", "content": f"{args.tag} question {i}: explain "
                         "something briefly"}]
            async with sem:
                try:
                    if args.stream:
                        parts = []
                        stream = await client.chat.completions.create(
                            model=args.model, messages=messages, max_tokens=256,  # type: ignore[arg-type]
                            stream=True)
                        async for chunk in stream:
                            if chunk.choices and chunk.choices[0].delta.content:
                                parts.append(chunk.choices[0].delta.content)
                        text = "".join(parts)
                    else:
                        response = await client.chat.completions.create(
                            model=args.model, messages=messages, max_tokens=256)  # type: ignore[arg-type]
                        text = response.choices[0].message.content or ""
                except openai.OpenAIError:
                    failed += 1
                    return
            out.write(json.dumps({"id": i, "messages": messages, "response": text}) + "\n")
            out.flush()
            finished.append(time.monotonic())

        await asyncio.gather(*(one(i) for i in range(args.n)))
    await client.close()
    finished.sort()
    lo, hi = int(0.1 * (len(finished) - 1)), int(0.9 * (len(finished) - 1))
    steady = (hi - lo) / (finished[hi] - finished[lo]) if len(finished) > 1 else 0.0
    return {"done": len(finished), "failed": failed, "steady_done_per_s": steady}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="sim-model")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--tag", default="plain")
    ap.add_argument("--out", default="/dev/null")
    args = ap.parse_args()
    cpu0, t0 = time.process_time(), time.monotonic()
    result = asyncio.run(run(args))
    result["wall_s"] = time.monotonic() - t0
    result["cpu_s"] = time.process_time() - cpu0
    print(json.dumps(result))


if __name__ == "__main__":
    main()

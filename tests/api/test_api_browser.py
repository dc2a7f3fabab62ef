"""The job page in a real browser: Debian's Chromium driven by Playwright.

Real data: a tokenized job run through the simulator over HTTP on real
PostgreSQL, three of its samples failed with ``context_length``; the API is a
real ``synthq api`` process. The test logs in with the token, clicks requeue
on the class and sees the counts change. ``SYNTHQ_SCREENSHOTS=1`` also writes
the screenshots to ``docs/`` (for the README).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chat_tokenizers as ct
import pytest
from conftest import TOKEN, settle
from support import REPO, counts

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture
def browser() -> Any:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def test_job_page_requeues_a_failure_class(browser: Any, api_server: Callable[..., Any],
                                           simulator: Callable[..., Any],
                                           job_factory: Callable[..., Any],
                                           tmp_path: Path) -> None:
    sim = simulator("--latency", "0", "--reasoning", "--response-tokens", "24")
    prompts = ["What does a speculative-decoding drafter learn?",
               "Explain a loss mask in one paragraph.",
               "Why store the raw response before tokenizing?"]
    prompts += [f"summarise chapter {i} [[sim:context_length*1]]" for i in range(3)]
    report = job_factory(prompts, servers=[sim.url], name="demo-blog-prompts",
                         tokenizer=ct.qwen3(tmp_path / "tok"), max_attempts=2)
    settle(report.job_id)
    assert counts(report.job_id)["failed"] == 3
    server = api_server()

    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(f"{server.url}/ui/jobs/{report.job_id}")
    assert page.url.endswith("/ui/login")  # no cookie yet
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.url}/ui")
    page.click(f"text={report.job_name}")
    page.wait_for_url(f"{server.url}/ui/jobs/{report.job_id}")

    def count(state: str) -> str:
        return str(page.inner_text(f"#counts [data-state={state}] b"))

    assert count("failed") == "3" and count("done") == "3"
    row = page.locator("#failures tr[data-class=context_length]")
    assert row.locator("td.num").inner_text() == "3"
    shots = tmp_path / "shots"
    shots.mkdir()
    page.screenshot(path=str(shots / "job-page.png"), full_page=True)

    row.get_by_role("button", name="requeue context_length").click()
    page.wait_for_selector("#message")
    assert "requeued 3 failed context_length samples" in page.inner_text("#message")
    assert count("failed") == "0" and count("pending") == "3"
    assert page.locator("#failures").count() == 0
    assert counts(report.job_id)["pending"] == 3

    # A sample: its prompt, answer, attempts, and the loss mask as coloured text.
    page.goto(f"{server.url}/ui/samples/1")
    supervised = page.locator("#mask .sup")
    assert supervised.count() >= 1
    assert "<|im_end|>" in supervised.last.inner_text()
    assert page.locator("#mask .ctx").first.inner_text().startswith("<|im_start|>user")
    page.screenshot(path=str(shots / "sample-page.png"), full_page=True)
    if os.environ.get("SYNTHQ_SCREENSHOTS") == "1":
        for name in ("job-page.png", "sample-page.png"):
            shutil.copy(shots / name, REPO / "docs" / name)

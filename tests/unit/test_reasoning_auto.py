"""``--reasoning auto`` (the default): keep where the template renders reasoning, drop
where it removes it; an impossible ``keep`` refused from the template alone, before the
tokenizer loads (issue 25, item 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import chat_tokenizers as ct
import pytest
from support import REPO

from synthq.data.tokenize import (
    ChatTokenizer,
    TokenizerSetupError,
    TokenizeSettings,
    precheck_reasoning,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


def test_auto_drops_reasoning_where_the_template_removes_it() -> None:
    tok = ChatTokenizer(TokenizeSettings(ct.deepseek_v3()))  # the default: auto
    assert (tok.reasoning_field, tok.reasoning) == (False, "drop")
    assert tok.reasoning_line.startswith("--reasoning auto: drop: ")
    answer = tok.conversation([{"role": "user", "content": "q"}], "4", "secret steps")[-1]
    assert answer == {"role": "assistant", "content": "4"}
    result = tok.tokenize(tok.conversation([{"role": "user", "content": "q"}], "4",
                                           "secret steps"))
    assert "secret steps" not in tok.tok.decode(result.input_ids.tolist())


def test_auto_keeps_reasoning_where_the_template_renders_it(root: Path) -> None:
    qwen = ChatTokenizer(TokenizeSettings(ct.qwen3(root)))
    assert (qwen.reasoning_field, qwen.reasoning) == (True, "keep")
    assert "as its reasoning_content" in qwen.reasoning_line
    result = qwen.tokenize(qwen.conversation([{"role": "user", "content": "q"}], "4",
                                             "secret steps"))
    assert "secret steps" in qwen.tok.decode(result.input_ids[result.loss_mask == 1].tolist())
    llama = ChatTokenizer(TokenizeSettings(ct.llama3(root)))  # content kept whole: wrapped
    assert (llama.reasoning_field, llama.reasoning) == (False, "keep")
    assert "wrapped in think markers" in llama.reasoning_line


def test_the_template_alone_decides_before_the_tokenizer_loads(root: Path) -> None:
    assert precheck_reasoning(TokenizeSettings(ct.deepseek_v3())) == "drop"
    assert precheck_reasoning(TokenizeSettings(ct.deepseek_v3(), reasoning="drop")) == "drop"
    assert precheck_reasoning(TokenizeSettings(ct.qwen3(root))) == "keep"
    assert precheck_reasoning(TokenizeSettings(ct.llama3(root), reasoning="keep")) == "keep"
    with pytest.raises(TokenizerSetupError, match="drops reasoning.*--reasoning auto"):
        precheck_reasoning(TokenizeSettings(ct.deepseek_v3(), reasoning="keep"))
    # A hub id (no local files) cannot be read without loading: the load decides.
    assert precheck_reasoning(TokenizeSettings("someone/some-model", reasoning="keep")) is None
    # --chat-template overrides the tokenizer's own, here too.
    qwen_template = (Path(ct.qwen3(root)) / "chat_template.jinja")
    template = (qwen_template.read_text() if qwen_template.exists()
                else ChatTokenizer(TokenizeSettings(ct.qwen3(root))).template)
    assert precheck_reasoning(TokenizeSettings(ct.deepseek_v3(), chat_template=template,
                                               reasoning="keep")) == "keep"


@pytest.mark.processes
def test_the_precheck_loads_no_tokenizer_and_no_transformers() -> None:
    """What makes it fast: jinja2 on the template file, nothing else."""
    code = ("import sys, time; t = time.perf_counter()\n"
            "from synthq.data.tokenize import TokenizeSettings, precheck_reasoning, "
            "TokenizerSetupError\n"
            f"try:\n    precheck_reasoning(TokenizeSettings({ct.deepseek_v3()!r}, "
            "reasoning='keep'))\nexcept TokenizerSetupError:\n    print('refused')\n"
            "print('transformers' in sys.modules, round(time.perf_counter() - t, 3))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={"PYTHONPATH": str(REPO)}).stdout.split()
    assert out[:2] == ["refused", "False"], out

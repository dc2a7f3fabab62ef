"""synthq.sandbox: a chat template renders under a size and time budget, in transformers'
own apply_chat_template too, and a template that passed the probe at enqueue but is
hostile on another row fails that sample only."""

from __future__ import annotations

import time
from pathlib import Path

import chat_tokenizers as ct
import pytest

HOSTILE = {
    "multiply": "{% set x = 'a' * 800000000 %}{{ x | length }}",
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
             "{% endfor %}",
    "doubling": "{% set ns = namespace(x='ab') %}{% for i in range(60) %}"
                "{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
    # ``+`` of two strings takes the sandbox's inline path (the common case in templates).
    "plus": "{% set ns = namespace(x='ab') %}{% for i in range(26) %}"
            "{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x | length }}",
    "center": "{{ 'x'.center(1000000000) }}",
    "tojson": "{{ (['x' * 1000000] * 1000) | tojson }}",
    "join": "{{ (['x' * 100000] * 1000) | join(',') }}",
    "format": "{{ '%999999999s' % 'a' }}{{ '{:>999999999}'.format('a') }}",
    "range": "{{ range(10 ** 9) | length }}",
    "output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "power": "{{ 2 ** 100000000 }}",
    "idle": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}"
            "{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_template_stops_at_a_limit(name: str) -> None:
    from synthq.sandbox import BoundedSandbox, TemplateLimitError, limits

    template = BoundedSandbox(trim_blocks=True).from_string(HOSTILE[name])
    started = time.monotonic()
    with limits(seconds=1.0), pytest.raises(TemplateLimitError, match="synthq's limit"):
        template.render(messages=[])
    assert time.monotonic() - started < 5


def test_real_templates_render_as_before() -> None:
    """The budget changes no output: the same text as jinja2's own sandbox."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from synthq.sandbox import BoundedSandbox

    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "q " * 2000},
                {"role": "assistant", "content": "a", "reasoning_content": "think"},
                {"role": "user", "content": "again"}]
    loops = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m.role }}"
             "{% if loop.last %}.{% endif %}{% else %}none{% endfor %}"
             "{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}"
             "{% for x in [1, 2, 3] if x > 1 %}{{ x }}{% endfor %}"
             "{% for x in range(3)|reverse %}{{ x }}{% endfor %}")
    for source in (ct.LLAMA3_TEMPLATE, ct.QWEN3_TEMPLATE, loops):
        want = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
            source).render(messages=messages, add_generation_prompt=True, bos_token="<s>")
        got = BoundedSandbox(trim_blocks=True, lstrip_blocks=True).from_string(source).render(
            messages=messages, add_generation_prompt=True, bos_token="<s>")
        assert got == want


def test_a_template_hostile_on_other_rows_fails_that_sample_only(tmp_path: Path) -> None:
    """The probe's rows are short; this template builds 10^9 characters only for a
    conversation of more than four messages: that sample fails as invalid_input, with
    one line, in seconds; the next sample is tokenized. And transformers' own
    apply_chat_template renders in the bounded sandbox (this fails if transformers stops
    building its environment from the class name synthq.sandbox.install replaces)."""
    from synthq import errors
    from synthq.sandbox import TemplateLimitError
    from synthq.tokenize import TokenizeSettings, get_chat_tokenizer

    template = ("{% if messages | length > 4 %}{{ 'z' * 1000000000 }}{% endif %}"
                + ct.QWEN3_TEMPLATE)
    tok = get_chat_tokenizer(TokenizeSettings(tokenizer=ct.qwen3(tmp_path),
                                              chat_template=template, reasoning="drop"))
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
            for i in range(5)]
    started = time.monotonic()
    with pytest.raises(errors.InvalidInput, match="synthq's limit") as caught:
        tok.tokenize([*long, {"role": "assistant", "content": "answer"}])
    assert "\n" not in str(caught.value) and time.monotonic() - started < 10
    ok = tok.tokenize([{"role": "user", "content": "q"}, {"role": "assistant",
                                                          "content": "answer"}])
    assert ok.num_supervised > 0
    with pytest.raises(TemplateLimitError):
        tok.tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                    chat_template=HOSTILE["multiply"])

"""synthq.data.sandbox: a chat template renders under a size and time budget, in transformers'
own apply_chat_template too, and a template that passed the probe at enqueue but is
hostile on another row fails that sample only."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
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
    # Issue 41 item 7, and what a read of jinja2's filters and globals found beside them
    # (each built 0.3-1.9 GB, or ran 17 s to forever, on the sandbox before).
    "format_nested_width": "{{ '{0:>{1}}'.format('x', 10**9) }}",
    "format_nested_precision": "{{ '{0:.{1}f}'.format(1.5, 10**9) }}",
    "format_map_width": "{{ '{a:>{w}}'.format_map({'a': 'x', 'w': 10**9}) }}",
    "markup_format_width": "{{ ('{0:>{1}}' | safe).format('x', 10**9) }}",
    # Constant: jinja2 folds it while it compiles, outside any render.
    "slice_folded": "{{ [1] | slice(20000000) | list | length }}",
    "slice": "{{ [1] | slice(20000000 + messages | length) | list | length }}",
    "batch_fill": "{{ [1] | batch(20000000, 0) | list | length }}",
    "center_folded": "{{ 'x' | center(100000000) | length }}",
    "repeat_list": "{{ ([1] * 30000000) | length }}",
    "lipsum": "{{ lipsum(200000) }}",
    "lipsum_paragraphs": "{{ lipsum(10000) | length }}",
    # One paragraph, a single call with no tick: at least 1.4 million words, so that it is
    # over a 0.05 s clock on any machine (its length is a random draw between min and max:
    # CI drew a short one with min left at 20, rendered it within the clock, unrefused).
    "lipsum_paragraph": "{{ lipsum(1, min=1400000, max=1500000) | length }}",
    "round": "{{ 1.5 | round(10**8, 'floor') }}",
    "sum_lists": "{{ ([[0] * 1000] * 5000) | sum(start=[]) | length }}",
    "product": "{% set ns = namespace(x=2 ** 30000) %}{% for i in range(30) %}"
               "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
    "bytes_percent": "{{ '%*s'.encode() % (10**9, 'x'.encode()) }}",
    "bytes_center": "{{ 'x'.encode().center(10**9) }}",
    "bytes_join": "{{ ','.encode().join([('x' * 1000000).encode()] * 1000) | length }}",
    "translate": "{{ ('x' * 1000).translate({120: 'y' * 1000000}) | length }}",
    "split": "{{ ('ab ' * 10000000).split() | length }}",
    "tojson_indent": "{{ [[[[[[[[1]]]]]]]] | tojson(indent=10000000) | length }}",
    "urlize_target": "{{ ('a.com ' * 1000) | urlize(target='x' * 1000000) | length }}",
    # Within the size budget, but Python code inside one filter call, with no tick: the
    # watchdog stops them.
    "wordwrap": "{{ ('x' * 2000000) | wordwrap(1) | length }}",
    "urlize_words": "{{ ('a ' * 1000000) | urlize | length }}",
    "pprint": "{{ ([[1]] * 200000) | pprint | length }}",
}

#: Those refused by the clock (the others by a size or count limit, before any clock).
CLOCK = {"loops", "idle", "lipsum_paragraphs", "lipsum_paragraph", "wordwrap",
         "urlize_words", "pprint"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_template_stops_at_a_limit(name: str) -> None:
    from synthq.data.sandbox import BoundedSandbox, TemplateLimitError, limits

    template = BoundedSandbox(trim_blocks=True).from_string(HOSTILE[name])
    # A template of CLOCK is stopped by the clock alone: its budget is a small fraction of
    # its work on any machine (a quiet one rendered lipsum_paragraph within 1 s, unrefused).
    seconds = 0.05 if name in CLOCK else 1.0
    started = time.monotonic()
    with limits(seconds=seconds), pytest.raises(TemplateLimitError, match="synthq's limit"):
        template.render(messages=[])
    assert time.monotonic() - started < 5


#: What a child that renders one template may reach (it starts at about 25 MiB; the
#: budget is 32 MiB, synthq.data.sandbox.RENDER_BYTES).
PEAK_MIB = 150

#: Compiles and renders argv[1] for argv[2] seconds in the bounded sandbox; prints the
#: outcome. Its address space is capped: a template the sandbox let through fails with
#: MemoryError here, not the machine.
_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from synthq.data.sandbox import BoundedSandbox, limits
started = time.monotonic()
try:
    template = BoundedSandbox(trim_blocks=True).from_string(sys.argv[1])
    with limits(seconds=float(sys.argv[2])):
        out = template.render(messages=[])
    outcome = f"rendered {len(out)} characters"
except BaseException as exc:
    outcome = f"{type(exc).__name__}: {exc}"
took = time.monotonic() - started
# This process's own peak (VmHWM, kB): the rusage's ru_maxrss of a child starts from its
# parent's at the fork, a test process of hundreds of MB after other tests.
with open("/proc/self/status") as fh:
    peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
print(json.dumps([outcome, took, peak]))
"""


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_template_is_refused_in_bounded_memory(name: str) -> None:
    """In a process of its own (the peak RSS is that process's VmHWM): refused
    with synthq's limit, by a size or count limit before any clock (a 20 s budget), or
    for one of CLOCK by the clock of a 0.05 s budget well before a worker's 20 s; and the
    process stays under PEAK_MIB."""
    seconds = 0.05 if name in CLOCK else 20.0  # as above: a fraction of its work anywhere
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, HOSTILE[name], str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(120, proc.kill)  # today's code never stops some of them
    timer.start()
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read()
    proc.wait()
    timer.cancel()
    outcome, took, peak_kb = json.loads(out) if out.strip() else (
        f"no answer (exit {proc.returncode})", 120, 0)
    peak = peak_kb / 1024
    figures = f"{peak:.0f} MiB, {took:.1f} s"
    assert outcome.startswith("TemplateLimitError: ") and "synthq's limit" in outcome, \
        (outcome, figures)
    if name in CLOCK:
        assert took < 20, (outcome, figures)
    else:
        assert "ran over" not in outcome, (outcome, figures)
    assert peak < PEAK_MIB, (outcome, figures)


def test_real_templates_render_as_before() -> None:
    """The budget changes no output: the same text as jinja2's own sandbox."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from synthq.data.sandbox import BoundedSandbox

    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "q " * 2000},
                {"role": "assistant", "content": "a", "reasoning_content": "think"},
                {"role": "user", "content": "again"}]
    loops = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m.role }}"
             "{% if loop.last %}.{% endif %}{% else %}none{% endfor %}"
             "{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}"
             "{% for x in [1, 2, 3] if x > 1 %}{{ x }}{% endfor %}"
             "{% for x in range(3)|reverse %}{{ x }}{% endfor %}")
    # What the bounds wrap (a lazy filter's items, str.format's fields, sum, lipsum...),
    # each used as a template would, the constant ones folded while compiling.
    bounded = ("{{ [1, 2, 3, 4, 5] | slice(2) | list }}{{ [1, 2, 3] | batch(2, 0) | list }}"
               "{{ messages | map(attribute='role') | join(',') }}{{ [3, 1, 2] | sort }}"
               "{{ messages | selectattr('role', 'eq', 'user') | map(attribute='role') | list }}"
               "{{ [[1], [2, 3]] | sum(start=[]) }}{{ [(1,), (2,)] | sum(start=()) }}"
               "{{ [1, 2] | sum }}{{ messages | sum(attribute='x', start=0) if false }}"
               "{{ '{0:>4}|{1:.{2}f}|{k}'.format('x', 1.5, 3, k=[1]) }}"
               "{{ '{a}-{b:^5}'.format_map({'a': 1, 'b': 'c'}) }}"
               "{{ ('<{0}>' | safe).format('&') }}{{ '%-4s|%.*f|%(x)s' % ('y', 2, 2.5, 1)"
               " if false }}{{ '%-4s|%.*f' % ('y', 2, 2.5) }}{{ '%5.1f' | format(2.25) }}"
               "{{ 'a b\nc'.split() }}{{ 'a,b'.split(',', 1) }}{{ 'a\nb'.splitlines() }}"
               "{{ 'ab'.center(6, '*') }}{{ [1, 2] | reverse | list }}{{ 'abc' | reverse }}"
               "{{ {'b': 1, 'a': 2} | dictsort }}{{ 'x\ny' | indent(2, first=True) }}"
               "{{ 'hello world foo' | wordwrap(5) }}{{ 'see a.com' | urlize }}"
               "{{ 1.55 | round(1, 'floor') }}{{ 2 * 3 }}{{ 'x' * 3 }}{{ [0] * 3 }}"
               "{{ 'ab'.translate({97: 'xy'}) }}{{ 'é'.encode() }}{{ 'x' | tojson(indent=2) }}"
               "{{ [[1, [2]]] | tojson(indent=2) }}{{ lipsum(0) }}{{ 'ß' | upper }}"
               "{{ ['a', 'b'] | unique | list }}{{ {'a': 1} | items | list }}")
    for source in (ct.LLAMA3_TEMPLATE, ct.QWEN3_TEMPLATE, loops, bounded):
        want = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
            source).render(messages=messages, add_generation_prompt=True, bos_token="<s>")
        got = BoundedSandbox(trim_blocks=True, lstrip_blocks=True).from_string(source).render(
            messages=messages, add_generation_prompt=True, bos_token="<s>")
        assert got == want


def test_sum_lipsum_and_the_formatter_behave_as_jinja2s() -> None:
    """The sandbox's own ``sum`` (linear for lists), ``lipsum`` (a paragraph at a time)
    and fields check keep jinja2's results and errors."""
    from jinja2.sandbox import SecurityError

    from synthq.data.sandbox import BoundedSandbox

    env = BoundedSandbox()

    def render(source: str) -> str:
        return env.from_string(source).render(messages=[{"n": [1]}, {"n": [2, 3]}])

    assert render("{{ messages | sum(attribute='n', start=[]) }}") == "[1, 2, 3]"
    with pytest.raises(TypeError, match="can only concatenate list"):
        render("{{ [[1], (2,)] | sum(start=[]) }}")
    with pytest.raises(TypeError):
        render("{{ [[1]] | sum }}")
    text = render("{{ lipsum(3, html=False) }}")
    assert text.count("\n\n") == 2 and text.endswith(".")
    html = render("{{ lipsum(2, min=5, max=6) }}")
    assert html.count("<p>") == 2 and html.count("\n") == 1
    with pytest.raises(TypeError, match="whole numbers"):
        render("{{ lipsum(1.5) }}")
    # The sandbox's formatter still refuses what jinja2's does.
    with pytest.raises(SecurityError, match="unsafe"):
        render("{{ '{0.__class__.__mro__}'.format(1) }}")


def test_a_render_stopped_by_the_watchdog_leaves_its_thread_and_others_alone() -> None:
    """A render stopped inside a filter's own loop (no tick there): refused with the
    clock's line, and the next render in that thread is whole; a thread rendering
    beside it all along is never touched."""
    from synthq.data import sandbox
    from synthq.data.sandbox import BoundedSandbox, TemplateLimitError, limits

    env = BoundedSandbox()
    plain = env.from_string("{% for i in range(50) %}{{ i }}{% endfor %}")
    want = "".join(map(str, range(50)))
    stop = threading.Event()
    beside: list[str] = []

    def render_beside() -> None:
        while not stop.is_set():
            beside.append(plain.render())

    thread = threading.Thread(target=render_beside)
    thread.start()
    try:
        with limits(seconds=0.5), pytest.raises(TemplateLimitError, match="ran over 0.5 s"):
            env.from_string(HOSTILE["wordwrap"]).render()
    finally:
        stop.set()
        thread.join()
    assert beside and set(beside) == {want}
    for _ in range(200):
        assert plain.render() == want
    assert sandbox._local.budget is None and not sandbox._watchdog.renders


def test_a_template_hostile_on_other_rows_fails_that_sample_only(tmp_path: Path) -> None:
    """The probe's rows are short; this template builds 10^9 characters only for a
    conversation of more than four messages: that sample fails as invalid_input, with
    one line, in seconds; the next sample is tokenized. And transformers' own
    apply_chat_template renders in the bounded sandbox (this fails if transformers stops
    building its environment from the class name synthq.data.sandbox.install replaces)."""
    from synthq.core import errors
    from synthq.data.sandbox import TemplateLimitError
    from synthq.data.tokenize import TokenizeSettings, get_chat_tokenizer

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
    # transformers' own globals too: %c is 24 characters.
    with pytest.raises(TemplateLimitError, match="synthq's limit"):
        tok.tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                    chat_template="{{ strftime_now('%c' * 3000000) }}")

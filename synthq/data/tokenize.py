"""Turn a conversation into a training example: token ids and an assistant-only loss mask.

The drafter learns only what the mask marks, so the mask is built the one way
that cannot drift from the text:

1. For each supervised assistant turn ``i``, render ``messages[:i]`` with
   ``add_generation_prompt=True`` (the *prefix*: everything the model saw
   before it started writing) and ``messages[:i+1]``. The second must extend
   the first, or the template is not stable at the boundary and the sample
   fails with ``boundary_unstable`` — never a silently wrong mask.
2. The turn's span is the text between the two, up to and including its
   end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, …) and without what
   the template writes after it (a newline): the tokens the model generated.
3. The whole conversation is tokenized **once**, with character offsets; a
   token is supervised when its characters lie inside a span. No arithmetic on
   token-prefix lengths, which breaks where BPE merges across the boundary.
4. Every result is checked: the supervised tokens of each span decode to
   exactly that span's text, else ``mask_mismatch``. Where the template has
   ``{% generation %}`` blocks, the mask must also agree with transformers'
   ``return_assistant_tokens_mask``.

Before any of that, a tokenizer must survive a round trip: a fixed probe
conversation, rendered, tokenized and decoded, must give back its text
exactly. One that drops spaces or normalises characters (transformers 5.8.1
loads DeepSeek-V3's tokenizer so, transformers #45488) is refused when it is
loaded, naming the transformers version, instead of failing every sample with
``mask_mismatch``.

Reasoning (``reasoning_content``) is rendered the way the template renders it
when the template knows the field, else wrapped in think markers inside the
content; with ``reasoning="drop"`` it is left out. ``reasoning="auto"`` (the
default) keeps it where the template renders it either way and drops it where
the template removes it from assistant turns (DeepSeek-V3's keeps only what
follows ``</think>``); ``keep`` there is refused when the job is made. An empty think block that
a template injects in front of an answer (``<think>\\n\\n</think>``) is never
supervised: the model did not write it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any

import numpy as np

from synthq.core import errors
from synthq.spec.jobspec import BY_NAME, mask_for

__all__ = [
    "TokenizeSettings",
    "Tokenized",
    "ChatTokenizer",
    "TokenizerSetupError",
    "get_chat_tokenizer",
    "REASONING_MODES",
    "MASK_MODES",
    "PROBE_CONVERSATION",
    "precheck_reasoning",
]

# Declared with the job settings (synthq.spec.jobspec).
REASONING_MODES = BY_NAME["reasoning"].choices
MASK_MODES = BY_NAME["mask"].choices

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = "synthq-probe-7f3a"

#: Rendered, tokenized and decoded when a tokenizer is loaded: the decoded text
#: must equal the rendered one. Runs of spaces, a tab, blank lines, indentation,
#: capitals and accents (NFC), CJK, an emoji and digits: what a pre-tokenizer
#: that splits on whitespace, or a lower-casing or accent-stripping normaliser,
#: would lose.
PROBE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Round-trip probe: two  spaces, a\ttab,\n\nCafé naïve Ünïcode, "
                                "日本語のテキスト, emoji 🎉 and 1234567 + 0.25?"},
    {"role": "assistant", "content": "Sure.  Here:\n\n```python\ndef f(x):\n    return x * 2\n"
                                     "```\nDone — “quoted” text."},
)

#: Two questions, each answered with reasoning: what :meth:`ChatTokenizer.multi_turn_unstable`
#: renders to see whether earlier turns render the same once later ones follow.
MULTI_TURN_PROBE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "Three plus three is six."},
)


class TokenizerSetupError(errors.UserError):
    """The tokenizer or template cannot be used; raised at enqueue, not per sample."""


def _cannot_render(exc: Exception) -> TokenizerSetupError:
    """The probe render failed: the budget's own line (synthq.data.sandbox), else why."""
    from synthq.data.sandbox import TemplateLimitError

    if isinstance(exc.__cause__, TemplateLimitError):
        return TokenizerSetupError(str(exc.__cause__))
    return TokenizerSetupError(f"the chat template cannot render a conversation: {exc}")


@dataclass(frozen=True, slots=True)
class TokenizeSettings:
    """How a job turns conversations into examples (columns of ``jobs``)."""

    tokenizer: str
    chat_template: str | None = None
    #: JSON text of the template variables (a string so the settings are hashable).
    chat_template_kwargs: str = "{}"
    max_seq_len: int = 4096
    reasoning: str = "auto"
    think_open: str = "<think>\n"
    think_close: str = "\n</think>\n\n"
    mask: str = mask_for(None)

    @classmethod
    def from_job(cls, job: Any) -> TokenizeSettings | None:
        """The settings of a job (or JobSpec): its tokenization columns (synthq.spec.jobspec's
        TOKENIZATION), or None without a tokenizer."""
        from synthq.spec.jobspec import TOKENIZATION

        if not job.tokenizer:
            return None
        values = {column: getattr(job, column) for column in TOKENIZATION}
        values["chat_template_kwargs"] = json.dumps(values["chat_template_kwargs"] or {},
                                                    sort_keys=True)
        values["mask"] = mask_for(values["mask"], getattr(job, "regenerate", None))
        return cls(**values)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return dict(json.loads(self.chat_template_kwargs))

    def check(self) -> None:
        if self.reasoning not in REASONING_MODES:
            raise TokenizerSetupError(f"--reasoning must be one of {REASONING_MODES}")
        if self.mask not in MASK_MODES:
            raise TokenizerSetupError(f"--mask must be one of {MASK_MODES}")
        if self.max_seq_len < 2:
            raise TokenizerSetupError("--max-seq-len must be at least 2")


@dataclass(slots=True)
class Tokenized:
    """One training example."""

    input_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) uint8, 1 = supervised
    #: The conversation was cut at max_seq_len.
    truncated: bool
    #: Our token ids of the last assistant span (to compare with the server's).
    completion_ids: list[int] = field(default_factory=list)

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


class ChatTokenizer:
    """A target model's tokenizer and chat template, loaded once per process."""

    def __init__(self, settings: TokenizeSettings) -> None:
        settings.check()
        self.settings = settings
        self.kwargs = settings.template_kwargs
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(settings.tokenizer)
        except Exception as exc:  # noqa: BLE001 - any load failure is the user's to fix
            raise TokenizerSetupError(
                f"cannot load tokenizer {settings.tokenizer!r}: {type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:500]}") from exc
        if not getattr(self.tok, "is_fast", False):
            raise TokenizerSetupError(f"tokenizer {settings.tokenizer!r} is not a fast "
                                      "tokenizer; character offsets need one (tokenizer.json)")
        self.template = settings.chat_template or self.tok.chat_template
        if not self.template:
            raise TokenizerSetupError(f"tokenizer {settings.tokenizer!r} has no chat template; "
                                      "pass --chat-template FILE")
        self.has_generation_blocks = bool(_GENERATION_BLOCK.search(self.template))
        # Markers that may end a turn: the tokenizer's special tokens, longest first.
        specials = {t.content for t in self.tok.added_tokens_decoder.values() if t.special}
        self.end_markers = sorted((s for s in specials if s), key=len, reverse=True)
        # Whether a span ends with one of them: a set lookup per distinct length (a
        # dozen) instead of an endswith per marker (DeepSeek-V3: 800, all ending in ">").
        self._end_marker_set = frozenset(self.end_markers)
        self._end_marker_lengths = sorted({len(m) for m in self.end_markers})
        self._empty_think = re.compile(
            r"\s*" + re.escape(settings.think_open.strip()) + r"\s*"
            + re.escape(settings.think_close.strip()) + r"\s*")
        # Every render under synthq's size and time budget (synthq.data.sandbox): a template
        # is code from a user or a Hub repository. The probes get a short clock, so a
        # hostile template is refused at enqueue within seconds.
        from synthq.data.sandbox import PROBE_SECONDS, install, limits

        install()
        with limits(seconds=PROBE_SECONDS):
            self._check_round_trip()
            #: Whether the template renders ``reasoning_content``, and the mode in force
            #: (``keep`` or ``drop``: ``auto`` resolved for this template).
            self.reasoning_field, self.reasoning = _reasoning_mode(
                lambda m: self.render(m, generation_prompt=False), settings)
        self._decode_ids = self._span_decoder()
        #: Set when the tokenizer is a plain byte-level BPE (see :meth:`_byte_level`):
        #: the backend to encode with and each id's bytes; else ``None``.
        self._fast: tuple[Any, list[bytes]] | None = self._byte_level()

    # -- rendering -----------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        from synthq.data.sandbox import TemplateLimitError

        extra: dict[str, Any] = {"tools": [dict(t) for t in tools]} if tools else {}
        try:
            text = self.tok.apply_chat_template(
                [dict(m) for m in messages], chat_template=self.template, tokenize=False,
                add_generation_prompt=generation_prompt, **extra, **self.kwargs)
        except TemplateLimitError as exc:  # over synthq's budget (synthq.data.sandbox)
            raise errors.InvalidInput(str(exc)) from exc
        except TemplateError as exc:  # e.g. "roles must alternate user/assistant"
            raise errors.InvalidInput(f"the chat template refused this conversation: "
                                      f"{exc}") from exc
        return str(text)

    @property
    def reasoning_line(self) -> str:
        """One line: what ``--reasoning auto`` became with this template, and why."""
        return _reasoning_line(self.reasoning_field, self.reasoning)

    def multi_turn_unstable(self) -> str | None:
        """Why this template cannot supervise several assistant turns of one conversation
        at once (None: it can), found by tokenizing :data:`MULTI_TURN_PROBE`.

        A template that rewrites history (Qwen3's drops the reasoning of turns before
        the last question, and writes an empty think block only into the last turn)
        renders a turn one way while it is the last and another once a turn follows:
        every such sample would fail ``boundary_unstable``.
        """
        messages = [self.place_reasoning(m) for m in MULTI_TURN_PROBE]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            self.tokenize(messages, turns=turns)
        except errors.BoundaryUnstable as exc:
            return str(exc)
        return None

    def _check_round_trip(self) -> None:
        """Refuse a tokenizer whose decode(encode(text)) is not the text."""
        try:
            text = self.render(PROBE_CONVERSATION, generation_prompt=False)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render a turn
            raise _cannot_render(exc) from exc
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        back = str(self.tok.decode(ids, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False))
        if back == text:
            return
        import transformers

        raise TokenizerSetupError(
            f"tokenizer {self.settings.tokenizer!r} loses characters in a round trip under "
            f"transformers {transformers.__version__}: {_round_trip_loss(text, back)}; every "
            "sample would fail with mask_mismatch. A known cause is transformers 5.8.1 loading "
            "DeepSeek-V3's tokenizer with a pre-tokenizer that drops spaces (transformers "
            "#45488): use a transformers version under which it round-trips (docs/data.md says "
            "which versions synthq's tests run)")

    def conversation(self, prompt: Sequence[Mapping[str, Any]], content: str,
                     reasoning: str | None,
                     tool_calls: Sequence[Mapping[str, Any]] | None = None
                     ) -> list[dict[str, Any]]:
        """The prompt plus the generated answer, reasoning placed per the settings."""
        from synthq.data.turns import answer_message

        answer = answer_message({"content": content, "reasoning_content": reasoning,
                                 "tool_calls": tool_calls}, reasoning=True)
        return [dict(m) for m in prompt] + [self.place_reasoning(answer)]

    def place_reasoning(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """An assistant message with its ``reasoning_content`` rendered the way the
        settings say: as the template's field, wrapped in think markers, or dropped."""
        out = dict(message)
        reasoning = out.pop("reasoning_content", None)
        if out.get("role") != "assistant" or not reasoning or self.reasoning != "keep":
            return out
        if self.reasoning_field:
            out["reasoning_content"] = reasoning
        else:
            out["content"] = (self.settings.think_open + reasoning + self.settings.think_close
                              + (out.get("content") or ""))
        return out

    # -- spans and mask ------------------------------------------------------------

    def _span(self, messages: Sequence[Mapping[str, Any]], i: int, full: str,
              tools: Sequence[Mapping[str, Any]] | None = None, *,
              cut: bool = False) -> tuple[int, int]:
        prefix = self.render(messages[:i], generation_prompt=True, tools=tools)
        # Through the last message is the whole conversation: rendered already.
        through = full if i == len(messages) - 1 else \
            self.render(messages[: i + 1], generation_prompt=False, tools=tools)
        if not through.startswith(prefix):
            raise errors.BoundaryUnstable(
                f"assistant turn {i}: rendering the conversation through the turn does not "
                "extend the rendering up to it with the generation prompt")
        if not full.startswith(through):
            raise errors.BoundaryUnstable(
                f"assistant turn {i} renders differently once later turns follow (the "
                "template rewrites history, e.g. drops earlier reasoning); use --mask last_turn")
        start, end = len(prefix), len(through)
        # End at the turn's end-of-turn marker, not at what the template adds after it.
        # (Only whitespace may follow it: the span's text before that whitespace is
        # looked up among the markers, one slice per marker length.)
        stripped = len(through[start:end].rstrip()) + start
        markers = self._end_marker_set
        for length in self._end_marker_lengths:
            if length > stripped - start:
                break
            if through[stripped - length:stripped] in markers:
                # A turn cut at max_tokens ends where the target stopped: the template
                # closes it with a marker the target never wrote, never supervised.
                end = stripped - length if cut else stripped
                break
        # An empty think block in front of the answer was written by the template.
        empty = self._empty_think.match(through, start, end)
        if empty and self.settings.think_open.strip() and empty.end() < end:
            start = empty.end()
        return start, end

    def tokenize(self, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None = None, *,
                 turns: Sequence[int] | None = None,
                 cut: Collection[int] = ()) -> Tokenized:
        """Render, tokenize once, mask, truncate and self-check one conversation.

        ``turns``: the indices of the assistant messages to supervise (None: the
        settings' mask). ``cut``: indices of turns cut at max_tokens, supervised
        without the end-of-turn marker the template closes them with.

        ``tools`` (the row's function definitions) go to the template's ``tools=``
        argument, so a turn's tool-call tokens render, and are supervised, as the
        target writes them.
        """
        assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not assistant:
            raise errors.InvalidInput("the conversation has no assistant turn")
        if turns is None:
            turns = assistant[-1:] if self.settings.mask == "last_turn" else assistant
        elif not turns or any(i not in assistant for i in turns):
            raise errors.InvalidInput(f"turns {list(turns)} are not assistant messages")
        turns = list(turns)
        full = self.render(messages, generation_prompt=False, tools=tools)
        spans = [self._span(messages, i, full, tools, cut=i in cut) for i in turns]

        if self._fast is not None:
            ids, mask, completion_ids, truncated = self._mask_byte_level(full, spans)
        else:
            ids, mask, completion_ids, truncated = self._mask_offsets(full, spans)
        if self.has_generation_blocks and not tools and not cut:
            self._cross_check(messages, ids, mask, turns)
        limit = self.settings.max_seq_len
        ids, mask = ids[:limit], mask[:limit]
        if not mask.any():
            raise errors.NoSupervisedTokens(
                f"no supervised token within max_seq_len={limit} (the prompt is "
                f"{spans[0][0]} characters long)")
        return Tokenized(input_ids=ids, loss_mask=mask, truncated=truncated,
                         completion_ids=completion_ids)

    def _mask_offsets(self, full: str, spans: list[tuple[int, int]]
                      ) -> tuple[np.ndarray, np.ndarray, list[int], bool]:
        """The general path: every token's offsets, and the decode self-check."""
        # The chat template writes BOS and every marker itself: no special tokens added.
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        # fromiter over the flattened pairs: half the time of asarray on a list of tuples.
        pairs = enc["offset_mapping"]
        offsets = np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64,
                              count=2 * len(pairs)).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), dtype=np.uint8)
        in_span = []
        for a, b in spans:
            inside = (starts >= a) & (ends <= b) & (ends > starts)
            mask |= inside.astype(np.uint8)
            in_span.append(inside)
        completion_ids = ids[in_span[-1]].tolist()

        limit = self.settings.max_seq_len
        truncated = len(ids) > limit
        # Self-check: each span's supervised tokens decode to exactly its text.
        for (a, b), inside in zip(spans, in_span, strict=True):
            kept = np.flatnonzero(inside[:limit])
            expected = full[a:b] if not truncated else full[a:min(b, int(ends[limit - 1]))]
            got = self._decode_ids(ids[:limit][kept].tolist()) if len(kept) else ""
            if got != expected:
                raise self._mismatch(got, expected)
        return ids, mask, completion_ids, truncated

    @staticmethod
    def _mismatch(got: str, expected: str) -> errors.MaskMismatch:
        return errors.MaskMismatch(
            f"supervised tokens decode to {got[:80]!r}… but the assistant text is "
            f"{expected[:80]!r}… (a token crosses the turn boundary?)")

    def _mask_byte_level(self, full: str, spans: list[tuple[int, int]]
                         ) -> tuple[np.ndarray, np.ndarray, list[int], bool]:
        """The same mask and the same self-check as :meth:`_mask_offsets`, for a
        plain byte-level BPE (:meth:`_byte_level`), without converting every
        token's offsets and without the library's decode.

        *The mask.* The general path supervises the tokens ``t`` with
        ``a <= start_t``, ``end_t <= b`` and ``start_t < end_t``. Here every
        token's offsets are non-empty and non-decreasing (starts and ends): no
        normaliser, so offsets are positions in the text itself; the byte-level
        pre-tokenizer splits the text into consecutive pieces and BPE cuts each
        piece into consecutive tokens of at least one byte; a token holding part
        of a multi-byte character reports that whole character, so neighbours
        may overlap (``ðŁ`` ``İ`` ``ī`` of one emoji: 19-20 each), but never go
        back; and the post-processor does not trim offsets. So that set is one
        run ``[ta, tb)``: ``ta`` the first token starting at or after ``a``,
        ``tb`` the first ending after ``b``. ``char_to_token(a)`` is the first
        token holding character ``a``: every token before it starts before
        ``a``; from there, step over the tokens that still start before ``a``
        (the one straddling ``a``, and the rest of a split character).
        Likewise from ``char_to_token(b - 1)`` for ``tb``: no earlier token ends
        after ``b``. A few ``token_to_chars`` calls instead of 2,000 pairs.

        *The self-check* is the general path's, the same comparison: the
        supervised tokens must decode to exactly the span's text. The library's
        byte-level decode of ids is ``from_utf8_lossy`` of their bytes joined;
        each id's bytes (``_byte_level``, checked there against the library's
        decode of every id alone and of the probe conversation) are joined here
        and compared with the span's UTF-8. Equal bytes are valid UTF-8, so the
        library's decode would give exactly the span's text. When they differ,
        the library decodes (its lossy text might still equal the span's), and
        a difference fails the sample as before, with the same message. Offsets
        prove nothing here: a token whose text is not the span's (a template
        that rewrites text, an offset that points elsewhere, a token crossing
        the boundary, a pre-tokenizer that drops characters) shows in the bytes.
        The run itself is checked against the offsets at its ends.
        """
        backend, table = self._fast  # type: ignore[misc]
        enc = backend.encode(full, add_special_tokens=False)
        id_list = enc.ids
        n = len(id_list)
        ids = np.fromiter(id_list, dtype=np.int32, count=n)
        mask = np.zeros(n, dtype=np.uint8)
        chars = enc.token_to_chars
        limit = self.settings.max_seq_len
        truncated = n > limit
        cut = 0  # where the kept text ends, when truncated: the last kept token's end
        if truncated:
            last = chars(limit - 1)
            if last is None:
                return self._mask_offsets(full, spans)
            cut = last[1]
        completion_ids: list[int] = []
        for a, b in spans:
            ta = tb = 0
            if b > a:
                ta = enc.char_to_token(a)
                tb = enc.char_to_token(b - 1)
                if ta is None or tb is None:  # a character no token holds: decide as before
                    return self._mask_offsets(full, spans)
                while ta < n and chars(ta)[0] < a:
                    ta += 1
                while tb < n and chars(tb)[1] <= b:
                    tb += 1
                if tb < ta:
                    tb = ta
            mask[ta:tb] = 1
            completion_ids = id_list[ta:tb]
            kept = id_list[ta:min(tb, limit)]
            expected = full[a:b] if not truncated else full[a:min(b, cut)]
            got_bytes = b"".join(itemgetter(*kept)(table)) if len(kept) > 1 else \
                b"".join([table[i] for i in kept])
            if got_bytes != expected.encode("utf-8"):
                got = self._decode_ids(kept) if kept else ""
                if got != expected:
                    raise self._mismatch(got, expected)
        return ids, mask, list(completion_ids), truncated

    def _byte_level(self) -> tuple[Any, list[bytes]] | None:
        """The backend and each id's bytes, when :meth:`_mask_byte_level` may be used.

        That is: transformers' own fast class (its call is the backend's
        ``encode_batch`` with the settings checked here, its decode the
        backend's); no truncation, padding or splitting of special tokens set on
        the backend; no normaliser; a BPE model without byte fallback; the
        byte-level pre-tokenizer, decoder and (if any) post-processor, the last
        not trimming offsets. And the bytes must reproduce the library's decode
        of every id alone and of the probe conversation, whose ids must equal
        the transformers call's. Anything else takes the general path.
        """
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        backend = getattr(self.tok, "_tokenizer", None)
        cls = type(self.tok)
        if backend is None or any(getattr(cls, m) is not getattr(TokenizersBackend, m)
                                  for m in ("_encode_plus", "_decode", "__call__")):
            return None
        if (backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens
                or getattr(self.tok, "split_special_tokens", False)):
            return None
        try:
            spec = json.loads(backend.to_str())
        except Exception:  # noqa: BLE001 - a backend that cannot serialise: general path
            return None
        normalizer = spec.get("normalizer")
        post = spec.get("post_processor")
        model = spec.get("model") or {}
        if normalizer is not None and normalizer != {"type": "Sequence", "normalizers": []}:
            return None
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            return None
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        if '"ByteLevel"' not in json.dumps(spec.get("pre_tokenizer")):
            return None
        if post is not None and (post.get("type") != "ByteLevel" or post.get("trim_offsets")):
            return None
        byte_of = _byte_level_chars()
        size = backend.get_vocab_size(with_added_tokens=True)
        table: list[bytes] = []
        for i in range(size):
            token = backend.id_to_token(i)
            if token is None:
                table.append(b"")
                continue
            try:
                table.append(bytes([byte_of[c] for c in token]))
            except KeyError:  # the byte-level decoder passes such a token through as is
                table.append(token.encode("utf-8"))
        alone = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        if any(text != raw.decode("utf-8", "replace") for text, raw in zip(alone, table,
                                                                          strict=True)):
            return None
        probe = self.render(PROBE_CONVERSATION, generation_prompt=False)
        ids = backend.encode(probe, add_special_tokens=False).ids
        if ids != list(self.tok(probe, add_special_tokens=False)["input_ids"]):
            return None
        if b"".join(table[i] for i in ids) != self._decode_ids(ids).encode("utf-8"):
            return None
        return backend, table

    def _span_decoder(self) -> Any:
        """``ids -> text`` as ``tok.decode(ids, skip_special_tokens=False,
        clean_up_tokenization_spaces=False)`` gives it.

        For transformers' fast tokenizer class, whose ``_decode`` is then exactly
        the tokenizers library's ``decode``, that is called directly: the wrapper
        checks every id's type in Python first (``to_py_obj``), which cost more
        than the decode itself (0.8 against 0.6 ms for 2,000 ids). A class that
        decodes its own way keeps its own.
        """
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        backend = getattr(self.tok, "_tokenizer", None)
        if backend is not None and type(self.tok)._decode is TokenizersBackend._decode:
            return lambda ids: backend.decode(ids, skip_special_tokens=False)
        return lambda ids: self.tok.decode(ids, skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False)

    def _cross_check(self, messages: Sequence[Mapping[str, Any]], ids: np.ndarray,
                     mask: np.ndarray, turns: list[int]) -> None:
        """Compare with transformers' mask from ``{% generation %}`` blocks."""
        out: Any = self.tok.apply_chat_template(
            [dict(m) for m in messages], chat_template=self.template, tokenize=True,
            return_dict=True, return_assistant_tokens_mask=True, add_generation_prompt=False,
            **self.kwargs)
        theirs = np.asarray(out["assistant_masks"], dtype=np.uint8)
        their_ids = np.asarray(out["input_ids"], dtype=np.int32)
        if their_ids.shape != ids.shape or not np.array_equal(their_ids, ids):
            return  # tokenized with special tokens added: masks are not comparable
        if len(turns) < sum(1 for m in messages if m.get("role") == "assistant"):
            # Only the last turn is ours: compare from its first supervised token on.
            first = int(np.flatnonzero(mask)[0]) if mask.any() else len(mask)
            theirs = theirs.copy()
            theirs[:first] = 0
        if not np.array_equal(theirs, mask):
            diff = np.flatnonzero(theirs != mask)
            raise errors.MaskMismatch(
                f"mask disagrees with the template's generation blocks at {len(diff)} "
                f"tokens (first at position {int(diff[0])})")


def _round_trip_loss(text: str, back: str) -> str:
    """What a round trip changed, in a few words and the first difference."""
    spaces, kept = sum(c.isspace() for c in text), sum(c.isspace() for c in back)
    if kept < spaces:
        what = f"{spaces - kept} of {spaces} spaces and line breaks dropped"
    elif kept > spaces:
        what = f"{kept - spaces} spaces added"
    else:
        what = "characters changed (normalisation?)"
    at = next((i for i, (a, b) in enumerate(zip(text, back, strict=False)) if a != b),
              min(len(text), len(back)))
    start = max(0, at - 12)
    return (f"{what}: a probe conversation decodes to {back[start:at + 28]!r} "
            f"where the text is {text[start:at + 28]!r}")


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet: the character that stands for each byte (GPT-2's map)."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out = {chr(b): b for b in kept}
    extra = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _reasoning_mode(render: Callable[[list[dict[str, Any]]], str],
                    settings: TokenizeSettings) -> tuple[bool, str]:
    """``(the template renders reasoning_content, keep or drop)`` from probe renders;
    ``keep`` where the template removes reasoning either way is a TokenizerSetupError."""
    user = {"role": "user", "content": "q"}
    try:
        with_field = render([user, {"role": "assistant", "content": "a",
                                    "reasoning_content": _PROBE}])
    except Exception as exc:  # noqa: BLE001 - a template that cannot render a turn
        from synthq.data.sandbox import TemplateLimitError

        if isinstance(exc, TemplateLimitError):  # over synthq's budget: its own line
            raise TokenizerSetupError(str(exc)) from exc
        raise TokenizerSetupError(f"the chat template cannot render a conversation: "
                                  f"{exc}") from exc
    if _PROBE in with_field:
        return True, "drop" if settings.reasoning == "drop" else "keep"
    if settings.reasoning == "drop":
        return False, "drop"
    wrapped = render([user, {"role": "assistant", "content": settings.think_open + _PROBE
                             + settings.think_close + "a"}])
    if _PROBE in wrapped:
        return False, "keep"
    if settings.reasoning == "keep":
        raise TokenizerSetupError(
            "the chat template drops reasoning from assistant turns, so --reasoning keep "
            "cannot keep it: pass --reasoning auto (drops it here) or drop, or a "
            "--chat-template that renders reasoning")
    return False, "drop"


def _reasoning_line(field: bool, mode: str) -> str:
    if mode == "drop":
        return ("--reasoning auto: drop: the chat template removes reasoning from assistant "
                "turns, so the examples hold the answers without it")
    how = "as its reasoning_content" if field else "wrapped in think markers in the content"
    return f"--reasoning auto: keep: reasoning is rendered {how} and supervised"


def precheck_reasoning(settings: TokenizeSettings) -> str | None:
    """The reasoning mode (``keep``/``drop``) from the chat template alone, in well under
    a second: the template is read from ``--chat-template`` or the local tokenizer
    directory's files and rendered with jinja2, without loading the tokenizer (which
    takes 20 s to a minute for a large vocabulary). Refuses an impossible ``keep``
    (TokenizerSetupError). None when this cannot tell (a Hub id, a template that needs
    transformers' extensions): loading the tokenizer decides then."""
    template, specials = _template_text(settings)
    if template is None:
        return None
    from synthq.data.sandbox import PROBE_SECONDS, BoundedSandbox, TemplateLimitError, limits

    try:
        def raise_exception(message: str) -> None:
            raise ValueError(message)

        # synthq's bounded sandbox, as every render: the template may be hostile.
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        compiled = env.from_string(template)
    except Exception:  # noqa: BLE001 - e.g. {% generation %}: transformers' own env decides
        return None
    kwargs = {**specials, **settings.template_kwargs}

    def render(messages: list[dict[str, Any]]) -> str:
        return str(compiled.render(messages=messages, add_generation_prompt=False, **kwargs))

    try:
        with limits(seconds=PROBE_SECONDS):
            _, mode = _reasoning_mode(render, settings)
    except TokenizerSetupError as exc:
        if isinstance(exc.__cause__, TemplateLimitError):
            raise
        if "cannot render" in str(exc):
            return None  # maybe only under transformers' environment: the full load says
        raise
    return mode


def _template_text(settings: TokenizeSettings) -> tuple[str | None, dict[str, str]]:
    """The chat template and the special tokens it may name, from files only."""
    from pathlib import Path

    folder = Path(settings.tokenizer).expanduser()
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):  # no such file: a Hub id, or no config
        config = json.loads((folder / "tokenizer_config.json").read_text())
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[name] = value
    if settings.chat_template:
        return settings.chat_template, specials
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(template, str):
        try:
            template = (folder / "chat_template.jinja").read_text()
        except OSError:
            template = None
    return template, specials


_cache: dict[TokenizeSettings, ChatTokenizer] = {}
_cache_lock = threading.Lock()


def get_chat_tokenizer(settings: TokenizeSettings) -> ChatTokenizer:
    """This process's tokenizer for ``settings`` (loaded once, shared by threads)."""
    with _cache_lock:
        tok = _cache.get(settings)
        if tok is None:
            tok = _cache[settings] = ChatTokenizer(settings)
            if settings.reasoning == "auto":  # the job stores the resolved mode: one load
                _cache.setdefault(replace(settings, reasoning=tok.reasoning), tok)
        return tok

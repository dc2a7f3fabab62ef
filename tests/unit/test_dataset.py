"""Unit tests for synthq.data.dataset: row forms, rejections, sources and keys."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from synthq.data import dataset as ds
from synthq.data.dataset import (
    KEY_VERSION,
    MAX_ROW_CHARS,
    DatasetError,
    InvalidRow,
    Row,
    content_key,
    iter_rows,
    normalize,
    raw_key,
    row_tools,
    source_id,
)
from synthq.data.dataset import read as ds_read

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


def msg(role: str, content: str) -> dict[str, str]:
    """Shorthand for an OpenAI-style message."""
    return {"role": role, "content": content}


def reason_of(obj: Any, **kwargs: Any) -> str:
    """The InvalidRow reason that normalize gives for ``obj``."""
    with pytest.raises(InvalidRow) as info:
        normalize(obj, max_chars=kwargs.get("max_chars", MAX_ROW_CHARS),
                  key_version=kwargs.get("key_version", KEY_VERSION))
        row_tools(obj)
    assert str(info.value) == info.value.reason
    return info.value.reason


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Write ``lines`` (objects are JSON-encoded, strings written as-is)."""
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------
# Row forms
# --------------------------------------------------------------------------


def test_openai_messages_single_turn() -> None:
    assert normalize({"messages": [msg("user", "Hi")]}, max_chars=100) == [msg("user", "Hi")]


def test_openai_messages_extra_keys_dropped_and_copied() -> None:
    original = {"messages": [{"role": "user", "content": "Hi", "name": "bob", "weight": 1}]}
    result = normalize(original, max_chars=100)
    assert result == [msg("user", "Hi")]
    result[0]["content"] = "changed"
    assert original["messages"][0]["content"] == "Hi"


def test_sharegpt_conversations() -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "4"},
        ]
    }
    assert normalize(row, max_chars=1000) == [
        msg("system", "Be brief."),
        msg("user", "What is 2+2?"),
    ]


@pytest.mark.parametrize(
    ("speaker", "role"),
    [
        ("human", "user"),
        ("user", "user"),
        ("gpt", "assistant"),
        ("assistant", "assistant"),
        ("chatgpt", "assistant"),
        ("system", "system"),
        ("Human", "user"),
        ("GPT", "assistant"),
    ],
)
def test_sharegpt_role_aliases(speaker: str, role: str) -> None:
    row = {"conversations": [{"from": speaker, "value": "x"}, {"from": "human", "value": "q"}]}
    # the row ends in a user turn: it is sent whole
    assert normalize(row, max_chars=100) == [msg(role, "x"), msg("user", "q")]


def test_conversation_alias() -> None:
    row = {"conversation": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hey"}]}
    assert normalize(row, max_chars=100) == [msg("user", "Hello")]


def test_messages_with_from_value_items_and_mixed_styles() -> None:
    row = {
        "messages": [
            {"from": "system", "value": "sys"},
            {"role": "user", "content": "one"},
            {"from": "gpt", "value": "two"},
            {"from": "human", "value": "three"},
            {"role": "assistant", "content": "four"},
        ]
    }
    assert normalize(row, max_chars=100) == [
        msg("system", "sys"),
        msg("user", "one"),
        msg("assistant", "two"),
        msg("user", "three"),
    ]


def test_prompt_form() -> None:
    assert normalize({"prompt": "Tell me a joke"}, max_chars=100) == [msg("user", "Tell me a joke")]


def test_prompt_form_with_system() -> None:
    row = {"prompt": "Tell me a joke", "system": "You are funny."}
    assert normalize(row, max_chars=100) == [
        msg("system", "You are funny."),
        msg("user", "Tell me a joke"),
    ]


def test_prompt_form_blank_system_is_omitted() -> None:
    assert normalize({"prompt": "Q", "system": "  "}, max_chars=100) == [msg("user", "Q")]


def test_messages_take_precedence_and_nulls_count_as_absent() -> None:
    row: dict[str, Any] = {"messages": [msg("user", "from messages")], "prompt": "from prompt"}
    assert normalize(row, max_chars=100) == [msg("user", "from messages")]
    # columnar sources fill unused columns with None
    row = {"messages": None, "conversations": None, "prompt": "from prompt", "system": None}
    assert normalize(row, max_chars=100) == [msg("user", "from prompt")]


# --------------------------------------------------------------------------
# The prompt: through the last user turn
# --------------------------------------------------------------------------


def test_multi_turn_with_system_trims_last_assistant() -> None:
    row = {
        "messages": [
            msg("system", "You are a tutor."),
            msg("user", "What is a prime?"),
            msg("assistant", "A number with exactly two divisors."),
            msg("user", "Is 1 prime?"),
            msg("assistant", "No."),
        ]
    }
    assert normalize(row, max_chars=1000) == [
        msg("system", "You are a tutor."),
        msg("user", "What is a prime?"),
        msg("assistant", "A number with exactly two divisors."),
        msg("user", "Is 1 prime?"),
    ]


def test_row_ending_in_a_user_turn_is_sent_whole() -> None:
    # examples/prompts.jsonl's demo-001 has this shape: the follow-up is the question.
    row = {
        "messages": [
            msg("system", "s"),
            msg("user", "Name a city."),
            msg("assistant", "Ashgrove."),
            msg("user", "Describe Ashgrove."),
        ]
    }
    assert normalize(row, max_chars=100) == row["messages"]


def test_trailing_assistant_turns_are_dropped() -> None:
    row = {
        "messages": [
            msg("user", "a"),
            msg("assistant", "b"),
            msg("user", "c"),
            msg("user", "d"),
            msg("assistant", "e"),
            msg("assistant", "f"),
        ]
    }
    assert normalize(row, max_chars=100) == [
        msg("user", "a"),
        msg("assistant", "b"),
        msg("user", "c"),
        msg("user", "d"),
    ]


def test_turns_after_the_last_user_turn_are_dropped() -> None:
    row = {"messages": [msg("user", "q"), msg("assistant", "a"), msg("system", "s"),
                        msg("assistant", "b")]}
    assert normalize(row, max_chars=100) == [msg("user", "q")]
    assert normalize({"messages": [msg("user", "q"), msg("system", "s")]},
                     max_chars=100) == [msg("user", "q")]


def test_a_conversation_may_open_with_an_assistant_turn() -> None:
    row = {"messages": [msg("assistant", "Hi, how can I help?"), msg("user", "q")]}
    assert normalize(row, max_chars=100) == row["messages"]


def test_key_version_1_keeps_the_old_rule() -> None:
    """Jobs made before the rule changed cut before the last assistant turn, as they did."""
    demo = {"messages": [msg("system", "s"), msg("user", "a"), msg("assistant", "b"),
                         msg("user", "c")]}
    assert normalize(demo, key_version=1) == [msg("system", "s"), msg("user", "a")]
    answered = {"messages": [msg("user", "a"), msg("assistant", "b")]}
    assert normalize(answered, key_version=1) == normalize(answered) == [msg("user", "a")]
    assert reason_of({"messages": [msg("user", "q"), msg("system", "s")]},
                     key_version=1) == "prompt does not end with a user turn"
    assert reason_of({"messages": [msg("assistant", "a"), msg("user", "q")]},
                     key_version=1) == "no user turn"


def test_no_assistant_turn_keeps_whole_conversation() -> None:
    row = {"messages": [msg("system", "s"), msg("user", "a"), msg("user", "b")]}
    assert normalize(row, max_chars=100) == row["messages"]


# --------------------------------------------------------------------------
# Rejections
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"text": "hello"}, "no messages, conversations or prompt field"),
        ({}, "no messages, conversations or prompt field"),
        ({"messages": None}, "no messages, conversations or prompt field"),
        ({"messages": []}, "empty conversation"),
        ({"conversations": []}, "empty conversation"),
        ({"messages": "hello"}, "messages is not a list"),
        ({"conversations": {"from": "human"}}, "conversations is not a list"),
        ({"messages": [msg("system", "s"), msg("assistant", "a")]}, "no user turn"),
        ({"messages": [msg("system", "s")]}, "no user turn"),
        ({"messages": [msg("assistant", "a"), msg("assistant", "b")]}, "no user turn"),
        ({"messages": [msg("user", "   \n\t")]}, "message 1 is empty"),
        ({"messages": [msg("system", "s"), msg("user", "")]}, "message 2 is empty"),
        (
            {"messages": [msg("user", ""), msg("assistant", "a"), msg("user", "q")]},
            "message 1 is empty",
        ),
        ({"prompt": ""}, "message 1 is empty"),
        ({"prompt": " ", "system": "s"}, "message 2 is empty"),
        ({"prompt": 42}, "prompt is not a string"),
        ({"prompt": "q", "system": ["s"]}, "system is not a string"),
        (
            {"messages": [msg("user", "a"), msg("assistant", "b"), msg("robot", "c")]},
            "unknown role 'robot' in message 3",
        ),
        ({"messages": [msg("tool", "c")]}, "message 1 is a tool result without a tool call "
                                           "before it"),
        ({"messages": [msg("user", "q"), msg("assistant", "a"), msg("tool", "c")]},
         "message 3 is a tool result without a tool call before it"),
        ({"messages": [msg("user", "q"), {"role": "assistant", "content": None,
                                          "tool_calls": [{"function": {"arguments": "{}"}}]}]},
         "message 2 has a tool call without a function name"),
        ({"messages": [msg("user", "q")], "tools": [{"type": "function"}]},
         "tool 1 has no function name"),
        ({"conversations": [{"from": "bing", "value": "c"}]}, "unknown role 'bing' in message 1"),
        (
            {"messages": [msg("user", "a"), {"role": "user", "content": ["a", "b"]}]},
            "message 2 content is not a string",
        ),
        (
            {"messages": [msg("user", "a"), {"role": "user", "content": None}]},
            "message 2 content is not a string",
        ),
        ({"messages": [{"role": "user", "content": 7}]}, "message 1 content is not a string"),
        ({"messages": [{"role": "user"}]}, "message 1 has no content"),
        ({"messages": [{"content": "hi"}]}, "message 1 has no role"),
        ({"messages": [{"role": 3, "content": "hi"}]}, "message 1 role is not a string"),
        ({"messages": ["hi"]}, "message 1 is not an object"),
        ({"messages": [msg("user", "\ud83d")]}, "message 1 content is not valid Unicode"),
    ],
)
def test_rejection_reasons(row: dict[str, Any], reason: str) -> None:
    assert reason_of(row) == reason


def test_invalid_row_is_value_error() -> None:
    assert issubclass(InvalidRow, ValueError)
    assert InvalidRow("why").reason == "why"


def test_non_mapping_row_rejected() -> None:
    assert reason_of(["not", "a", "dict"]) == "row is not a JSON object"


def test_max_chars_limit() -> None:
    row = {"messages": [msg("system", "12345"), msg("user", "67890")]}
    assert normalize(row, max_chars=10) == row["messages"]
    assert reason_of(row, max_chars=9) == "row has 10 characters, over the limit of 9"


def test_max_chars_counts_only_the_prompt() -> None:
    row = {"messages": [msg("user", "abc"), msg("assistant", "x" * 1000)]}
    assert normalize(row, max_chars=3) == [msg("user", "abc")]


def test_default_limit() -> None:
    assert MAX_ROW_CHARS == 200_000
    big = {"prompt": "x" * (MAX_ROW_CHARS + 1)}
    assert (
        reason_of(big)
        == f"row has {MAX_ROW_CHARS + 1} characters, over the limit of {MAX_ROW_CHARS}"
    )


# --------------------------------------------------------------------------
# JSONL sources
# --------------------------------------------------------------------------


def test_jsonl_bad_line_and_blank_line(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"prompt": "first"},
            "",
            "{not json",
            "   ",
            "[1, 2]",
            {"messages": [msg("user", "fourth")]},
            {"text": "no field"},
        ],
    )
    rows = list(iter_rows(str(path)))
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0] == Row(index=0, messages=[msg("user", "first")], skip_reason=None, raw=None)
    assert not rows[0].skipped
    assert rows[1].messages is None
    assert rows[1].skip_reason is not None and rows[1].skip_reason.startswith("not valid JSON: ")
    assert rows[1].raw == "{not json"
    assert rows[2].skip_reason == "row is not a JSON object"
    assert rows[2].raw == "[1, 2]"
    assert rows[3].messages == [msg("user", "fourth")]
    assert rows[4].skip_reason == "no messages, conversations or prompt field"
    assert rows[4].raw == '{"text": "no field"}'
    assert rows[4].skipped


def test_jsonl_raw_is_cut(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": [msg("robot", "x" * 5000)]}])
    (row,) = iter_rows(str(path))
    assert row.skip_reason == "unknown role 'robot' in message 1"
    assert row.raw is not None and len(row.raw) == ds.RAW_PREVIEW_CHARS


def test_jsonl_max_chars_passed_through(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "abcdef"}, {"prompt": "abc"}])
    rows = list(iter_rows(str(path), max_chars=4))
    assert rows[0].skip_reason == "row has 6 characters, over the limit of 4"
    assert rows[1].messages == [msg("user", "abc")]


def test_jsonl_bom_crlf_and_bad_utf8(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\r\n'
        b'{"prompt": "\xff\xfe"}\r\n'
        b'{"prompt": "\xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x91\x8b"}\r\n'
    )
    rows = list(iter_rows(str(path)))
    assert rows[0].messages == [msg("user", "café")]
    assert rows[1].skip_reason == "not valid UTF-8"
    assert rows[2].messages == [msg("user", "你好 👋")]


def test_jsonl_gz(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"prompt": "zipped"}) + "\n\n")
        handle.write("oops\n")
        handle.write(json.dumps({"conversations": [{"from": "human", "value": "two"}]}) + "\n")
    rows = list(iter_rows(str(path)))
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[0].messages == [msg("user", "zipped")]
    assert rows[1].skip_reason is not None and rows[1].skip_reason.startswith("not valid JSON")
    assert rows[2].messages == [msg("user", "two")]


def test_json_extension_lines_and_array(tmp_path: Path) -> None:
    lines = write_jsonl(tmp_path / "lines.json", [{"prompt": "a"}, {"prompt": "b"}])
    assert [r.messages for r in iter_rows(str(lines))] == [[msg("user", "a")], [msg("user", "b")]]
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"prompt": "a"}, 5, {"prompt": "b"}]), encoding="utf-8")
    rows = list(iter_rows(str(array)))
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[1].skip_reason == "row is not a JSON object"
    assert rows[2].messages == [msg("user", "b")]


def test_iter_rows_streams(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "a"}, "garbage"])
    iterator = iter_rows(str(path))
    first = next(iterator)
    assert first.messages == [msg("user", "a")]


# --------------------------------------------------------------------------
# Parquet sources
# --------------------------------------------------------------------------


def test_parquet_list_of_struct_messages(tmp_path: Path) -> None:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table(
        {
            "messages": pa.array(
                [
                    [
                        {"role": "system", "content": "s"},
                        {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a1"},
                    ],
                    None,
                    [{"role": "robot", "content": "x"}],
                    [{"role": "user", "content": None}],
                ],
                type=pa.list_(message),
            ),
            "prompt": pa.array([None, "plain", None, None], type=pa.string()),
            "id": pa.array([1, 2, 3, 4], type=pa.int64()),
        }
    )
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    rows = list(iter_rows(str(path)))
    assert [r.index for r in rows] == [0, 1, 2, 3]
    assert rows[0].messages == [msg("system", "s"), msg("user", "q1")]
    assert rows[1].messages == [msg("user", "plain")]
    assert rows[2].skip_reason == "unknown role 'robot' in message 1"
    assert rows[2].raw is not None and '"robot"' in rows[2].raw
    assert rows[3].skip_reason == "message 1 content is not a string"


def test_parquet_sharegpt_many_batches(tmp_path: Path) -> None:
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    count = ds_read.PARQUET_BATCH_SIZE * 2 + 7
    table = pa.table(
        {
            "conversations": pa.array(
                [
                    [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]
                    for i in range(count)
                ],
                type=pa.list_(turn),
            )
        }
    )
    path = tmp_path / "big.parquet"
    pq.write_table(table, path, row_group_size=500)
    rows = list(iter_rows(str(path)))
    assert len(rows) == count
    assert rows[-1] == Row(
        index=count - 1, messages=[msg("user", f"q{count - 1}")], skip_reason=None, raw=None
    )


# --------------------------------------------------------------------------
# Directories and source resolution
# --------------------------------------------------------------------------


def test_directory_of_two_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b0"}, "bad", {"prompt": "b2"}])
    pq.write_table(pa.table({"prompt": ["a0", "a1"]}), tmp_path / "a.parquet")
    (tmp_path / "README.md").write_text("ignored", encoding="utf-8")
    (tmp_path / ".hidden.jsonl").write_text('{"prompt": "hidden"}\n', encoding="utf-8")
    rows = list(iter_rows(str(tmp_path)))
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert [r.messages[0]["content"] if r.messages else None for r in rows] == [
        "a0",
        "a1",
        "b0",
        None,
        "b2",
    ]


def test_directory_without_data_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x", encoding="utf-8")
    with pytest.raises(DatasetError, match="no .jsonl"):
        iter_rows(str(tmp_path))


@pytest.mark.parametrize(
    "source", ["./missing.jsonl", "/nonexistent/data", "missing.jsonl", "data/x.parquet"]
)
def test_missing_path_raises_immediately(source: str) -> None:
    with pytest.raises(DatasetError, match="^no such file: "):
        iter_rows(source)  # not iterated: the error comes from the call itself


def test_unsupported_file_type(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="unsupported file type"):
        iter_rows(str(path))


def test_hf_id_without_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "datasets" else real_find_spec(name, *a),
    )
    with pytest.raises(DatasetError) as info:
        iter_rows("some-org/some-dataset:test")
    message = str(info.value)
    assert "some-org/some-dataset:test" in message
    assert "no such file" in message and "'datasets' package is not installed" in message


def test_hf_id_split_parsing() -> None:
    assert ds_read._split_hf_id("org/name") == ("org/name", "train")
    assert ds_read._split_hf_id("org/name:test") == ("org/name", "test")
    assert ds_read._split_hf_id("name:") == ("name", "train")


def test_looks_like_path() -> None:
    assert ds_read.looks_like_path("./x")
    assert ds_read.looks_like_path("/x")
    assert ds_read.looks_like_path("prompts.jsonl")
    assert not ds_read.looks_like_path("HuggingFaceH4/ultrachat_200k")
    assert not ds_read.looks_like_path("Org/dataset-v1.5")


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------


def test_content_key_stable() -> None:
    messages = [msg("system", "s"), msg("user", "héllo 你好")]
    key = content_key(messages, {"model": "m", "temperature": 0.7})
    assert len(key) == 64 and all(c in "0123456789abcdef" for c in key)
    # same content, different dict order: same key
    assert (
        content_key(
            [{"content": "s", "role": "system"}, msg("user", "héllo 你好")],
            {"temperature": 0.7, "model": "m"},
        )
        == key
    )
    # fixed value guards against accidental changes of the canonical form
    canonical = json.dumps(
        {"messages": messages, "settings": {"model": "m", "temperature": 0.7},
         "key_version": 2},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert key == hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def test_content_key_of_version_1_is_the_old_key() -> None:
    """Keys of jobs made before key versions are unchanged, so their rows still match."""
    messages = [msg("user", "hi")]
    old = json.dumps({"messages": messages, "settings": {}}, sort_keys=True,
                     separators=(",", ":"), ensure_ascii=False)
    assert content_key(messages, {}, 1) == hashlib.sha256(old.encode()).hexdigest()
    assert content_key(messages, {}, 2) != content_key(messages, {}, 1)
    assert content_key(messages, {}) == content_key(messages, {}, KEY_VERSION)


def test_content_key_sensitive() -> None:
    base = content_key([msg("user", "hi")], {"temperature": 0.7})
    assert content_key([msg("user", "hi ")], {"temperature": 0.7}) != base
    assert content_key([msg("system", "hi")], {"temperature": 0.7}) != base
    assert content_key([msg("user", "hi")], {"temperature": 0.8}) != base
    assert content_key([msg("user", "hi")], {"temperature": 0.7, "seed": 1}) != base
    assert content_key([msg("user", "hi"), msg("user", "hi")], {"temperature": 0.7}) != base


_json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@settings(max_examples=200)
@given(messages=st.lists(st.dictionaries(st.sampled_from(["role", "content", "tool_calls",
                                                          "name"]), _json, min_size=1),
                         max_size=4),
       key_settings=st.dictionaries(st.text(max_size=8), _json, max_size=4),
       key_version=st.sampled_from([1, 2, 3]),
       tools=st.none() | st.dictionaries(st.sampled_from(["tools", "tool_choice"]), _json))
def test_content_keys_match_content_key(messages: list[dict[str, Any]],
                                        key_settings: dict[str, Any], key_version: int,
                                        tools: dict[str, Any] | None) -> None:
    """Enqueue's ContentKeys builds content_key's digest from parts: the same for any
    JSON (lone surrogates, floats, nesting, tools or none), and the prompt text it
    returns is the messages' canonical JSON."""
    key, text = ds.ContentKeys(key_settings, key_version).key(messages, tools)
    assert key == content_key(messages, key_settings, key_version, tools)
    assert json.loads(text.decode("utf-8", "surrogatepass")) == messages


def test_raw_key() -> None:
    assert raw_key("{bad") == hashlib.sha256(b"skipped:{bad").hexdigest()
    assert raw_key("{bad") != raw_key("{bad ")
    assert raw_key("x") != content_key([msg("user", "x")], {})


# --------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------

_text = st.text(min_size=1, max_size=40).filter(lambda s: s.strip() != "")
_role = st.sampled_from(["system", "user", "assistant"])


@st.composite
def valid_conversations(draw: st.DrawFn) -> list[dict[str, str]]:
    """Conversations with a user turn: ``history + user + tail``.

    The tail holds no user turn (assistant answers, system messages) and is
    dropped; the history is anything.
    """
    turns = [msg(role, text) for role, text in draw(st.lists(st.tuples(_role, _text), max_size=6))]
    turns.append(msg("user", draw(_text)))
    tail = draw(st.lists(st.tuples(st.sampled_from(["system", "assistant"]), _text), max_size=3))
    turns.extend(msg(role, text) for role, text in tail)
    return turns


def _as_form(messages: list[dict[str, str]], form: str) -> dict[str, Any]:
    """Encode OpenAI messages as a row of the given form."""
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    if form == "messages":
        return {"messages": messages}
    return {form: [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]}


def _oracle(messages: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """Independent statement of the prompt rule; None when the row is invalid."""
    questions = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages[: questions[-1] + 1] if questions else None


@given(valid_conversations(), st.sampled_from(["messages", "conversations", "conversation"]))
@settings(max_examples=200, deadline=None)
def test_property_valid_conversations(messages: list[dict[str, str]], form: str) -> None:
    result = normalize(_as_form(messages, form), max_chars=MAX_ROW_CHARS)
    assert result == _oracle(messages)
    assert result[-1]["role"] == "user"
    assert all(set(m) == {"role", "content"} for m in result)


@given(st.lists(st.tuples(_role, _text), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_property_matches_oracle(turns: list[tuple[str, str]]) -> None:
    messages = [msg(role, text) for role, text in turns]
    expected = _oracle(messages)
    if expected is None or not any(m["role"] == "user" for m in expected):
        with pytest.raises(InvalidRow):
            normalize({"messages": messages}, max_chars=MAX_ROW_CHARS)
    else:
        assert normalize({"messages": messages}, max_chars=MAX_ROW_CHARS) == expected


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "from", "value", "x"]) | st.text(max_size=5),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@given(
    st.dictionaries(
        st.sampled_from(["messages", "conversations", "conversation", "prompt", "system", "other"]),
        _json,
        max_size=3,
    )
)
@settings(max_examples=300, deadline=None)
def test_property_arbitrary_rows_only_raise_invalid_row(obj: dict[str, Any]) -> None:
    try:
        result = normalize(obj, max_chars=1000)
    except InvalidRow as exc:
        assert exc.reason
    else:
        assert result and result[-1]["role"] == "user"


# --------------------------------------------------------------------------
# The bundled demo dataset
# --------------------------------------------------------------------------


@pytest.mark.skipif(not EXAMPLES.exists(), reason="examples/prompts.jsonl not present")
def test_example_dataset() -> None:
    rows = list(iter_rows(str(EXAMPLES)))
    skipped = [r for r in rows if r.skipped]
    assert 150 <= len(rows) <= 250
    assert len(skipped) == 4
    kept = [r.messages for r in rows if r.messages is not None]
    keys = {content_key(m, {}) for m in kept}
    assert len(keys) == len(kept), "demo prompts must be distinct"


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, load: Any) -> list[tuple[Any, ...]]:
    """Install a stand-in ``datasets`` module whose load_dataset is ``load``."""
    import importlib.machinery
    import sys
    import types

    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)

    def load_dataset(name: str, *, split: str, streaming: bool) -> Any:
        calls.append((name, split, streaming))
        return load(name)

    module.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no Hub to reach: the stand-in answers
    return calls


def test_hf_id_with_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    data = [{"prompt": "hf one"}, {"messages": [msg("robot", "x")]}]
    calls = _fake_datasets(monkeypatch, lambda name: iter(data))
    rows = list(iter_rows("org/demo:validation"))
    assert calls == [("org/demo", "validation", True)]
    assert rows[0].messages == [msg("user", "hf one")]
    assert rows[1].skip_reason == "unknown role 'robot' in message 1"
    assert rows[1].raw is not None and "robot" in rows[1].raw
    list(iter_rows("org/demo"))
    assert calls[-1] == ("org/demo", "train", True)


def test_hf_load_failure_is_dataset_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> Any:
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    _fake_datasets(monkeypatch, fail)
    with pytest.raises(DatasetError, match="cannot load Hugging Face dataset 'org/nope'"):
        iter_rows("org/nope")


def test_a_hub_that_does_not_answer_fails_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not after the Hub client's ~30 s of retries; and the message says no local file."""
    import socket
    import time

    from synthq.data.dataset import read as dataset

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections, never answers
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(dataset, "HUB_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with silent, pytest.raises(DatasetError) as err:
        iter_rows("my-prompts")
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert "no local file or folder named 'my-prompts'" in message
    assert "did not answer within 0.5 s" in message and "HF_HUB_OFFLINE=1" in message


def test_corrupt_gzip_is_dataset_error(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n' * 50)[:40] + b"\x00garbage")
    with pytest.raises(DatasetError, match="cannot read"):
        list(iter_rows(str(path)))


# --------------------------------------------------------------------------
# Source ids: the row's own id
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"id": "a-1", "uuid": "u", "conversation_id": "c"}, "a-1"),
        ({"uuid": "u", "conversation_id": "c", "sample_id": "s"}, "u"),
        ({"conversation_id": "c", "sample_id": "s"}, "c"),
        ({"sample_id": 7}, "7"),
        ({"id": None, "uuid": "", "sample_id": "s"}, "s"),  # null and empty count as absent
        ({"id": 12345678901234}, "12345678901234"),
        ({"id": {"shard": 1, "n": 2}}, '{"n":2,"shard":1}'),
        ({"id": True}, None),
        ({"prompt": "no id"}, None),
    ],
)
def test_source_id_fields(row: dict[str, Any], expected: str | None) -> None:
    assert source_id(row) == expected


def test_source_ids_from_jsonl_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "r0", "prompt": "a"},
        {"uuid": "r1", "conversations": [{"from": "human", "value": "b"}]},
        {"conversation_id": 2, "messages": [msg("robot", "x")]},  # skipped, id kept
        "{not json",
        {"prompt": "no id"},
    ])
    rows = list(iter_rows(str(path)))
    assert [r.source_id for r in rows] == ["r0", "r1", "2", None, None]
    assert rows[2].skipped


def test_id_field_names_the_one_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "ignored", "prompt_id": "p0", "prompt": "a"},
        {"id": "ignored", "prompt": "b"},
    ])
    assert [r.source_id for r in iter_rows(str(path), id_field="prompt_id")] == ["p0", None]
    with pytest.raises(DatasetError, match="--id-field is empty"):
        iter_rows(str(path), id_field=" ")


def test_source_ids_from_parquet(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a", "b"], "id": pa.array([10, None], pa.int64())}),
                   tmp_path / "d.parquet")
    assert [r.source_id for r in iter_rows(str(tmp_path / "d.parquet"))] == ["10", None]


# -- tool conversations and --regenerate all ------------------------------------------------

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def tool_row() -> dict[str, Any]:
    return {"tools": WEATHER_TOOLS, "tool_choice": "auto", "messages": [
        msg("system", "s"), msg("user", "weather?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "d1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "d1", "content": "sunny"},
        msg("assistant", "It is sunny."),
    ]}


def test_tool_row_last_turn_prompt_ends_with_the_tool_result() -> None:
    prompt = normalize(tool_row())
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool"]
    assert prompt[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert prompt[2]["content"] == ""
    assert prompt[3] == {"role": "tool", "content": "sunny", "tool_call_id": "d1"}
    assert row_tools(tool_row()) == {"tools": WEATHER_TOOLS, "tool_choice": "auto"}
    assert row_tools({"messages": []}) is None


def test_tool_rows_are_read_with_their_tools(tmp_path: Path) -> None:
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(tool_row()) + "\n" + json.dumps({"prompt": "plain"}) + "\n")
    rows = list(iter_rows(str(path)))
    assert not any(r.skipped for r in rows)
    assert rows[0].tools == {"tools": WEATHER_TOOLS, "tool_choice": "auto"}
    assert rows[1].tools is None
    # The tools are part of the content key, only for rows that have them.
    settings = {"model": "m"}
    assert content_key(rows[0].messages or [], settings, tools=rows[0].tools) != content_key(
        rows[0].messages or [], settings)


def test_regenerate_all_keeps_the_whole_conversation() -> None:
    whole = normalize(tool_row(), regenerate="all")
    assert [m["role"] for m in whole] == ["system", "user", "assistant", "tool", "assistant"]
    assert normalize({"messages": [msg("user", "q")]}, regenerate="all") == [msg("user", "q")]
    with pytest.raises(InvalidRow, match="an assistant turn comes before the first user turn"):
        normalize({"messages": [msg("assistant", "hi"), msg("user", "q")]}, regenerate="all")

"""Reading a source: local JSONL/JSON/Parquet files, a directory of them, or a
Hugging Face dataset; every row comes out as a :class:`~synthq.data.dataset.rows.Row`.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from synthq.data.dataset.rows import (
    ID_FIELDS,
    KEY_VERSION,
    MAX_ROW_CHARS,
    RAW_PREVIEW_CHARS,
    InvalidRow,
    Row,
    check_storable,
    escape_unstorable,
    is_mapping,
    normalize,
    row_tools,
)

PARQUET_BATCH_SIZE = 1024


MAX_LINE_BYTES = 16 << 20

MAX_ARRAY_BYTES = 64 << 20

_JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")

_PARQUET_SUFFIXES = (".parquet",)

_SUPPORTED_SUFFIXES = _JSONL_SUFFIXES + _PARQUET_SUFFIXES


_EXTENSION_RE = re.compile(r"\.[A-Za-z][A-Za-z0-9]*$")


class DatasetError(Exception):
    """The dataset source cannot be opened or read at all."""


def iter_rows(source: str, *, max_chars: int = MAX_ROW_CHARS, id_field: str | None = None,
              key_version: int = KEY_VERSION, regenerate: str = "last") -> Iterator[Row]:
    """Yield every row of ``source`` as a :class:`Row`, in order.

    ``source`` may be a JSON-lines file (``.jsonl``, ``.json``, optionally
    ``.gz``), a ``.parquet`` file, a directory of such files (read in sorted
    order, indices continuing), or a Hugging Face dataset id (``name`` or
    ``name:split``; needs the ``datasets`` package).  Problems with the source
    itself raise :class:`DatasetError` immediately, before iteration starts;
    problems with single rows become skipped rows.

    ``id_field`` names the field holding each row's own id; without it, the
    first of :data:`ID_FIELDS` that a row has. ``key_version`` selects the
    prompt rule (see :func:`normalize`).
    """
    if id_field is not None and not id_field.strip():
        raise DatasetError("--id-field is empty")
    fields = (id_field,) if id_field is not None else ID_FIELDS
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        files = _list_data_files(path)
        for file in files:
            _check_content(file)
        records = _iter_directory(path, files)
    elif path.exists():
        _check_supported(path)
        _check_content(path)
        records = _iter_file(path)
    elif looks_like_path(source):
        raise DatasetError(f"no such file: {source}")
    else:
        records = _iter_hf(source)
    return _rows_from_objects(records, max_chars, fields, key_version, regenerate)


# A parsed record: either an object to normalise or an early skip reason,
# together with the raw text to show if the row is skipped.
# The last element says where the row is (``line 3``, ``row 3``).
_Record = tuple[Any, str | None, str | None, str]

#: Bytes read from the start of a file to tell a dataset from something else.
SNIFF_BYTES = 4096


def _check_content(path: Path) -> None:
    """Refuse a file whose first bytes are not what its suffix promises.

    A binary file named ``.jsonl`` would otherwise become a job of hundreds of
    skipped rows.
    """
    try:
        with _open_binary(path) as handle:
            head = handle.read(SNIFF_BYTES)
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"cannot read {path}: {_os_reason(exc)}") from exc
    if _suffix(path) in _PARQUET_SUFFIXES:
        if head[:4] != b"PAR1":
            raise DatasetError(f"{path} is not a JSONL/JSON/Parquet file (no Parquet header)")
        return
    # Not final: a character cut at the 4 KiB mark is fine. A stray bad line is a
    # skipped row; a NUL byte, or a tenth of the text undecodable, is not a text file.
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(head, final=False)
    bad = sum(1 for c in text if c == "\ufffd" or c in _BINARY_CHARS)
    if "\0" in text or bad > len(text) / 10:
        raise DatasetError(f"{path} is not a JSONL/JSON/Parquet file (its first "
                           f"{SNIFF_BYTES // 1024} KiB are not text)")


#: Control characters that never occur in a JSON text file.
_BINARY_CHARS = frozenset(chr(c) for c in range(32) if chr(c) not in "\t\n\r\f")


def _os_reason(exc: BaseException) -> str:
    """``Permission denied`` rather than ``[Errno 13] Permission denied: '/x'``."""
    return getattr(exc, "strerror", None) or str(exc)


def source_id(obj: Any, fields: tuple[str, ...] = ID_FIELDS) -> str | None:
    """The row's own id as text: the first of ``fields`` it has, non-empty.

    Strings are kept as they are, numbers become their decimal text, anything
    else its compact JSON. None when the row has none of the fields.
    """
    if not is_mapping(obj):
        return None
    for name in fields:
        value = obj.get(name)
        if value is None or value == "" or isinstance(value, bool):
            continue
        if isinstance(value, str):
            return value
        if isinstance(value, int | float):
            return str(value)
        try:
            return json.dumps(value, sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(value)
    return None


def _rows_from_objects(records: Iterable[_Record], max_chars: int,
                       fields: tuple[str, ...] = ID_FIELDS,
                       key_version: int = KEY_VERSION, regenerate: str = "last") -> Iterator[Row]:
    """Number records and normalise them into :class:`Row` objects."""
    for index, (obj, skip_reason, raw, where) in enumerate(records):
        sid = source_id(obj, fields) if skip_reason is None else None
        if skip_reason is None:
            try:
                messages = normalize(obj, max_chars=max_chars, key_version=key_version,
                                     regenerate=regenerate)
                tools = row_tools(obj)
                check_storable(messages, "the conversation")
                check_storable(tools, "tools")
            except InvalidRow as exc:
                skip_reason = exc.reason
            else:
                yield Row(index=index, messages=messages, skip_reason=None, raw=None,
                          source_id=escape_unstorable(sid) if sid is not None else None,
                          where=where, tools=tools)
                continue
        if raw is None:
            raw = _preview(obj)
        yield Row(index=index, messages=None, skip_reason=skip_reason,
                  raw=escape_unstorable(raw[:RAW_PREVIEW_CHARS]),
                  source_id=escape_unstorable(sid) if sid is not None else None,
                  where=escape_unstorable(where))


def _preview(obj: Any) -> str:
    """JSON text of a non-JSONL row, for showing a skipped row to a user."""
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(obj)


def looks_like_path(source: str) -> bool:
    """True when ``source`` is clearly meant as a local path, not a dataset id."""
    if source.startswith((".", "/", "~", "\\")):
        return True
    name = source.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return bool(_EXTENSION_RE.search(name))


def _suffix(path: Path) -> str:
    """The lower-cased data suffix of ``path`` (``.jsonl.gz`` counts as one)."""
    name = path.name.lower()
    for suffix in sorted(_SUPPORTED_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower()


def _check_supported(path: Path) -> None:
    """Raise :class:`DatasetError` for a file type we cannot read."""
    if _suffix(path) not in _SUPPORTED_SUFFIXES:
        raise DatasetError(
            f"unsupported file type: {path} (expected .jsonl, .json, .jsonl.gz or .parquet)"
        )
    if _suffix(path) in _PARQUET_SUFFIXES and importlib.util.find_spec("pyarrow") is None:
        raise DatasetError(f"cannot read {path}: the 'pyarrow' package is not installed")


def _list_data_files(directory: Path) -> list[Path]:
    """All supported data files under ``directory``, sorted by relative path.

    Hidden files and directories (names starting with ``.``) are ignored.
    """
    found = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_file() and _suffix(path) in _SUPPORTED_SUFFIXES:
            found.append(path)
    if not found:
        raise DatasetError(
            f"no .jsonl, .json, .jsonl.gz or .parquet files in directory: {directory}"
        )
    found.sort(key=lambda p: p.relative_to(directory).as_posix())
    for path in found:
        _check_supported(path)
    return found


def unread_files(directory: Path) -> list[str]:
    """Files in ``directory`` (not hidden) that a dataset folder skips: not a data suffix."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and _suffix(p) not in _SUPPORTED_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def _iter_directory(directory: Path, files: list[Path]) -> Iterator[_Record]:
    """Records of every file in ``files``, one file after another."""
    for path in files:
        name = path.relative_to(directory).as_posix()
        for obj, skip_reason, raw, where in _iter_file(path):
            yield obj, skip_reason, raw, f"{name} {where}"


def _iter_file(path: Path) -> Iterator[_Record]:
    """Records of one supported data file."""
    if _suffix(path) in _PARQUET_SUFFIXES:
        yield from _iter_parquet(path)
    else:
        yield from _iter_jsonl(path)


def _open_binary(path: Path) -> BinaryIO:
    """Open ``path`` for binary reading, decompressing ``.gz`` files."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _iter_jsonl(path: Path) -> Iterator[_Record]:
    """Stream a JSON-lines file line by line, skipping blank lines.

    A ``.json`` file whose first character is ``[`` is read as one JSON array
    instead (that form cannot be streamed, so it is loaded whole).
    """
    try:
        with _open_binary(path) as handle:
            if _suffix(path) in (".json", ".json.gz") and _starts_with_array(handle):
                yield from _iter_json_array(handle)
                return
            for number, raw_line in enumerate(_bounded_lines(handle), 1):
                if isinstance(raw_line, _LongLine):
                    yield (None, f"line is over {MAX_LINE_BYTES >> 20} MiB",
                           raw_line.head.decode("utf-8", errors="replace"), f"line {number}")
                    continue
                if number == 1:
                    raw_line = raw_line.removeprefix(b"\xef\xbb\xbf")
                if not raw_line.strip():
                    continue
                yield (*_parse_line(raw_line), f"line {number}")
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _LongLine:
    """A line over :data:`MAX_LINE_BYTES`: only its start is kept."""

    head: bytes


def _bounded_lines(handle: BinaryIO) -> Iterator[bytes | _LongLine]:
    """The file's lines; one over :data:`MAX_LINE_BYTES` is read through, never held whole.

    A 300 MB single line (or a gzip that inflates to one) would otherwise take
    several times its size in memory to split, decode and parse.
    """
    while line := handle.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        head = line[:RAW_PREVIEW_CHARS]
        del line
        while (rest := handle.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield _LongLine(head)


def _starts_with_array(handle: BinaryIO) -> bool:
    """Peek whether a binary stream's first non-blank byte is ``[``; rewinds."""
    head = handle.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    handle.seek(0)
    return head.startswith(b"[")


def _iter_json_array(handle: BinaryIO) -> Iterator[_Record]:
    """Records of a file holding a single JSON array of row objects."""
    data = handle.read(MAX_ARRAY_BYTES + 1)
    if len(data) > MAX_ARRAY_BYTES:
        raise DatasetError(f"a JSON array file over {MAX_ARRAY_BYTES >> 20} MiB cannot be read "
                           "(it is loaded whole); write it as JSON lines, one row a line")
    text = data.decode("utf-8-sig", errors="replace")
    del data
    try:
        items = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DatasetError(f"not valid JSON: {exc}") from exc
    for number, item in enumerate(items, 1):
        if isinstance(item, dict):
            yield item, None, None, f"item {number}"
        else:
            yield None, "row is not a JSON object", _preview(item), f"item {number}"


def _parse_line(raw_line: bytes) -> tuple[Any, str | None, str | None]:
    """Decode and parse one non-blank JSONL line into a record."""
    try:
        line = raw_line.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "not valid UTF-8", raw_line.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(line)
    except ValueError as exc:
        return None, f"not valid JSON: {exc}", line
    except RecursionError:
        return None, "not valid JSON: nested too deeply", line
    if not isinstance(obj, dict):
        return None, "row is not a JSON object", line
    return obj, None, line


def _iter_parquet(path: Path) -> Iterator[_Record]:
    """Stream a Parquet file in record batches, one dict per row."""
    import pyarrow as pa  # imported lazily: only Parquet sources need it
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        number = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_SIZE):
            for obj in batch.to_pylist():
                number += 1
                yield obj, None, None, f"row {number}"
    except (OSError, pa.ArrowException) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc


def _split_hf_id(source: str) -> tuple[str, str]:
    """Split ``name[:split]`` into the dataset name and split (default ``train``)."""
    name, sep, split = source.rpartition(":")
    if not sep or not name or not split:
        return source.rstrip(":"), "train"
    return name, split


#: Seconds the Hugging Face Hub has to answer before a dataset id is given up on.
HUB_TIMEOUT_S = 5.0


def _check_hub_reachable(source: str, name: str) -> None:
    """Fail in seconds, not after the Hub client's ~30 s of retries, when the Hub does not
    answer; and say that no local file of that name was found (often the real mistake).

    Only a transport failure stops here: any HTTP answer (even 401 or 404 for a private
    dataset) goes on to ``datasets``, which has the token and its own messages. Offline
    mode (HF_HUB_OFFLINE=1) reads the local cache and is not checked.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or \
            os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes"):
        return
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        httpx.head(f"{endpoint}/api/datasets/{name}", timeout=HUB_TIMEOUT_S)
    except httpx.HTTPError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DatasetError(
            f"no local file or folder named {source!r}, and the Hugging Face Hub "
            f"({endpoint}) did not answer within {HUB_TIMEOUT_S:g} s to load it as a dataset "
            f"id: {reason}; check the path, or the network (HF_HUB_OFFLINE=1 uses the "
            "local cache)") from None


def _iter_hf(source: str) -> Iterator[_Record]:
    """Open a Hugging Face dataset (eagerly) and return an iterator of records."""
    if importlib.util.find_spec("datasets") is None:
        raise DatasetError(
            f"no such file or directory: {source!r}; it cannot be loaded as a Hugging Face "
            "dataset id either, because the 'datasets' package is not installed "
            "(pip install datasets)"
        )
    name, split = _split_hf_id(source)
    _check_hub_reachable(source, name)
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure is a source error
        raise DatasetError(
            f"cannot load Hugging Face dataset {name!r} (split {split!r}): {exc}"
        ) from exc
    return ((dict(obj), None, None, f"row {n}") for n, obj in enumerate(dataset, 1))


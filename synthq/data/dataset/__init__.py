"""Reading dataset rows and normalising them into chat prompts.

A *source* is a local ``.jsonl`` / ``.json`` (JSON lines, optionally
gzip-compressed) or ``.parquet`` file, a directory of such files, or a
Hugging Face dataset id (``name`` or ``name:split``).  Every row becomes a
:class:`Row`: either a prompt in OpenAI chat form, or a skipped row carrying a
short human-readable reason and a preview of the raw text.

Three row forms are understood (see :func:`normalize`):

* OpenAI ``messages``: ``[{"role": ..., "content": ...}, ...]``
* ShareGPT ``conversations`` (or ``conversation``):
  ``[{"from": ..., "value": ...}, ...]``
* a plain ``prompt`` string, with an optional ``system`` string.

The prompt is the conversation up to and including its last user turn: the
last turn the model must answer. Assistant turns after it are dropped (they are
what the inference server regenerates); a row that ends in a user turn is sent
whole. A tool result is also a turn the model must answer: a prompt may end
with a ``tool`` message.

Tool conversations come in OpenAI form: the row's ``tools`` (and optional
``tool_choice``), assistant messages with ``tool_calls``, and ``tool``
messages with ``tool_call_id``; they are kept on :attr:`Row.tools` and in the
messages. With ``regenerate="all"`` the whole conversation is kept (every
assistant turn is regenerated on the regenerated history, see
:mod:`synthq.data.turns`).

That rule is *key version* 2 (:data:`KEY_VERSION`). Jobs created before it,
key version 1, cut the prompt before the last assistant turn instead, which
dropped a trailing user question; they keep that rule, so that enqueueing the
same data into such a job again adds nothing rather than a second copy of
every multi-turn row (see :func:`normalize` and :func:`content_key`).

A row's own id (its ``id``, ``uuid``, ``conversation_id`` or ``sample_id``
field, or the one field the user names) is kept as :attr:`Row.source_id`, so
generated data can be joined back to its source.
"""

from synthq.data.dataset.keys import ContentKeys, content_key, raw_key
from synthq.data.dataset.read import DatasetError, iter_rows, source_id, unread_files
from synthq.data.dataset.rows import (
    ID_FIELDS,
    KEY_VERSION,
    MAX_ROW_CHARS,
    RAW_PREVIEW_CHARS,
    REGENERATE_MODES,
    InvalidRow,
    Row,
    escape_unstorable,
    normalize,
    row_tools,
)

__all__ = [
    "ID_FIELDS",
    "KEY_VERSION",
    "MAX_ROW_CHARS",
    "RAW_PREVIEW_CHARS",
    "DatasetError",
    "InvalidRow",
    "Row",
    "content_key",
    "ContentKeys",
    "iter_rows",
    "normalize",
    "raw_key",
    "REGENERATE_MODES",
    "row_tools",
    "source_id",
    "escape_unstorable",
    "unread_files",
]

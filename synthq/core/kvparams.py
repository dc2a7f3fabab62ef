"""What a request to the engine and its KV connector agree on; imports nothing.

synthq names a request's hidden-states file in ``kv_transfer_params[NAME_KEY]``, and the
connector (``synthq_connector``, loaded by vLLM from this repository) writes the file under
that name. A capture stage's call (synthq.capture.stage) sends it, and so does a
generation call of a ``--capture inline`` job (synthq.serving.call), which also sets
:data:`OUTPUT_KEY`: vLLM's hidden-states connector then saves the generated tokens' states
too (all but the last token's: it was never an input). Here at the lowest floor, so that
both read the keys from one place; :mod:`synthq.capture.protocol` names them for the
connector.
"""

from __future__ import annotations

__all__ = ["NAME_KEY", "REFUSED_KEY", "OUTPUT_KEY", "PATH_KEY"]

#: The ``kv_transfer_params`` key with which synthq names a request's file.
NAME_KEY = "synthq_name"

#: The answer's ``kv_transfer_params`` key with which the connector says why a request got
#: no file (its name was another request's in flight); the answer then has no
#: ``hidden_states_path``.
REFUSED_KEY = "synthq_refused"

#: vLLM's ``kv_transfer_params`` key (0.32's ExampleHiddenStatesConnector): true saves the
#: prompt's and the generated tokens' hidden states, all but the last generated token's.
OUTPUT_KEY = "include_output_tokens"

#: The answer's ``kv_transfer_params`` key naming the file the connector writes.
PATH_KEY = "hidden_states_path"

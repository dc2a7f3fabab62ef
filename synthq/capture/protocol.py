"""What a capture request and the engine's connector agree on; imports nothing.

synthq's capture stage (synthq.capture.stage) names each request's file in
``kv_transfer_params[NAME_KEY]``, and the connector (``synthq_connector``, loaded by
vLLM from this repository) writes the file under that name. Both read the key here.
"""

from __future__ import annotations

__all__ = ["NAME_KEY", "REFUSED_KEY"]

#: The ``kv_transfer_params`` key with which synthq names a request's file.
NAME_KEY = "synthq_name"

#: The answer's ``kv_transfer_params`` key with which the connector says why a request got
#: no file (its name was another request's in flight); the answer then has no
#: ``hidden_states_path``.
REFUSED_KEY = "synthq_refused"

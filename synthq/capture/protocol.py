"""What a capture request and the engine's connector agree on; imports nothing of synthq
but its lowest floor (synthq.core.kvparams, itself stdlib only).

synthq's capture stage (synthq.capture.stage) names each request's file in
``kv_transfer_params[NAME_KEY]``, and the connector (``synthq_connector``, loaded by
vLLM from this repository) writes the file under that name. Both read the key here; a
``--capture inline`` generation call (synthq.serving.call, a lower floor) reads it from
synthq.core.kvparams, where it is written once.
"""

from __future__ import annotations

from synthq.core.kvparams import NAME_KEY, OUTPUT_KEY, PATH_KEY, REFUSED_KEY

__all__ = ["NAME_KEY", "REFUSED_KEY", "OUTPUT_KEY", "PATH_KEY"]

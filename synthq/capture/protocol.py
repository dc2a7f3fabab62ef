"""What a capture request and the engine's connector agree on; imports nothing of synthq
but its lowest floor (synthq.core.kvparams, itself stdlib only).

synthq's capture stage (synthq.capture.stage) names each request's file in
``kv_transfer_params[NAME_KEY]``, and the connector (``synthq_connector``, loaded by
vLLM from this repository) writes the file under that name. Both read the key here; a
``--capture inline`` generation call (synthq.serving.call, a lower floor) reads it from
synthq.core.kvparams, where it is written once.

The connector also writes, in each file's safetensors metadata under :data:`LAYERS_KEY`,
the layer ids its engine captures (``eagle_aux_hidden_state_layer_ids``): the file's
``hidden_states`` [tokens, layers, hidden] only counts its layers, so an engine started
with ``[1, 3, 5, 8]`` for a job of ``[2, 4, 5, 8]`` would pass a count check and the
drafter would train on the wrong layers (synthq.capture.ingest compares them).
"""

from __future__ import annotations

from synthq.core.kvparams import NAME_KEY, OUTPUT_KEY, PATH_KEY, REFUSED_KEY

__all__ = ["NAME_KEY", "REFUSED_KEY", "OUTPUT_KEY", "PATH_KEY", "LAYERS_KEY"]

#: The file's metadata key with the layer ids the engine captured, in the order of
#: ``hidden_states``' second axis: decimal ids joined by commas (``2,4,5,8``), the
#: ``output_hidden_states`` indices vLLM's ``eagle_aux_hidden_state_layer_ids`` takes. A
#: file without it (vLLM's stock connector) is checked by its layer count only.
LAYERS_KEY = "layer_ids"

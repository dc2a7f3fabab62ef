"""Hidden-state capture: the drafter's features taken from the serving engine.

For a target that only a serving engine can run (the seed's 1T-parameter MoE),
the features EAGLE-3 trains on come from that engine: a vLLM started with the
``extract_hidden_states`` method and synthq's connector (``synthq_connector``)
writes one file per request. This package makes that a stage of the ledger:

* ``states``: one ``captures`` row per done sample, every transition a
  compare-and-set (pending → running → done / failed, the sweep's expire);
* ``stage``: claims due captures within each capture server's exact in-flight
  limit, sends each sample's own ``input_ids`` as the prompt (``max_tokens: 1``),
  and records the outcome;
* ``ingest``: checks the engine's file (token ids equal the sample's
  ``input_ids``, shape, checksum) and moves it into the store;
* ``store``: content-addressed files, written whole (tmp, fsync, rename);
* ``plan``: the disk the stage will need, before it starts.

See docs/capture.md (the docs site's "Hidden states from the engine").
"""

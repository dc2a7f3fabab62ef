"""EAGLE-3 drafter training: readiness, runs, and the training itself.

Importing this package (and :mod:`.states`, :mod:`.config`, :mod:`.readiness`,
:mod:`.runs`) never imports torch: the API, the CLI and the beat tick use them.
torch is imported by :mod:`.model`, :mod:`.data`, :mod:`.loop`,
:mod:`.checkpoint` and :mod:`.speculate`, which only a training worker loads.

::

    readiness (beat) ──▶ training_runs row (pending) ──▶ train queue
    synthq train ──────┘                                      │
                                                              ▼
    export (synthq.export) → draft vocab → target hidden states (online or cached)
      → EAGLE-3 drafter, training-time test → checkpoints → vLLM llama_eagle3 layout
"""

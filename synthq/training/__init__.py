"""Drafter training (EAGLE-3, or DFlash with ``drafter="dflash"``): readiness, runs, and
the training itself.

Importing this package (and :mod:`.config`, :mod:`.readiness`, :mod:`.runs`) never
imports torch: the API, the CLI and the beat tick use them. torch is imported by
:mod:`.model`, :mod:`.loss`, :mod:`.dflash`, :mod:`.dflash_loss`, :mod:`.drafters`,
:mod:`.data`, :mod:`.loop`, :mod:`.lifecycle`, :mod:`.checkpoint` and :mod:`.speculate`,
which only a training worker loads.

::

    readiness (beat) ──▶ training_runs row (pending) ──▶ train queue
    synthq train ──────┘                                      │
                                                              ▼
    export (synthq.jobs.export) → draft vocab → target hidden states (online or cached)
      → EAGLE-3 drafter, training-time test → checkpoints → vLLM llama_eagle3 layout
      → or a DFlash drafter, blocks at random anchors → vLLM qwen3_dflash layout
"""

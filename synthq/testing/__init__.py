"""Test and demo tools shipped with synthq (not used by the runtime).

:mod:`synthq.testing.simulator` is the OpenAI-compatible server that tests,
benchmarks and the demo run against (``synthq simulate``).
"""

"""synthq: a durable job queue that turns prompts into EAGLE-3 drafter training data."""

__version__ = "0.1.0"

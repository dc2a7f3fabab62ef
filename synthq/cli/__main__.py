"""``python -m synthq.cli``."""

from synthq.cli import main

main()

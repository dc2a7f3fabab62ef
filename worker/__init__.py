"""Celery app and thin tasks; the logic lives in :mod:`synthq`."""

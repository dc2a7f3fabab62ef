"""Calling the inference servers: the request, its outcome, the event loop, limits, health."""

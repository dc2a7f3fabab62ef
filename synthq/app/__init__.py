"""The service's operations: the scheduler tick, embedded mode, and what the CLI and API share."""

"""The settings: the service's (config) and a job's, declared once (jobspec)."""

"""Read models: what the CLI, the API and the job page show of a job."""

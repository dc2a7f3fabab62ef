"""The API's routers: jobs, samples, exports, system (health, metrics, docs), ui."""

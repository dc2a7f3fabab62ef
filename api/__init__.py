"""The REST API (FastAPI): thin routes over :mod:`synthq`. Its own issue builds it."""

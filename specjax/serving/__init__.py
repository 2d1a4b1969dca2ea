"""Serving: the online scheduler (continuous batching for every method) and the HTTP server."""

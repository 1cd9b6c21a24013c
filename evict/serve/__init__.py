"""Serving: the continuous-batching engine, the OpenAI-compatible HTTP server, `evict serve`."""

"""Serving: a request-level generation engine with a prefix cache, and an OpenAI-compatible HTTP API."""

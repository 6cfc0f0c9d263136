"""The HTTP front: OpenAI-compatible API, worker registry, request dispatch, metrics."""

"""The prefill worker: chunked prefill, KV shipping to decode workers, first token."""

"""The decode worker (KV from prefill workers) and the colocated worker (prefill and decode in one)."""

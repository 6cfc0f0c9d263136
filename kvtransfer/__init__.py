"""Moving paged KV blocks between processes."""

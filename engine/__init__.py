"""The model runtime every worker shares: config, loader, model, paged KV cache, sampler, tokenizer."""

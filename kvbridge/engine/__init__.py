"""The reference engine: paged KV cache, prefix caching, continuous batching, a Llama-style model."""

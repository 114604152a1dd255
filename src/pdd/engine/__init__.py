"""One inference engine: paged KV, prefix cache, continuous batching, extend, KV export/import."""

"""Serving: the engine (models, sampling, KV cache, speculative loop) and the CLIs on it."""

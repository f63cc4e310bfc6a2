"""Continuous batching over the paged KV cache: the engine, its scheduler, device programs, request records,
prefix cache, settings, warm-up and compiled-program caches. Imports only rlkjax.core (tests/test_layers.py)."""

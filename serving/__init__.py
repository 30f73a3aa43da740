"""Serving: the speculative engine and everything built on it, in layers that import only downwards.

    serving/engine/       models, sampling, KV cache, the speculative step, SpeculativeEngine, drafters
    serving/distributed/  the gRPC target service and the draft node's client (engine below it)
    serving/server/       serve: the OpenAI-compatible HTTP server, scheduler, metrics
    serving/fleet/        deployment profiles and the simulator behind simulate
    serving/tools/        spec-generate, spec-bench, the load test, stop tuning

Shared by every layer (and by ``training`` and ``routing``): ``serving.config`` (settings
loading), ``serving.cli`` (the commands' CLI helper) and ``serving.prompts`` (prompt data).
``tests/test_layers.py`` checks the direction of the imports.
"""

"""The engine layer: models, sampling, the static KV cache, the speculative step and
``SpeculativeEngine`` with its drafters. It imports nothing from the layers above it
(``serving.server``, ``serving.distributed``, ``serving.fleet``, ``serving.tools``) nor from
``training`` or ``routing``.

    from serving.engine import SpeculativeEngine, EngineConfig, Request
    engine = SpeculativeEngine(target, tokenizer, draft, EngineConfig(max_batch_size=4, k=4))
    [out] = engine.generate([Request(tokenizer.encode("def add(a, b):"), max_new_tokens=32)])

The names below are imported on first use (from ``serving.engine.core``), so importing a light
module of this package (``serving.engine.engine_settings``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Completion", "EngineConfig", "Request", "SpeculativeEngine", "StepOutput"]

if TYPE_CHECKING:
    from serving.engine.core import Completion, EngineConfig, Request, SpeculativeEngine, StepOutput


def __getattr__(name: str) -> Any:
    if name in __all__:
        from serving.engine import core

        return getattr(core, name)
    raise AttributeError(f"module 'serving.engine' has no attribute {name!r}")

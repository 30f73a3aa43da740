"""The engine layer: models, sampling, the static KV cache, the speculative step and
``SpeculativeEngine`` with its drafters. It imports nothing from the layers above it
(``serving.server``, ``serving.distributed``, ``serving.fleet``, ``serving.tools``) nor from
``training`` or ``routing``.

    from serving.engine import SpeculativeEngine, EngineConfig, Request
    engine = SpeculativeEngine(target, tokenizer, draft, EngineConfig(max_batch_size=4, k=4))
    [out] = engine.generate([Request(tokenizer.encode("def add(a, b):"), max_new_tokens=32)])

The names below are imported on first use (from ``serving.engine.core`` and
``serving.engine.verifier``), so importing a light module of this package
(``serving.engine.engine_settings``) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SpeculativeEngine": "core", "EngineConfig": "core", "Request": "core", "Completion": "core", "StepOutput": "core",
    "RequestFailed": "core", "Fallback": "core", "Verifier": "verifier", "LocalVerifier": "verifier", "VerifierError": "verifier",
}  # fmt: skip
__all__ = ["Completion", "EngineConfig", "Fallback", "LocalVerifier", "Request", "RequestFailed", "SpeculativeEngine", "StepOutput",
           "Verifier", "VerifierError"]  # fmt: skip

if TYPE_CHECKING:
    from serving.engine.core import Completion, EngineConfig, Fallback, Request, RequestFailed, SpeculativeEngine, StepOutput
    from serving.engine.verifier import LocalVerifier, Verifier, VerifierError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"serving.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'serving.engine' has no attribute {name!r}")

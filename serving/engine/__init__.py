"""The engine layer: models, sampling, the static KV cache, the speculative step and
``SpeculativeEngine`` with its drafters. It imports nothing from the layers above it
(``serving.server``, ``serving.distributed``, ``serving.fleet``, ``serving.tools``) nor from
``training`` or ``routing``.

    from serving.engine import EngineSettings, Request, load_engine
    loaded = load_engine(EngineSettings(max_batch_size=4, k=4), "qwen2.5-coder-1.5b-instruct", {"draft": "qwen2.5-coder-0.5b-instruct"})
    [out] = loaded.engine.generate([Request(loaded.tokenizer.encode("def add(a, b):"), max_new_tokens=32)])

The names below are imported on first use, so importing a light module of this package
(``serving.engine.engine_settings``) does not import torch. Inside the package, modules import
from the module that defines a name, never from this one.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SpeculativeEngine": "core", "EngineConfig": "engine_settings", "EngineSettings": "engine_settings",
    "Request": "request", "Completion": "request", "StepOutput": "request", "RequestFailed": "request", "Fallback": "request",
    "Verifier": "verifier", "LocalVerifier": "verifier", "VerifierError": "verifier",
    "load_engine": "loader", "build_engine": "loader",
}  # fmt: skip
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from serving.engine.core import SpeculativeEngine
    from serving.engine.engine_settings import EngineConfig, EngineSettings
    from serving.engine.loader import build_engine, load_engine
    from serving.engine.request import Completion, Fallback, Request, RequestFailed, StepOutput
    from serving.engine.verifier import LocalVerifier, Verifier, VerifierError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"serving.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'serving.engine' has no attribute {name!r}")

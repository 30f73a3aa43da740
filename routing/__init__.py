"""Routing: learn which draft the target accepts most for each prompt.

    from routing import Router, Choice
    router = Router.load("runs/router/router.pt")
    router.choose("def add(a, b):")  # -> Choice(draft, predicted_acceptance, predicted_speedup, k)

``Router`` and ``Choice`` are imported on first use, so ``import routing`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Choice", "Router", "RouterError"]

if TYPE_CHECKING:
    from routing.router import Choice, Router
    from routing.router_file import RouterError

_HOME = {"Choice": "routing.router", "Router": "routing.router", "RouterError": "routing.router_file"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'routing' has no attribute {name!r}")

"""The built-in drafters by reference: what a drafter reference that is not a model names.

    engine.drafters: {code: qwen2.5-coder-0.5b-instruct, lookup: ngram, suffix: suffix}

A reference here is built by its factory from the engine's settings (``engine.ngram.*``,
``engine.suffix.*``, ``engine.prediction.*``); any other reference is a model and becomes a
``ModelDrafter``. A new drafter kind is a module in this folder and one ``register`` call here
(plus a settings block in ``EngineSettings`` if it has options).
"""

from __future__ import annotations

from collections.abc import Callable

from serving.engine.drafters.auto import AutoDrafter
from serving.engine.drafters.base import PREDICTION, Drafter
from serving.engine.drafters.grammar import GrammarDrafter
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.drafters.prediction import PredictionDrafter
from serving.engine.drafters.suffix import SuffixDrafter

# reference -> a factory taking the engine's settings (serving.engine.engine_settings.EngineSettings,
# not imported: that module imports this one).
BUILT_IN: dict[str, Callable[..., Drafter]] = {}


def register(ref: str, factory: Callable[..., Drafter]) -> None:
    """Make ``ref`` a built-in drafter reference: ``factory(settings)`` builds a new one."""
    BUILT_IN[ref] = factory


AUTO = "auto"  # the per-step choice among the engine's other drafters


GRAMMAR = "grammar"  # drafts what a request's grammar forces, nothing else


def host_refs() -> tuple[str, ...]:
    """The model-free drafters that draft any request, as routing pools them (``prediction`` is
    chosen by the request's prediction field, not by name; ``auto`` drafts with the others;
    ``grammar`` drafts only requests with a grammar)."""
    return tuple(r for r in BUILT_IN if r not in (PREDICTION, AUTO, GRAMMAR))


def named_refs() -> tuple[str, ...]:
    """Every built-in reference a user may name as a drafter: the model-free ones and ``auto``."""
    return tuple(r for r in BUILT_IN if r != PREDICTION)


def build(ref: str, settings) -> Drafter:
    """A new drafter for built-in reference ``ref``."""
    if ref not in BUILT_IN:
        raise ValueError(f"{ref!r} is not a built-in drafter: use one of {', '.join(named_refs())} or a model reference")
    return BUILT_IN[ref](settings)


register("ngram", lambda s: NgramDrafter(k=s.ngram.k, min_n=s.ngram.min_n, max_n=s.ngram.max_n))
register("suffix", lambda s: SuffixDrafter(k=s.suffix.k, max_depth=s.suffix.max_tree_depth,
                                           max_cached_requests=s.suffix.max_cached_requests,
                                           max_spec_factor=s.suffix.max_spec_factor, min_token_prob=s.suffix.min_token_prob))  # fmt: skip
register(GRAMMAR, lambda s: GrammarDrafter())
register(PREDICTION, lambda s: PredictionDrafter(k=s.prediction.k, min_n=s.prediction.min_n, max_n=s.prediction.max_n,
                                                 confident_n=s.prediction.confident_n))  # fmt: skip
register(AUTO, lambda s: AutoDrafter(s.auto.drafters, k=s.auto.k, prior_a=s.auto.prior_a, default_prior=s.auto.default_prior,
                                     prior_weight=s.auto.prior_weight, catch_up_weight=s.auto.catch_up_weight))  # fmt: skip

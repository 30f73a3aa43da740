"""The one assembly line of an engine: load the models of a settings object, prepare Choral's CPU
kernels for the engine's step widths, build the engine.

    loaded = load_engine(settings, "qwen2.5-coder-1.5b-instruct", {"base": "qwen2.5-coder-0.5b-instruct", "ngram": "ngram"})
    engine = build_engine(settings, tokenizer, target_model, {"draft": draft_model}, max_len=512)

``load_engine`` takes model references and loads them; ``build_engine`` takes what is already
loaded (train-draft's evaluation runs the models training holds, a benchmark sweeps K over one
loaded pair). Both make the engine's ``EngineConfig`` from the settings, so every command runs the
same engine for the same settings; nothing else constructs ``SpeculativeEngine``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.engine.core import SpeculativeEngine
from serving.engine.cpu_kernels import use_cpu_kernels
from serving.engine.devices import resolve_device
from serving.engine.drafters.base import NONE, PREDICTION, Drafter
from serving.engine.drafters.eagle3 import Eagle3Drafter
from serving.engine.drafters.registry import BUILT_IN
from serving.engine.eagle3 import Eagle3Head, is_eagle3_folder
from serving.engine.engine_settings import EngineSettings, is_model_ref
from serving.engine.models import check_same_tokenizer, load_model, load_tokenizer
from serving.engine.verifier import Verifier


@dataclass
class LoadedEngine:
    tokenizer: PreTrainedTokenizerBase
    target: PreTrainedModel | None  # None when the engine verifies on a remote target
    drafts: dict[str, PreTrainedModel]  # drafter name -> its draft model (model drafters only)
    engine: SpeculativeEngine
    cpu_kernels: bool  # whether Choral's CPU kernels were installed


def load_engine(
    settings: EngineSettings,
    target: str,
    drafters: Mapping[str, str | None],
    *,
    default: str | None = None,
    verifier: Verifier | None = None,
) -> LoadedEngine:
    """One engine with every drafter of ``drafters`` (name -> a model reference, ``ngram``,
    ``suffix``, or ``none``/None for the target alone), one target, one KV cache and one batch.
    Each model reference loads once (two names may share it) and is prepared for the engine's step
    widths. ``default``: the drafter of requests that name none (default: the first). With a
    ``verifier`` (the target side when it is not a model of this process: a
    ``serving.distributed.remote.RemoteVerifier`` in the server's draft role) no target loads here."""
    device = resolve_device(settings.device)
    settings = settings.resolved(target, device)
    if verifier is None:
        print(settings.precision_line(target, device), file=sys.stderr, flush=True)
    else:  # the target runs in its own service, at the precision that service prints
        print(f"target {target}: verified by a remote target service; drafts {settings.draft_weights}; greedy output "
              "is identical to that service's target decoding alone", file=sys.stderr, flush=True)  # fmt: skip
    drafting = any(ref is not None and ref != NONE for ref in drafters.values())
    widths = step_widths(settings, drafting, device)
    refs = [r for r in drafters.values() if is_model_ref(r)]
    heads = list(dict.fromkeys(r for r in refs if is_eagle3_folder(r)))  # EAGLE-3 heads: they need the target
    if heads and verifier is not None:
        raise ValueError(f"drafter {heads[0]!r} is an EAGLE-3 head, which reads the target's features; a draft node's "
                         "remote target does not send them: serve eagle3 heads where the target runs (role all)")  # fmt: skip
    tokenizer, target_model, by_ref = load_models(
        settings, target, [r for r in refs if r not in heads], load_target=verifier is None,
        each_draft=lambda draft: prepare_kernels(settings, [], [draft], widths),
    )  # fmt: skip
    kernels = prepare_kernels(settings, [target_model] if target_model is not None else [], [], widths)
    for ref in heads:
        by_ref[ref] = load_eagle3(ref, target_model, settings, kernels)
    loaded = {name: by_ref[ref] if is_model_ref(ref) else ref for name, ref in drafters.items()}
    engine = build_engine(settings, tokenizer, verifier or target_model, loaded, default=default, device=device)
    drafts = {name: by_ref[ref] for name, ref in drafters.items() if is_model_ref(ref) and ref not in heads}
    return LoadedEngine(tokenizer, target_model, drafts, engine, kernels)


def load_eagle3(folder: str, target: PreTrainedModel, settings: EngineSettings, kernels: bool) -> Eagle3Drafter:
    """The ``eagle3`` drafter of an EAGLE-3 head folder (speculators format) for ``target``: the
    target's embeddings where the folder has none, on Choral's CPU kernels at the drafts' precision
    where the target runs on them."""
    head = Eagle3Head.from_folder(folder, embed=target.get_input_embeddings().weight.detach())
    c, t = head.config, target.config
    if c.target_hidden_size != t.hidden_size or c.vocab_size > t.vocab_size or max(c.aux_layers) >= t.num_hidden_layers:
        raise ValueError(f"{folder} is an EAGLE-3 head for a target of width {c.target_hidden_size}, {c.vocab_size} tokens "
                         f"and layers {list(c.aux_layers)} (verifier {c.verifier!r}); this target has width {t.hidden_size}, "
                         f"{t.vocab_size} tokens and {t.num_hidden_layers} layers: use a head trained for it")  # fmt: skip
    head = head.to(next(target.parameters()).device)
    if kernels:
        head.use_kernels(settings.drafts_weights(head.embed_tokens.weight.device))
    return Eagle3Drafter(head)


def build_engine(
    settings: EngineSettings,
    tokenizer: PreTrainedTokenizerBase,
    target: PreTrainedModel | Verifier,
    drafters: Mapping[str, PreTrainedModel | Drafter | str | None] | None = None,
    *,
    default: str | None = None,
    device: torch.device | None = None,
    **changes,
) -> SpeculativeEngine:
    """The engine of ``settings`` over models already loaded (and prepared: ``prepare_kernels``).
    ``target``: the target model, or a ``Verifier``. ``drafters``: name -> a draft model, a
    ``Drafter``, a built-in reference (``ngram``, ``suffix``: built from the settings) or
    ``none``/None; an engine with none of them is the target alone. Every drafting engine also
    holds the ``prediction`` drafter, as configured. ``changes``: settings for this engine only
    (``max_len=...``, ``k=2`` in a K sweep)."""
    drafters = dict(drafters or {})
    drafting = any(d is not None and not (isinstance(d, str) and d == NONE) for d in drafters.values())
    if device is None and isinstance(target, torch.nn.Module):
        device = next(target.parameters()).device
    config = settings.engine_config(draft=drafting, device=device, **changes)
    built = {}
    for name, d in drafters.items():
        if isinstance(d, str) and d != NONE and d not in BUILT_IN:
            raise ValueError(f"drafter {name!r}: {d!r} is a model reference; load it first (load_engine loads references)")
        built[name] = settings.host_drafter(d) if isinstance(d, str) and d != NONE else None if d == NONE else d
    if drafting and PREDICTION not in built:  # the engine's drafter of requests with a prediction, as configured
        built[PREDICTION] = settings.host_drafter(PREDICTION)
    return SpeculativeEngine(target, tokenizer, config=config, drafters=built, default_drafter=default)


def step_widths(settings: EngineSettings, drafting: bool, device: torch.device | None = None) -> tuple[int, ...]:
    """Every input width the engine of ``settings`` runs a decode forward at: what the CPU kernels
    are prepared for. A host drafter's (or a prediction's) short proposal rounds up to a K bucket."""
    config = settings.engine_config(draft=drafting, device=device)
    if not drafting:
        return (1,)
    return tuple(sorted({*config.step_widths, *(k + 1 for k in config.k_buckets if k <= config.k_max)}))


def load_models(
    settings: EngineSettings,
    target: str,
    drafts: Iterable[str] = (),
    *,
    load_target: bool = True,
    each_draft: Callable[[PreTrainedModel], object] | None = None,
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel | None, dict[str, PreTrainedModel]]:
    """The target's tokenizer, the target (unless ``load_target`` is false: a remote target) and
    each distinct draft reference, loaded once on the settings' device, dtype and quantization;
    a draft whose tokenizer differs from the target's is refused before it loads.
    ``each_draft`` runs on every draft as soon as it has loaded, before the next one loads: an
    int8 conversion there keeps one fp32 draft in memory at a time, not all of them."""
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    device = resolve_device(settings.device)
    tokenizer = load_tokenizer(target)
    refs = list(dict.fromkeys(drafts))
    for ref in refs:
        check_same_tokenizer(tokenizer, load_tokenizer(ref), draft_name=f"draft {ref!r}")
    load = lambda ref: load_model(ref, dtype=settings.dtype, device=device, quantize=settings.quantize)  # noqa: E731
    target_model = load(target) if load_target else None
    models = {}
    for ref in refs:
        models[ref] = load(ref)
        if each_draft is not None:
            each_draft(models[ref])
    return tokenizer, target_model, models


def prepare_kernels(
    settings: EngineSettings,
    targets: Iterable[PreTrainedModel],
    drafts: Iterable[PreTrainedModel],
    widths: Iterable[int],
    *,
    device: torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    own_draft_tensors: bool = True,
) -> bool:
    """Install Choral's CPU kernels for every step width in ``widths`` where the settings ask for
    them and they apply (CPU, fp32, no quantize), drafts in ``draft_weights``; returns whether
    they were installed. Models are changed in place: prepare each once, for all its widths.
    ``device`` and ``dtype``: where the models are, when they were not loaded by these settings
    (train-draft's evaluation runs the models training holds; it also passes
    ``own_draft_tensors=False``, see ``serving.engine.cpu_kernels.prepare_for_cpu``)."""
    if not settings.uses_cpu_kernels:
        return False
    # auto, unresolved here, is fp32: models handed over already loaded keep their weights
    # (load_engine resolves auto for a target it loads by name first: EngineSettings.resolved).
    target_weights = "fp32" if settings.target_weights == "auto" else settings.target_weights
    return use_cpu_kernels(
        list(targets), drafts=list(drafts), draft_weights=settings.draft_weights, target_weights=target_weights,
        device=device if device is not None else resolve_device(settings.device),
        dtype=dtype if dtype is not None else settings.dtype, widths=tuple(sorted(set(widths))), quantize=settings.quantize,
        own_draft_tensors=own_draft_tensors, weights_cache=settings.weights_cache,
    )  # fmt: skip

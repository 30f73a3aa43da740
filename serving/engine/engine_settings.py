"""The engine's settings: one dataclass that every command running the engine nests, and the one
function that turns it into loaded models, Choral's CPU kernels and engines.

    settings = EngineSettings(device="cpu", max_batch_size=4, k=4)
    loaded = load_engine(settings, "qwen2.5-coder-1.5b-instruct", {"base": "qwen2.5-coder-0.5b-instruct", "ngram": "ngram"})
    [out] = loaded.engine.generate([Request(ids, max_new_tokens=32, drafter="ngram")])

A drafter reference is a model (hub id, folder or bundled name), a built-in model-free drafter
(``ngram``, ``suffix``; their settings are ``engine.ngram.*`` and ``engine.suffix.*``) or ``none``.

``serve``, ``collect-router-data``, ``spec-generate`` and ``spec-bench`` nest it as ``engine``,
``train-draft``'s held-out evaluation as ``eval.engine``: a setting has one name and one meaning
on every command (``engine.max_batch_size=4``, ``engine.draft_weights=int8``). Which models run
is each command's own business (a router's drafts, a student, ``--target``/``--draft``), so the
model references are not settings here.

Importing this module is cheap (no torch): a command parses and checks its settings, or answers
``--describe``, before the heavy imports that loading needs.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Mapping

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from serving.engine import EngineConfig, SpeculativeEngine
    from serving.engine.verifier import Verifier


def doc(text: str) -> dict:
    return {"doc": text}


@dataclass
class NgramSettings:
    """vLLM's ``ngram`` method (``prompt_lookup_min``/``prompt_lookup_max``), transformers' prompt lookup."""

    min_n: int = field(default=1, metadata=doc("shortest n-gram of the request's last tokens to look up"))
    max_n: int = field(default=4, metadata=doc("longest n-gram to look up (the longest match wins)"))
    k: int | None = field(default=None, metadata=doc(
        "tokens proposed per step (num_speculative_tokens); null: the engine's k"))

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram: need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"ngram.k={self.k} must be >= 1 (or null for the engine's k)")


@dataclass
class SuffixSettings:
    """vLLM's ``suffix`` method (Arctic Inference's suffix decoding), same option names."""

    max_tree_depth: int = field(default=24, metadata=doc("longest context suffix matched"))
    max_cached_requests: int = field(default=256, metadata=doc(
        "finished requests whose outputs stay in the cross-request cache (0: each request's own context only)"))
    max_spec_factor: float = field(default=1.0, metadata=doc(
        "propose at most this many tokens per matched token"))
    min_token_prob: float = field(default=0.1, metadata=doc(
        "stop a proposal once its estimated probability (product of branch frequencies) drops below this"))
    k: int | None = field(default=None, metadata=doc(
        "tokens proposed per step at most (num_speculative_tokens); null: the engine's k"))

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1 or self.max_cached_requests < 0 or self.max_spec_factor <= 0:
            raise ValueError(f"suffix: max_tree_depth={self.max_tree_depth} must be >= 1, max_cached_requests="
                             f"{self.max_cached_requests} >= 0 and max_spec_factor={self.max_spec_factor} > 0")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix.min_token_prob={self.min_token_prob} must be in [0, 1]")
        if self.k is not None and self.k < 1:
            raise ValueError(f"suffix.k={self.k} must be >= 1 (or null for the engine's k)")


@dataclass
class PredictionSettings:
    """OpenAI's Predicted Outputs: the drafter of requests that carry a ``prediction``."""

    k: int | None = field(default=None, metadata=doc(
        "tokens proposed per step at most; null: the engine's k. A prediction that holds costs no "
        "draft steps, so a K above the draft models' pays (it must not exceed the largest k_buckets)"))
    min_n: int = field(default=1, metadata=doc("shortest answer tail aligned with the prediction"))
    max_n: int = field(default=8, metadata=doc("longest answer tail aligned with the prediction"))
    confident_n: int = field(default=4, metadata=doc(
        "an aligned tail this long (or an answer that so far is the prediction's head) proposes k tokens; "
        "a shorter tail of n tokens proposes n + 1 (a short match is often a coincidence, and a long "
        "verify costs several one-token steps on a CPU); 1: always k; at most max_n"))

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prediction: need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if not 1 <= self.confident_n <= self.max_n:
            raise ValueError(f"prediction.confident_n={self.confident_n} must be in 1..max_n={self.max_n} (1: always propose "
                             "k tokens; no tail longer than max_n is looked for)")  # fmt: skip
        if self.k is not None and self.k < 1:
            raise ValueError(f"prediction.k={self.k} must be >= 1 (or null for the engine's k)")


HOST_DRAFTERS = ("ngram", "suffix")  # built-in drafter references that need no model
NONE = "none"


@dataclass
class EngineSettings:
    device: Literal["auto", "cpu", "cuda", "neuron"] = field(default="auto", metadata=doc(
        "where the models run; auto: the accelerator if there is one, else the CPU"))
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata=doc("weights' dtype"))
    quantize: Literal["int8-dynamic"] | None = field(default=None, metadata=doc(
        "int8-dynamic: PyTorch's dynamic int8 Linear layers on every model (CPU; fast, but greedy output "
        "may differ from fp32: the target is quantized too). For a cheaper draft alone use draft_weights"))
    cpu_kernels: bool = field(default=True, metadata=doc(
        "on a CPU in fp32, Choral's batch-invariant kernels: verifying K+1 tokens costs about one, rows "
        "are bitwise identical (eager only: off while compile_backend is set)"))
    target_weights: Literal["auto", "fp32", "int8", "q4"] = field(default="auto", metadata=doc(
        "the target's precision on Choral's CPU kernels. auto: q4 for a bundled GGUF target where the kernels "
        "run (a CPU, float32), fp32 for any other target (a folder or hub model keeps its weights; CUDA and "
        "Neuron run dtype); fp32: as loaded; int8: W8A8 like int8 drafts (a step reads about a quarter of "
        "the bytes); q4: the GGUF's 4-bit tensors kept in their 4-bit groups, W4A8, the rest int8. Integer "
        "sums keep every row batch-invariant, so greedy speculative output equals that precision's target "
        "decoding alone (not the fp32 target's)"))
    draft_weights: Literal["auto", "fp32", "int8", "q4"] = field(default="auto", metadata=doc(
        "int8: drafts run as W8A8 int8 on the CPU kernels (~2.5x cheaper draft steps; the target keeps "
        "target_weights, so outputs are unchanged, only acceptance may move); q4: every Linear (whose inputs "
        "are whole groups of 32) in 4-bit groups (W4A8), a GGUF's own Q4_K groups kept, the other tensors rounded into groups as "
        "llama.cpp's Q4_1 (a cheaper step again, acceptance may move); auto: q4 beside a q4 target, int8 "
        "beside any other target where the CPU kernels run, fp32 elsewhere"))
    weights_cache: bool = field(default=True, metadata=doc(
        "keep each loaded model's int8/q4 conversion under CHORAL_HOME/prepared (keyed by the weights' "
        "content) and load it next time instead of converting again (the q4 1.5B target: about a minute)"))
    compile_backend: str | None = field(default=None, metadata=doc(
        "torch.compile backend of the step shapes (inductor, neuron), or auto for the device's; "
        "null: eager. Compiled shapes are warmed up at load"))
    step_k: Literal["rows", "goodput"] = field(default="rows", metadata=doc(
        "rows: each row drafts its own K and a step verifies at the longest proposal's bucket; goodput: each "
        "step caps the rows' proposals (not a seeded sampled row's) at the K that maximises the batch's expected tokens per ms, from "
        "each row's acceptance so far and measured step times (in a full batch one row's long proposal makes "
        "every row pay); outputs unchanged"))
    cuda_graphs: bool = field(default=False, metadata=doc(
        "on CUDA, capture every step shape (rows, width) as a CUDA graph at load and replay it: a small "
        "batch's step on a GPU is bound by kernel launches (eager or with compile_backend)"))
    max_batch_size: int = field(default=1, metadata=doc(
        "slots per engine: sequences decoded together in the static batch"))
    max_len: int | None = field(default=None, metadata=doc(
        "context per slot (prompt + new tokens + K + 1); null: min(2048, the target's), except "
        "collect-router-data and train-draft's evaluation, which fit their longest prompt"))
    k: int | str = field(default=4, metadata=doc(
        "draft tokens per step, or auto (Hugging Face's heuristic moving over k_buckets)"))
    k_buckets: tuple[int, ...] = field(default=(1, 2, 3, 4, 5, 6, 7, 8), metadata=doc(
        "the K values that exist as step shapes (compiled, CPU-kernel widths); a fixed k must be one"))
    draft_confidence: float | None = field(default=None, metadata=doc(
        "stop a step's drafting once the draft's top probability drops below this (a host check per "
        "draft token: for CPUs, not Neuron); null: always draft k"))
    draft_stop: Literal["token", "cumulative"] = field(default="token", metadata=doc(
        "with draft_confidence: compare each draft token's top probability, or their running product "
        "(the block's chance of surviving whole)"))
    threads: int | None = field(default=None, metadata=doc(
        "torch intra-op threads of the process; null: torch's default (one per core). On a CPU shared "
        "with other busy processes, 1 avoids threads waiting on each other"))
    request_k_max: int | None = field(default=None, metadata=doc(
        "the largest K a request may set for itself (num_speculative_tokens per request; the router's K "
        "when serving); null: requests draft k tokens (serve with a router: the router's largest K bucket)"))
    reuse_prefill: bool | None = field(default=None, metadata=doc(
        "a request whose prompt is the one last prefilled into its batch row reuses that row's KV and "
        "first logits (bit-identical) and is charged that prefill's measured time; null: on in "
        "collect-router-data at max_batch_size 1 (each prompt runs once per drafter in the same row), off elsewhere"))
    batch_buckets: tuple[int, ...] | None = field(default=None, metadata=doc(
        "batch sizes a step can run at (compiled shapes); a step runs at the smallest holding its "
        "rows. null: 1, 2, 4, ... up to max_batch_size"))
    ngram: NgramSettings = field(default_factory=NgramSettings, metadata=doc("the ngram drafter"))
    suffix: SuffixSettings = field(default_factory=SuffixSettings, metadata=doc("the suffix drafter"))
    prediction: PredictionSettings = field(default_factory=PredictionSettings, metadata=doc(
        "the prediction drafter (requests with OpenAI's prediction field)"))

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= 1")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len={self.max_len} must be >= 2 (or null)")
        if not self.k_buckets or min(self.k_buckets) < 1:
            raise ValueError(f"k_buckets={list(self.k_buckets)} must list positive integers")
        self.k_buckets = tuple(sorted(set(self.k_buckets)))
        if self.k != "auto" and not (isinstance(self.k, int) and not isinstance(self.k, bool) and self.k >= 1):
            raise ValueError(f"k={self.k!r} must be a positive integer or 'auto'")
        if self.k != "auto" and self.k not in self.k_buckets:
            raise ValueError(f"k={self.k} is not one of k_buckets {list(self.k_buckets)}: add it to k_buckets")
        for name in ("ngram", "suffix", "prediction"):
            own = getattr(self, name).k
            if own is not None and own > self.k_buckets[-1]:
                raise ValueError(f"{name}.k={own} exceeds the largest of k_buckets {list(self.k_buckets)}: add {own} to "
                                 f"k_buckets (engine.k_buckets=[...,{own}]) or lower {name}.k")
        if self.request_k_max is not None and not 1 <= self.request_k_max <= self.k_buckets[-1]:
            raise ValueError(f"request_k_max={self.request_k_max} must be in 1..{self.k_buckets[-1]}, the largest of "
                             "k_buckets (or null)")
        if self.draft_confidence is not None and not 0.0 <= self.draft_confidence <= 1.0:
            raise ValueError(f"draft_confidence={self.draft_confidence} must be in [0, 1] (or null)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1 (or null for torch's default)")
        if self.target_weights in ("int8", "q4") and (not self.uses_cpu_kernels or self.dtype != "float32" or self.quantize):
            raise ValueError(f"target_weights={self.target_weights} runs on Choral's CPU kernels from an fp32 model: set "
                             "cpu_kernels=true, compile_backend=null, dtype=float32 and quantize=null, or "
                             "target_weights=fp32")  # fmt: skip
        if self.draft_weights in ("int8", "q4") and not self.uses_cpu_kernels:
            raise ValueError(f"draft_weights={self.draft_weights} runs on Choral's CPU kernels: set cpu_kernels=true and "
                             "compile_backend=null, or draft_weights=auto/fp32")  # fmt: skip

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether the CPU kernels are asked for: they are eager-only, so not while compiling (they
        still apply only on a CPU in fp32 without quantize)."""
        return self.cpu_kernels and self.compile_backend is None

    def cpu_kernels_apply(self, device: torch.device | None = None) -> bool:
        """Whether Choral's CPU kernels run under these settings on ``device``: asked for (eager), a
        CPU, float32, no quantize."""
        import torch

        from serving.engine.devices import resolve_device, resolve_dtype

        device = device if device is not None else resolve_device(self.device)
        return (self.uses_cpu_kernels and torch.device(device).type == "cpu" and self.quantize is None
                and resolve_dtype(self.dtype) == torch.float32)  # fmt: skip

    def resolved(self, target: str, device: torch.device | None = None) -> EngineSettings:
        """These settings with ``target_weights`` and ``draft_weights`` saying what runs for
        ``target``, never ``auto``: what every command runs, prints and records. A bundled GGUF target
        runs q4 where the CPU kernels run (its own 4-bit groups: several times faster than fp32 on
        these CPUs, and exact against itself); any other target fp32."""
        if "auto" not in (self.target_weights, self.draft_weights):
            return self
        from serving.engine.bundled import is_bundled_name
        from serving.engine.core import drafts_precision
        from serving.engine.cpu_kernels import rowdot_available

        applies = self.cpu_kernels_apply(device)
        target_weights = self.target_weights
        if target_weights == "auto":  # q4 needs the C++ kernel (use_cpu_kernels refuses it without)
            target_weights = "q4" if applies and rowdot_available() and is_bundled_name(str(target)) else "fp32"
        draft_weights = drafts_precision(self.draft_weights, applies=applies, target_weights=target_weights)
        return dataclasses.replace(self, target_weights=target_weights, draft_weights=draft_weights)

    def drafts_weights(self, device: torch.device | None = None) -> str:
        """The precision drafts run at: ``draft_weights`` with ``auto`` resolved as ``load_engine``
        resolves it (beside the target at ``target_weights``, ``auto`` there read as fp32: models
        handed over already loaded keep their weights). What collected rows and served logs
        record beside ``target_weights``: a draft's step cost and acceptance depend on it."""
        from serving.engine.core import drafts_precision

        target_weights = "fp32" if self.target_weights == "auto" else self.target_weights
        return drafts_precision(self.draft_weights, applies=self.cpu_kernels_apply(device), target_weights=target_weights)

    def precision_line(self, target: str, device: torch.device | None = None) -> str:
        """One line saying what precision runs and what "identical" is measured against."""
        import torch

        from serving.engine.devices import resolve_device

        device = torch.device(device if device is not None else resolve_device(self.device))
        s = self.resolved(target, device)
        if s.cpu_kernels_apply(device):
            what = {"q4": "q4 (the GGUF's 4-bit groups, W4A8)", "int8": "int8 (W8A8)", "fp32": "fp32"}[s.target_weights]
            where, precision = f"{device.type} with Choral's CPU kernels", s.target_weights
        else:
            what = precision = s.quantize or s.dtype
            where = device.type
        return (f"target {target}: {what} on {where}, drafts {s.draft_weights}; greedy output is identical to the "
                f"{precision} target decoding alone (set engine.target_weights to change)")

    def engine_config(self, *, draft: bool, device: torch.device | None = None, **changes) -> EngineConfig:
        """The ``EngineConfig`` of one engine; ``draft=False`` is the target alone (k=0).
        ``changes`` replace settings for this engine only (``k=2`` in a K sweep)."""
        from serving.engine import EngineConfig
        from serving.engine.devices import compile_backend, resolve_device

        s = dataclasses.replace(self, **changes) if changes else self
        backend = s.compile_backend
        if backend == "auto":
            backend = compile_backend(device if device is not None else resolve_device(s.device))
        return EngineConfig(
            max_batch_size=s.max_batch_size,
            max_len=s.max_len,
            k=s.k if draft else 0,
            k_buckets=s.k_buckets,
            compile_backend=backend,
            draft_confidence=s.draft_confidence if draft else None,
            draft_stop=s.draft_stop,
            batch_buckets=s.batch_buckets,
            host_k=max((x.k or 0 for x in (s.ngram, s.suffix, s.prediction)), default=0) if draft else 0,
            request_k_max=(s.request_k_max or 0) if draft else 0,
            reuse_prefill=bool(s.reuse_prefill),
            step_k=s.step_k if draft else "rows",
            cuda_graphs=s.cuda_graphs,
        )

    def host_drafter(self, ref: str):
        """A new model-free drafter for a built-in reference (``ngram``, ``suffix``, or
        ``prediction``, which every drafting engine holds for requests with a prediction)."""
        if ref == "prediction":
            from serving.engine.drafters.prediction import PredictionDrafter

            x = self.prediction
            return PredictionDrafter(k=x.k, min_n=x.min_n, max_n=x.max_n, confident_n=x.confident_n)
        if ref == "ngram":
            from serving.engine.drafters.ngram import NgramDrafter

            return NgramDrafter(k=self.ngram.k, min_n=self.ngram.min_n, max_n=self.ngram.max_n)
        if ref == "suffix":
            from serving.engine.drafters.suffix import SuffixDrafter

            x = self.suffix
            return SuffixDrafter(k=x.k, max_depth=x.max_tree_depth, max_cached_requests=x.max_cached_requests,
                                 max_spec_factor=x.max_spec_factor, min_token_prob=x.min_token_prob)  # fmt: skip
        raise ValueError(f"{ref!r} is not a built-in drafter: use one of {', '.join(HOST_DRAFTERS)} or a model reference")


@dataclass
class LoadedEngine:
    tokenizer: PreTrainedTokenizerBase
    target: PreTrainedModel | None  # None when the engine verifies on a remote target
    drafts: dict[str, PreTrainedModel]  # drafter name -> its draft model (model drafters only)
    engine: SpeculativeEngine
    cpu_kernels: bool  # whether Choral's CPU kernels were installed


def is_model_ref(ref: str | None) -> bool:
    return ref is not None and ref != NONE and ref not in HOST_DRAFTERS


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
    from serving.engine import SpeculativeEngine
    from serving.engine.devices import resolve_device

    device = resolve_device(settings.device)
    settings = settings.resolved(target, device)
    if verifier is None:
        print(settings.precision_line(target, device), file=sys.stderr, flush=True)
    else:  # the target runs in its own service, at the precision that service prints
        print(f"target {target}: verified by a remote target service; drafts {settings.draft_weights}; greedy output "
              "is identical to that service's target decoding alone", file=sys.stderr, flush=True)  # fmt: skip
    drafting = any(ref is not None and ref != NONE for ref in drafters.values())
    config = settings.engine_config(draft=drafting, device=device)
    widths = config.step_widths if drafting else (1,)
    if drafting:  # a host drafter's (or a prediction's) short proposal rounds up to a K bucket
        widths = tuple(sorted({*widths, *(k + 1 for k in config.k_buckets if k <= config.k_max)}))
    refs = [r for r in drafters.values() if is_model_ref(r)]
    tokenizer, target_model, by_ref = load_models(
        settings, target, refs, load_target=verifier is None,
        each_draft=lambda draft: prepare_kernels(settings, [], [draft], widths),
    )  # fmt: skip
    kernels = prepare_kernels(settings, [target_model] if target_model is not None else [], [], widths)
    built = {name: (by_ref[ref] if is_model_ref(ref) else settings.host_drafter(ref) if ref in HOST_DRAFTERS else None)
             for name, ref in drafters.items()}  # fmt: skip
    if drafting and "prediction" not in built:  # the engine's drafter of requests with a prediction, as configured
        built["prediction"] = settings.host_drafter("prediction")
    engine = SpeculativeEngine(verifier or target_model, tokenizer, config=config, drafters=built, default_drafter=default)
    drafts = {name: by_ref[ref] for name, ref in drafters.items() if is_model_ref(ref)}
    return LoadedEngine(tokenizer, target_model, drafts, engine, kernels)


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
    import torch

    from serving.engine.devices import resolve_device
    from serving.engine.models import check_same_tokenizer, load_model, load_tokenizer

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
    from serving.engine.core import use_cpu_kernels
    from serving.engine.devices import resolve_device

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

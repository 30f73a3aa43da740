"""The engine's settings: one dataclass that every command running the engine nests, , and the
resolved ``EngineConfig`` of one engine.

    settings = EngineSettings(device="cpu", max_batch_size=4, k=4)
    loaded = load_engine(settings, "qwen2.5-coder-1.5b-instruct", {"base": "qwen2.5-coder-0.5b-instruct", "ngram": "ngram"})
    [out] = loaded.engine.generate([Request(ids, max_new_tokens=32, drafter="ngram")])

(``load_engine`` and ``build_engine`` are in ``serving.engine.loader``.) ``EngineConfig`` is the
resolved form one engine runs with, made by ``EngineSettings.engine_config``.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from serving.engine.drafters import registry
from serving.engine.drafters.base import NONE

if TYPE_CHECKING:
    import torch


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


# Per-token acceptance of ngram's and suffix's proposals by length on the workload's val split, 128
# greedy tokens of the q4 target (runs/replay-val, scripts/experiments/replay_ceiling.py --split val):
# a one-token suffix proposal holds a quarter of the time, a four-token one nine in ten.
AUTO_PRIORS = {"suffix@1": 0.25, "suffix@2": 0.5, "suffix@3": 0.65, "suffix@4": 0.9,
               "ngram@1": 0.3, "ngram@2": 0.5, "ngram@3": 0.6, "ngram@4": 0.8}  # fmt: skip


@dataclass
class AutoSettings:
    """``auto``: each step, the drafter (or none) with the best expected tokens per ms, per row."""

    drafters: tuple[str, ...] | None = field(default=None, metadata=doc(
        "names of the engine's drafters auto chooses among (null: all of them)"))
    k: int | None = field(default=None, metadata=doc("the largest K auto proposes; null: the engine's k"))
    prior_a: dict[str, float] = field(default_factory=lambda: dict(AUTO_PRIORS), metadata=doc(
        "per-token acceptance assumed before a row has its own record, by drafter name or name@length "
        "of a host proposal (suffix@1: a one-token suffix proposal); a router's prediction per request "
        "overrides it. Default: what the workload's val split measured"))
    default_prior: float = field(default=0.5, metadata=doc("the prior of a drafter not in prior_a"))
    prior_weight: float = field(default=2.0, metadata=doc("pseudo-tokens of the prior against the row's own record"))
    catch_up_weight: float = field(default=0.5, metadata=doc(
        "share of the catch-up a skipped step will cost a model drafter that is charged to that step "
        "(0: the per-step greedy rule; 1: as if the model surely drafts again)"))

    def __post_init__(self) -> None:
        self.drafters = tuple(self.drafters) if self.drafters is not None else None
        bad = {n: a for n, a in {**self.prior_a, "default_prior": self.default_prior}.items() if not 0.0 <= a <= 1.0}
        if bad:
            raise ValueError(f"auto: acceptance priors {bad} must be in [0, 1]")
        if self.prior_weight <= 0:
            raise ValueError(f"auto.prior_weight={self.prior_weight} must be > 0")
        if not 0.0 <= self.catch_up_weight <= 1.0:
            raise ValueError(f"auto.catch_up_weight={self.catch_up_weight} must be in [0, 1]")
        if self.k is not None and self.k < 1:
            raise ValueError(f"auto.k={self.k} must be >= 1 (or null for the engine's k)")


HOST_DRAFTERS = registry.host_refs()  # built-in drafter references that need no model
DRAFT_STOPS = ("token", "cumulative")  # what draft_stop compares with draft_confidence
STEP_KS = ("rows", "goodput")  # how a step's K is set (step_k)


def check_steps(max_batch_size: int, k: int | str, k_buckets: tuple[int, ...], *, target_only: bool = False) -> tuple[int, ...]:
    """The step shapes' settings checked (for ``EngineSettings`` and ``EngineConfig`` alike);
    returns ``k_buckets`` sorted. ``target_only``: k may be 0 (an engine of the target alone)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
    if not k_buckets or min(k_buckets) < 1:
        raise ValueError(f"k_buckets={list(k_buckets)} must list positive integers")
    k_buckets = tuple(sorted(set(k_buckets)))
    if target_only and k == 0:
        return k_buckets
    if k != "auto" and not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ValueError(f"k={k!r} must be a positive integer or 'auto'")
    if k != "auto" and k not in k_buckets:
        raise ValueError(f"k={k} is not one of k_buckets {list(k_buckets)}: add it to k_buckets")
    return k_buckets


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
    step_k: Literal["rows", "goodput"] = field(default="goodput", metadata=doc(
        "rows: each row drafts its own K and a step verifies at the longest proposal's bucket; goodput: a step "
        "of two or more rows caps their proposals (not a seeded sampled row's) at the K that maximises the batch's "
        "expected tokens per ms, from each row's acceptance so far (else its drafter's recent record) and step "
        "times measured at load and while serving (in a full batch one row's long proposal makes every row pay; "
        "a row alone keeps its K); outputs unchanged"))
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
    auto: AutoSettings = field(default_factory=AutoSettings, metadata=doc(
        "the auto drafter (a drafter per row and step among the others)"))

    def __post_init__(self) -> None:
        self.k_buckets = check_steps(self.max_batch_size, self.k, self.k_buckets)
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len={self.max_len} must be >= 2 (or null)")
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
        from serving.engine.cpu_kernels import drafts_precision, rowdot_available

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
        from serving.engine.cpu_kernels import drafts_precision

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
            host_k=max((x.k or 0 for x in (s.ngram, s.suffix, s.prediction, s.auto)), default=0) if draft else 0,
            request_k_max=(s.request_k_max or 0) if draft else 0,
            reuse_prefill=bool(s.reuse_prefill),
            step_k=s.step_k if draft else "rows",
            cuda_graphs=s.cuda_graphs,
        )

    def host_drafter(self, ref: str):
        """A new model-free drafter for a built-in reference (``ngram``, ``suffix``, or
        ``prediction``, which every drafting engine holds for requests with a prediction), with
        these settings (``serving.engine.drafters.registry``)."""
        return registry.build(ref, self)


def is_model_ref(ref: str | None) -> bool:
    """Whether a drafter reference names a model (not a built-in drafter, not ``none``)."""
    return ref is not None and ref != NONE and ref not in registry.BUILT_IN


@dataclass
class EngineConfig:
    """The resolved settings of one engine, as ``EngineSettings.engine_config`` makes them: each
    field means what the ``EngineSettings`` field of its name documents, resolved (no ``auto``
    backend, no null ``reuse_prefill`` or ``request_k_max``). What only an engine has: ``k`` 0 for
    the target alone, ``host_k`` (the largest own K of a model-free drafter: with a fixed k, rows
    of that drafter draft up to it) and ``batch_buckets`` filled in (1, 2, 4, ... up to
    ``max_batch_size``, which is always one). ``max_len`` None takes min(2048, the target's) when
    the verifier binds. Tools and tests that build an engine from stub parts construct it directly."""

    max_batch_size: int = 1
    max_len: int | None = None
    k: int | str = 4
    k_buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    compile_backend: str | None = None
    draft_confidence: float | None = None
    draft_stop: str = "token"
    batch_buckets: tuple[int, ...] | None = None
    host_k: int = 0
    request_k_max: int = 0
    reuse_prefill: bool = False
    step_k: str = "rows"
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        self.k_buckets = check_steps(self.max_batch_size, self.k, self.k_buckets, target_only=True)
        if self.step_k not in STEP_KS:
            raise ValueError(f"step_k={self.step_k!r} must be one of {', '.join(STEP_KS)}")
        if self.draft_stop not in DRAFT_STOPS:
            raise ValueError(f"draft_stop={self.draft_stop!r} must be 'token' or 'cumulative'")
        for name in ("host_k", "request_k_max"):
            if not 0 <= getattr(self, name) <= self.k_buckets[-1]:
                raise ValueError(f"{name}={getattr(self, name)} must be in 0..{self.k_buckets[-1]}, the largest of k_buckets")
        if self.batch_buckets is None:
            powers = [1 << i for i in range(self.max_batch_size.bit_length()) if 1 << i < self.max_batch_size]
            self.batch_buckets = (*powers, self.max_batch_size)
        buckets = tuple(sorted({*self.batch_buckets, self.max_batch_size}))
        if min(buckets) < 1 or max(buckets) > self.max_batch_size:
            raise ValueError(f"batch_buckets={self.batch_buckets} must be sizes from 1 to max_batch_size={self.max_batch_size}")
        self.batch_buckets = buckets

    @property
    def k_max(self) -> int:
        if self.k == "auto":
            return max(self.k_buckets)
        return max(int(self.k), self.host_k, self.request_k_max) if self.k else 0

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """Input widths of the target's verification: K+1 for every K a step can use."""
        ks = self.k_buckets if self.k == "auto" else (int(self.k),)
        if self.draft_confidence is not None:  # an early stop can leave any shorter block
            ks = range(1, max(ks) + 1)
        return tuple(sorted({k + 1 for k in ks}))

    @property
    def step_widths(self) -> tuple[int, ...]:
        """Input widths of all decode forwards: 1 and 2 (draft) and the verification widths."""
        return tuple(sorted({1, 2, *self.verify_widths}))

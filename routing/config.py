"""``collect-router-data`` and ``train-router`` configuration (YAML -> dataclasses, see serving.config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from routing.router import NONE
from serving.engine.engine_settings import EngineSettings


def doc(text: str) -> dict:
    return {"doc": text}


# ---- collect-router-data ---------------------------------------------------------------------


@dataclass
class SourceConfig:
    """One prompt source: a built-in domain (``serving.prompts.load_prompts``), a family of the
    routing workload (``serving.workload``: one split of it) or a file."""

    domain: Literal["code", "chat", "math", "edit", "extract", "summarize", "quoted", "grounded"] | None = field(
        default=None, metadata=doc("built-in prompts: code = HumanEval, chat = ShareGPT, math = mathematics-dataset; "
                                   "edit, extract, summarize, quoted: input-grounded prompts; grounded: `n` of each of those four")
    )
    family: Literal["chat", "code", "edit", "extract", "math", "quoted", "all"] | None = field(default=None, metadata=doc(
        "a family of the six-family routing workload (serving.workload), instead of `domain`; all: `n` of each"))
    split: Literal["train", "val", "test"] | None = field(default=None, metadata=doc(
        "with `family`: the workload's fixed split to take prompts from (required)"))
    file: str | None = field(default=None, metadata=doc(".txt (one prompt a line) or .jsonl prompt file, instead of `domain`"))
    n: int | None = field(default=None, metadata=doc("prompts to take (null: all of a file; required for a domain)"))
    offset: int = field(default=0, metadata=doc("first row to take"))
    seed: int = field(default=0, metadata=doc("math question generator seed"))

    def __post_init__(self) -> None:
        given = [k for k in ("domain", "family", "file") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"sources: each source needs exactly one of `domain`, `family` or `file`, got {given or 'none'}")
        if self.file is None and self.n is None:
            raise ValueError(f"sources: {given[0]} {getattr(self, given[0])!r} needs `n` (how many prompts)")
        if (self.family is None) != (self.split is None):
            raise ValueError("sources: `family` and `split` go together (e.g. {family: all, split: train, n: 8})")
        if self.n is not None and self.n < 1:
            raise ValueError(f"sources: n={self.n} must be >= 1")
        if self.offset < 0:
            raise ValueError(f"sources: offset={self.offset} must be >= 0")


@dataclass
class DecodeConfig:
    modes: list[Literal["greedy", "sampled"]] = field(default_factory=lambda: ["greedy"], metadata=doc("decoding modes to measure"))
    temperature: float = field(default=0.7, metadata=doc("sampled mode's temperature"))
    top_p: float = field(default=1.0, metadata=doc("sampled mode's nucleus"))
    top_k: int = field(default=0, metadata=doc("sampled mode's top-k (0: off)"))
    max_new_tokens: int = field(default=64, metadata=doc("tokens generated per prompt"))
    repeats: int = field(default=1, metadata=doc("runs per (prompt, draft, mode); sampled repeats use different seeds"))
    seed: int = field(default=0, metadata=doc("base seed of sampled runs"))

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("modes must name at least one of greedy, sampled")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes={self.modes} repeats a mode")
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (greedy is its own mode)")


@dataclass
class CollectConfig:
    target: str = field(default="qwen2.5-coder-1.5b-instruct", metadata=doc("target: hub id, folder or bundled name"))
    drafts: dict[str, str] = field(
        default_factory=lambda: {"base": "qwen2.5-coder-0.5b-instruct"}, metadata=doc("draft name -> model reference")
    )
    baseline: bool = field(default=True, metadata=doc(f"also run the target alone as draft {NONE!r}; needed for speedup"))
    sources: list[SourceConfig] = field(default_factory=list, metadata=doc("prompt sources, in order"))
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    # engine.max_batch_size > 1 collects faster, but the rows of one batch share their timings.
    engine: EngineSettings = field(default_factory=EngineSettings)
    output: str = field(default="runs/router-data/rows.jsonl", metadata=doc("JSONL file rows are appended to"))

    RENAMED: ClassVar[dict[str, str]] = {"engine.batch_size": "engine.max_batch_size", "decode.k": "engine.k"}

    def __post_init__(self) -> None:
        if not isinstance(self.engine.k, int):
            raise ValueError(f"engine.k={self.engine.k!r}: each row measures one K; give an integer")
        if not self.drafts:
            raise ValueError("drafts must name at least one draft (name: model reference)")
        if NONE in self.drafts:
            raise ValueError(f"drafts: {NONE!r} is reserved for the target alone; set baseline: true instead")
        if not self.sources:
            raise ValueError("sources must list at least one prompt source (domain: code, n: 50 / file: prompts.jsonl)")
        if not self.output.endswith(".jsonl"):
            raise ValueError(f"output={self.output!r} must be a .jsonl file")


# ---- train-router ----------------------------------------------------------------------------


@dataclass
class FeatureConfig:
    embedder: str = field(default="all-minilm-l6-v2", metadata=doc("sentence-transformers model: bundled name, folder or hub id"))
    cheap: bool = field(default=True, metadata=doc("add length / code-character / digit features"))


@dataclass
class SplitConfig:
    test_fraction: float = field(default=0.25, metadata=doc("held-out prompts per domain for evaluation"))
    val_fraction: float = field(default=0.15, metadata=doc("training prompts kept aside to pick the best epoch"))
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("test_fraction", "val_fraction"):
            if not 0.0 < getattr(self, name) < 0.9:
                raise ValueError(f"{name}={getattr(self, name)} must be in (0, 0.9)")


def check_shrink(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1] (0: raw measurements, 1: each domain's mean)")


@dataclass
class MLPConfig:
    hidden: int = 128
    layers: int = 2
    dropout: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 1e-2
    epochs: int = field(default=300, metadata=doc("full-batch epochs; the epoch with the lowest validation loss is kept"))
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    def with_settings(self, params: dict) -> "MLPConfig":
        """A copy with some settings replaced (candidate values of ``select.mlp`` come as floats;
        the integer settings are made integers), validated like any MLPConfig."""
        ints = {"hidden", "layers", "epochs", "seed"}
        return dataclasses.replace(self, **{k: int(v) if k in ints else float(v) for k, v in params.items()})


@dataclass
class BaselineConfig:
    knn_k: int = field(default=5, metadata=doc("neighbours of the k-nearest-neighbour baseline"))
    logreg_c: float = field(default=1.0, metadata=doc("inverse regularisation of the logistic-regression baseline"))


@dataclass
class SelectConfig:
    folds: int = field(default=0, metadata=doc(
        "k-fold cross-validation on the training prompts (val included) picks the MLP's settings from "
        "`mlp` below and the baselines' from `logreg_c` / `knn_k`, scoring each by the objective its "
        "choices reach on held-out folds; 0: off (the settings as given, the epoch picked on the val prompts)"))
    seed: int = field(default=0, metadata=doc("fold assignment seed"))
    mlp: dict[str, list[float]] = field(
        default_factory=lambda: {"hidden": [32, 128], "weight_decay": [0.01, 0.1, 1.0], "epochs": [50, 150, 300]},
        metadata=doc("candidate values per `mlp` setting (every combination is tried; unlisted settings stay as given)"),
    )
    logreg_c: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0, 10.0], metadata=doc("candidate C of logistic regression"))
    knn_k: list[int] = field(default_factory=lambda: [3, 5, 10], metadata=doc("candidate k of the k-nearest-neighbour baseline"))
    shrink: list[float] = field(default_factory=list, metadata=doc(
        "candidate `shrink` values, tried with every candidate of each family; [] : `shrink` as given"))

    def __post_init__(self) -> None:
        if self.folds == 1 or self.folds < 0:
            raise ValueError(f"folds={self.folds} must be 0 (off) or >= 2")
        known = {f.name for f in fields(MLPConfig)} - {"seed"}
        bad = sorted(set(self.mlp) - known)
        if bad:
            raise ValueError(f"mlp has unknown settings {bad}; choose from {sorted(known)}")
        for name, values in self.mlp.items():
            if not values:
                raise ValueError(f"mlp.{name} is empty: list at least one value or drop the key")
            for v in values:  # a bad candidate fails here, not after minutes of fitting
                MLPConfig().with_settings({name: v})
        if not self.logreg_c or min(self.logreg_c) <= 0:
            raise ValueError(f"logreg_c={self.logreg_c} must list positive values")
        if not self.knn_k or min(self.knn_k) < 1:
            raise ValueError(f"knn_k={self.knn_k} must list values >= 1")
        for v in self.shrink:
            check_shrink(v, "select.shrink")


@dataclass
class RouterTrainConfig:
    data: list[str] = field(default_factory=lambda: ["runs/router-data/rows.jsonl"], metadata=doc("collected JSONL files"))
    test_data: list[str] = field(default_factory=list, metadata=doc(
        "collected JSONL files of other prompts to score on instead of a held-out split of `data`: "
        "then every `data` prompt trains (split.test_fraction is unused); [] : split `data`"))
    served: list[str] = field(default_factory=list, metadata=doc(
        "request logs of serve (routing.log_requests): each row measured only the drafter its request ran with, and "
        "the MLP learns from that entry too (a masked loss); the baselines and the evaluation use the collected rows"))
    mode: Literal["greedy", "sampled", "all"] = field(default="greedy", metadata=doc("which collected rows to learn from"))
    objective: Literal["acceptance", "speedup"] = field(
        default="acceptance", metadata=doc("choose by predicted acceptance, or by predicted speedup (may choose none)")
    )
    k_buckets: list[int] | None = field(default=None, metadata=doc("K values to suggest from; null: 1..8"))
    shrink: float = field(default=0.75, metadata=doc(
        "how far each training prompt's measured acceptance (and objective) is pulled toward its "
        "domain's mean over the training prompts before the MLP and the baselines learn from it: "
        "a 32-token measurement is noisy, the domain's mean much less (empirical-Bayes shrinkage; "
        "the features still have to recognise the domain). 0: the raw measurements, 1: domain means"))
    calibrate_costs: bool = field(default=True, metadata=doc(
        "fit each draft's per-call cost to the measured speedups of the training prompts (needs the "
        "target alone collected); false keeps the bare verify-step cost"))
    prefill: bool = field(default=True, metadata=doc(
        "price each request by its prompt's length, fitted to the collected rows: its prefills (a long prompt "
        "dilutes every drafter's speedup, and a draft model pays its own prefill too) and each drafter's fill "
        "(ngram and suffix copy from the prompt, so they fill more slots the longer it is) (routing.cost_model); "
        "false: the per-call ratio with one fill per drafter, as routers before it"))
    curve_data: list[str] = field(default_factory=list, metadata=doc(
        "collected JSONL files of the same drafters at another K (collect-router-data engine.k=8) on the training "
        "prompts: each drafter found there gets its wider verify's cost scaled so that the router's mean speedup at "
        "that K matches the measured one (routing.cost_model.fit_shift_scale); [] : the step table's cost as it is"))
    step_profile: str | None = field(default=None, metadata=doc(
        "a profile_step.py profile.json measured with --batch-rows (the target at the serving precision, "
        "rows x tokens per row up to the server's batch x (K+1)): the router prices a verify under load from "
        "these measured steps instead of the straight line fitted to the batch-1 rows, which underrates "
        "batched verifies once they stop being bound by reading the weights"))
    features: FeatureConfig = field(default_factory=FeatureConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    baselines: BaselineConfig = field(default_factory=BaselineConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    output: str = field(default="runs/router", metadata=doc("router.pt, eval.json, eval.md and eval.png go here"))

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("data must list at least one collected .jsonl file")
        check_shrink(self.shrink, "shrink")

"""``train-draft`` configuration: YAML sections mapped to typed dataclasses (see serving.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from serving.engine.engine_settings import EngineSettings


def doc(text: str) -> dict:
    return {"doc": text}


@dataclass
class ModelConfig:
    kind: Literal["model", "eagle3"] = field(default="model", metadata=doc(
        "model: a small causal LM (student) distilled from the target; eagle3: an EAGLE-3 head on the target's "
        "own features (the eagle3 section; student and the LoRA keys are not used)"))
    target: str = field(default="qwen2.5-coder-1.5b-instruct", metadata=doc("teacher/verifier: hub id, folder or bundled name"))
    student: str = field(default="qwen2.5-coder-0.5b-instruct", metadata=doc("where the student's weights come from"))
    student_layers: list[int] | None = field(
        default=None, metadata=doc("keep only these decoder layers of `student` (e.g. [0, 1, -1]); null keeps all")
    )
    draft_vocab: int | None = field(
        default=None,
        metadata=doc("keep the N most frequent training tokens in the draft's output head (FR-Spec); null keeps all"),
    )
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata=doc("weights' dtype while training"))
    train_embeddings: bool = field(default=True, metadata=doc(
        "false freezes the input embeddings (and the head where it is tied; an untied 0.5B's 136M of them: less optimizer state and time)"))

    trainable: Literal["all", "head"] = field(default="all", metadata=doc(
        "all: every weight (or LoRA adapters when lora_rank > 0); head: only the output head, untied from "
        "the input embeddings, with the rest frozen (the 0.5B's features stay as they are; a head can only "
        "re-weigh the tokens it proposes)"))
    lora_rank: int = field(default=0, metadata=doc(
        "> 0 trains LoRA adapters of this rank (peft) instead of every weight; checkpoints are saved merged, as plain models"))
    lora_alpha: float = field(default=32.0, metadata=doc("LoRA scaling numerator (the update is scaled by alpha / rank)"))
    lora_targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata=doc("names of the linear layers that get adapters"),
    )

    def __post_init__(self) -> None:
        if self.draft_vocab is not None and self.draft_vocab < 2:
            raise ValueError(f"draft_vocab={self.draft_vocab} must be >= 2 (or null for the full vocabulary)")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} must be >= 0 (0 trains every weight)")
        if self.trainable == "head" and self.lora_rank:
            raise ValueError(f"trainable=head with lora_rank={self.lora_rank}: the head trains as is; set lora_rank=0 or trainable=all")
        if self.lora_rank and not self.lora_targets:
            raise ValueError("lora_targets is empty: name the linear layers that get adapters (e.g. [q_proj, v_proj])")


@dataclass
class Eagle3TrainConfig:
    """The EAGLE-3 head (``model.kind: eagle3``; training/eagle3.py)."""

    aux_layers: list[int] | None = field(default=None, metadata=doc(
        "target layers whose input the head reads (vLLM's eagle_aux_hidden_state_layer_ids); null: (2, N/2, N-3)"))
    intermediate_size: int | None = field(default=None, metadata=doc("the head's MLP width; null: the target's"))
    ttt_steps: int = field(default=3, metadata=doc(
        "training-time test: steps the head is unrolled on its own states (1: teacher features only)"))
    step_decay: float = field(default=0.8, metadata=doc("weight of unrolled step j in the loss: step_decay**j"))
    init: Literal["random", "target"] = field(default="target", metadata=doc(
        "target: the LM head from the target's rows of the draft vocabulary and the final norm from the target's, "
        "the layer's MLP, o_proj and norms from the target's last layer; random: all fresh"))
    norm_before_residual: bool = field(default=False, metadata=doc("speculators' norm_before_residual"))
    train_lm_head: bool = field(default=True, metadata=doc("false freezes the LM head (as initialised)"))

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps={self.ttt_steps} must be >= 1")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"step_decay={self.step_decay} must be in (0, 1]")


@dataclass
class DataConfig:
    domain: Literal["code", "chat", "math"] = field(default="code", metadata=doc("built-in training text source"))
    files: list[str] = field(default_factory=list, metadata=doc("local .jsonl/.txt/.parquet or datasets folders; replace `domain`"))
    n_docs: int = field(default=2000, metadata=doc("documents to read before packing"))
    seq_len: int = field(default=256, metadata=doc("fixed training row length (static shapes)"))
    max_rows: int | None = field(default=None, metadata=doc("cap on packed text rows (on-policy rows come on top)"))
    val_fraction: float = field(default=0.05, metadata=doc("held-out rows for validation loss"))
    on_policy: bool = field(default=False, metadata=doc("add sequences generated by the target from domain prompts"))
    on_policy_prompts: int = field(default=64, metadata=doc("prompts the target answers for on-policy data"))
    on_policy_new_tokens: int = field(default=128, metadata=doc("tokens generated per on-policy prompt"))
    code_prompts: Literal["stdlib_stubs", "target_exercises"] = field(default="stdlib_stubs", metadata=doc(
        "code on-policy prompts: signature + docstring stubs of the standard-library functions read, or "
        "HumanEval-shaped exercises the target writes itself (training/exercises.py)"))
    answers_only: bool = field(default=False, metadata=doc(
        "on-policy rows: train on the target's generated tokens only (prompt tokens get no loss)"))

    def __post_init__(self) -> None:
        if self.seq_len < 8:
            raise ValueError(f"seq_len={self.seq_len} must be >= 8")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction={self.val_fraction} must be in (0, 0.5)")


@dataclass
class LossConfig:
    kind: Literal["ce", "forward_kl", "reverse_kl", "jsd", "tvd"] = field(
        default="forward_kl", metadata=doc("ce = fine-tune on text; the others distill from the target")
    )
    ce_ratio: float = field(default=0.0, metadata=doc("weight of cross-entropy mixed into a distillation loss"))
    temperature: float = field(default=1.0, metadata=doc("softmax temperature of both logits"))
    beta: float = field(default=0.5, metadata=doc("JSD interpolation weight"))
    draft_vocab_only: bool = field(default=False, metadata=doc(
        "with a reduced model.draft_vocab: both distributions over its tokens only, renormalised (what the "
        "served draft proposes from); cross-entropy skips labels outside it"))

    def __post_init__(self) -> None:
        if not 0.0 <= self.ce_ratio <= 1.0:
            raise ValueError(f"ce_ratio={self.ce_ratio} must be in [0, 1]")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")


@dataclass
class OptimConfig:
    lr: float = field(default=3e-4, metadata=doc("peak learning rate (AdamW)"))
    weight_decay: float = 0.0
    warmup_steps: int = field(default=20, metadata=doc("linear warm-up steps"))
    schedule: Literal["cosine", "constant"] = "cosine"
    grad_clip: float = field(default=1.0, metadata=doc("max gradient norm; 0 disables"))

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")


@dataclass
class TrainConfig:
    max_steps: int = field(default=300, metadata=doc("optimizer steps"))
    batch_size: int = field(default=8, metadata=doc("rows per micro-batch per process"))
    grad_accum: int = field(default=1, metadata=doc("micro-batches per optimizer step"))
    seed: int = 0
    device: Literal["auto", "cpu", "cuda", "neuron"] = "auto"
    mixed_precision: Literal["no", "bf16"] = field(default="no", metadata=doc("bf16 autocast where the device supports it"))
    time_budget_min: float | None = field(default=None, metadata=doc("stop (evaluate and save) after the last step that fits in this many minutes"))
    log_every: int = 5

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


# What the held-out evaluation cannot choose: it runs the models training holds, where they are.
_TRAINING_OWNS = {"device": "set train.device instead", "dtype": "set model.dtype instead", "quantize": "leave it null",
                  "compile_backend": "leave it null (the evaluation runs eager)", "threads": "leave it null"}  # fmt: skip


@dataclass
class EvalConfig:
    every: int = field(default=50, metadata=doc("steps between held-out acceptance evaluations"))
    prompts: int = field(default=16, metadata=doc("held-out evaluation prompts of the domain (HumanEval for code)"))
    max_new_tokens: int = 32
    # The engine that measures acceptance (k, the draft's weights, ...). By default the student runs
    # as trained, on stock kernels; measure it as it will be served with cpu_kernels: true and
    # draft_weights: int8 (W8A8 on Choral's CPU kernels, CPU only).
    engine: EngineSettings = field(default_factory=lambda: EngineSettings(cpu_kernels=False, draft_weights="fp32"))

    def __post_init__(self) -> None:
        default = EngineSettings()
        for name, fix in _TRAINING_OWNS.items():
            if getattr(self.engine, name) != getattr(default, name):
                raise ValueError(f"engine.{name}={getattr(self.engine, name)!r}: the evaluation runs the models "
                                 f"training holds, where they are; {fix}")  # fmt: skip


@dataclass
class OutputConfig:
    dir: str = field(default="runs/draft", metadata=doc("checkpoints, metrics.json and plots go here"))
    save_every: int = field(default=50, metadata=doc("steps between resumable checkpoints"))
    keep_previous: bool = field(default=True, metadata=doc(
        "keep the checkpoint before last/ as previous/, which --resume falls back to when last/ is damaged "
        "(up to three checkpoints' disk while one is being saved)"))
    resume_unchecked: bool = field(default=False, metadata=doc(
        "--resume a checkpoint that has no manifest.json (deleted, or from before manifests): its files "
        "cannot be checked, so it is refused unless this is true; the log then says it resumed unchecked"))
    wandb: Literal["off", "offline", "online"] = field(default="off", metadata=doc(
        "Weights & Biases logging of what metrics.json holds (training/metric_logging.py; the choral[wandb] "
        "extra): offline writes a run under <dir>/wandb to `wandb sync` later, online uploads it"))
    wandb_project: str = field(default="choral", metadata=doc("W&B project of the run (named after `dir`)"))

    def __post_init__(self) -> None:
        from training.metric_logging import check_wandb

        check_wandb(self.wandb)


@dataclass
class TrainDraftConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    eagle3: Eagle3TrainConfig = field(default_factory=Eagle3TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=doc(
        "named sets of dotted settings (e.g. quick: {train.max_steps: 60}); --profile NAME applies one over the file"))

    RENAMED: ClassVar[dict[str, str]] = {"eval.k": "eval.engine.k", "eval.draft_weights": "eval.engine.draft_weights"}

    def __post_init__(self) -> None:
        if self.model.kind == "eagle3":
            if self.model.draft_vocab is None:
                raise ValueError("model.kind=eagle3 needs model.draft_vocab (the head's vocabulary, e.g. 32000)")
            if self.model.lora_rank or self.model.trainable != "all":
                raise ValueError("model.kind=eagle3 trains the whole head: leave model.lora_rank=0 and model.trainable=all")
            if self.loss.kind == "ce" or self.loss.ce_ratio:
                raise ValueError(f"model.kind=eagle3 distills the target's distribution: set loss.kind to a divergence "
                                 f"(forward_kl) and loss.ce_ratio=0 (got {self.loss.kind}, {self.loss.ce_ratio})")  # fmt: skip
            return
        if self.loss.draft_vocab_only and self.model.draft_vocab is None:
            raise ValueError("loss.draft_vocab_only=true needs a reduced model.draft_vocab (e.g. 32768)")
        if self.model.trainable == "head" and self.model.draft_vocab is not None and not self.loss.draft_vocab_only:
            raise ValueError(f"model.trainable=head with model.draft_vocab={self.model.draft_vocab} trains only the kept "
                             "rows of the head, so the loss must be over them: set loss.draft_vocab_only=true")

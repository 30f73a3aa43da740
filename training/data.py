"""Training text per domain, kept apart from the evaluation prompts, and its packing into rows.

    texts = load_domain_texts("math", 2000, tokenizer=tok)     # chat-templated questions
    rows = tokenize_and_pack(texts, tok, seq_len=256, eos_id=tok.eos_token_id)   # [N, 256]
    train, val = split_train_val(rows, 0.05, seed=0)

Sources (nothing is downloaded):

* ``code``: the Python standard library's own ``.py`` sources, plain text. HumanEval, the code
  evaluation set, is all 164 rows of ``serving.prompts``' code domain, so code training text has to
  come from elsewhere; the loader checks that no HumanEval prompt appears in what it returns.
* ``chat``: ShareGPT first human turns, ``math``: mathematics-dataset questions, both taken from
  row ``eval_rows`` on (``serving.prompts.EVAL_ROWS`` by default), past every row evaluation uses.
  With a tokenizer that has a chat template they are rendered as one user turn plus the assistant
  generation prompt, exactly as the engine's evaluation encodes prompts; the target's answer is
  added later by on-policy generation. Without one, the prompt text itself.
* a local file or folder: ``.jsonl`` (a ``text`` field per line), ``.txt`` (the whole file is one
  document), ``.parquet`` (a ``text`` column; needs ``pyarrow``) or a Hugging Face ``datasets``
  folder written by ``save_to_disk`` (needs ``datasets``).
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import random
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from serving.prompts import DOMAINS, EVAL_ROWS, Prompt, load_prompts, render

STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"})
"""Folders of the standard library that are not library source (tests, IDE, vendored packages)."""
LOCAL_SUFFIXES = (".jsonl", ".txt", ".parquet")
MIN_OVERLAP_CHARS = 32
"""Shorter evaluation prompts are only checked for exact equality: a short string such as "hi"
turns up inside unrelated text by chance and says nothing about leakage."""
IGNORE_INDEX = -100
HUMANEVAL_ROWS = 164
"""All of HumanEval, the code evaluation set: no training text or prompt may contain one."""
_ENCODE_BATCH = 256

Rows = TypeVar("Rows", torch.Tensor, list)


class EvalOverlapError(ValueError):
    """Training text contains an evaluation prompt."""


# --- sources ----------------------------------------------------------------------------------


def stdlib_sources() -> list[Path]:
    """Every ``.py`` file of the standard library outside ``STDLIB_SKIP_DIRS``, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        # Pruned in place so os.walk never descends into them (site-packages can live here).
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files)


def code_texts(n_docs: int, *, seed: int = 0) -> list[str]:
    """``n_docs`` standard-library sources, a ``seed``-shuffled draw from ``stdlib_sources()``.

    For one seed a larger ``n_docs`` extends a smaller one. Empty files and files that are not
    UTF-8 are skipped.
    """
    files = stdlib_sources()
    random.Random(seed).shuffle(files)
    texts = []
    for path in files:
        if len(texts) >= n_docs:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            texts.append(text)
    return texts


def function_stubs(texts: Iterable[str], n: int, *, min_doc_chars: int = 40) -> list[str]:
    """Up to ``n`` HumanEval-shaped prompts cut from Python source: a top-level function's
    signature and docstring (no body), after the module's imports, for the target to complete.

    Code evaluation is HumanEval, whose prompts are exactly such stubs; on-policy training data
    made from stubs of the *training* sources teaches the draft the target's function bodies
    without ever showing it an evaluation prompt. Private functions (``_name``), one-line
    docstrings shorter than ``min_doc_chars`` and files that do not parse are skipped.
    """
    import ast

    stubs: list[str] = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        imports = [ast.get_source_segment(text, node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        header = "\n".join(i for i in imports if i and "\n" not in i)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                continue
            doc = ast.get_docstring(node)
            first = node.body[0]
            if not doc or len(doc) < min_doc_chars or len(node.body) < 2:
                continue
            stub = "\n".join(lines[node.lineno - 1 : first.end_lineno])  # signature + docstring
            stubs.append((header + "\n\n\n" if header else "") + stub + "\n")
            if len(stubs) >= n:
                return stubs
    return stubs


@functools.cache
def _eval_texts(domain: str, eval_rows: int) -> frozenset[str]:
    # Evaluation always uses load_prompts' default seed (0).
    return frozenset(p.text for p in load_prompts(domain, eval_rows))


def prompt_texts(domain: str, n_docs: int, *, seed: int = 0, eval_rows: int = EVAL_ROWS) -> list[str]:
    """``n_docs`` raw chat or math prompts from row ``eval_rows`` on.

    Chat rows past the offset are distinct from the evaluation rows by construction (the loader
    drops repeated texts; ``seed`` does not apply to chat). Math questions are generated per row,
    so a training question can equal an evaluation question by chance: those are skipped and
    further rows read instead (the first call generates the ``eval_rows`` evaluation questions,
    a few seconds for 1000).
    """
    if domain == "chat":
        return [p.text for p in load_prompts("chat", n_docs, offset=eval_rows)]
    if domain != "math":
        raise ValueError(f"prompt_texts handles chat and math, not {domain!r}")
    banned = _eval_texts("math", eval_rows)
    texts: list[str] = []
    offset = eval_rows
    while len(texts) < n_docs:
        batch = load_prompts("math", n_docs - len(texts), offset=offset, seed=seed)
        offset += len(batch)
        texts += [p.text for p in batch if p.text not in banned]
    return texts


def load_local_texts(path: str | Path, n_docs: int | None = None) -> list[str]:
    """Documents from a ``.jsonl``/``.txt``/``.parquet`` file or a ``datasets`` folder (the first
    ``n_docs``, or all)."""
    path = Path(path)
    if path.is_dir():
        texts = _datasets_folder_texts(path)
    elif path.suffix == ".jsonl":
        texts = _jsonl_texts(path)
    elif path.suffix == ".txt":
        texts = [path.read_text(encoding="utf-8")]
    elif path.suffix == ".parquet":
        texts = _parquet_texts(path)
    elif not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    else:
        raise ValueError(f"unsupported data file {str(path)!r}: expected {', '.join(LOCAL_SUFFIXES)} or a datasets folder")
    return texts if n_docs is None else texts[:n_docs]


def _jsonl_texts(path: Path) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' field")
            texts.append(text)
    return texts


def _text_column(names: Sequence[str], where: str) -> None:
    if "text" not in names:
        raise ValueError(f"{where} has no 'text' column; columns: {', '.join(names)}")


def _parquet_texts(path: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    names = pq.read_schema(path).names
    _text_column(names, str(path))
    return [str(t) for t in pq.read_table(path, columns=["text"]).column("text").to_pylist()]


def _datasets_folder_texts(path: Path) -> list[str]:
    if not any((path / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise ValueError(f"{path} is a folder but not a datasets folder written by save_to_disk")
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading the datasets folder {path} needs the datasets package: pip install datasets") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" in data:
            data = data["train"]
        elif len(data) == 1:
            data = next(iter(data.values()))
        else:
            raise ValueError(f"{path} holds splits {', '.join(data)}; save the one to train on, or a 'train' split")
    _text_column(data.column_names, str(path))
    return [str(t) for t in data["text"]]


def load_domain_texts(
    domain: str,
    n_docs: int,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    eval_rows: int = EVAL_ROWS,
) -> list[str]:
    """Up to ``n_docs`` training documents for ``domain`` (one of ``DOMAINS``) or from a local path.

    ``tokenizer`` renders chat and math prompts under its chat template (code and local files
    stay plain text); ``seed`` picks the standard-library files for code and the generated math
    questions. Raises ``EvalOverlapError`` if code text contains a HumanEval prompt.
    """
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    if domain == "code":
        texts = code_texts(n_docs, seed=seed)
        assert_no_eval_overlap(texts, load_prompts("code", HUMANEVAL_ROWS))
        return texts
    if domain in ("chat", "math"):
        return [render(t, tokenizer) for t in prompt_texts(domain, n_docs, seed=seed, eval_rows=eval_rows)]
    if Path(domain).exists():
        return load_local_texts(domain, n_docs)
    raise ValueError(
        f"unknown domain {domain!r}; valid domains: {', '.join(DOMAINS)}, or a path to a "
        f"{'/'.join(LOCAL_SUFFIXES)} file or a datasets folder"
    )


# --- the evaluation guard ---------------------------------------------------------------------


def find_eval_overlap(
    texts: Sequence[str], eval_prompts: Iterable[Prompt | str], *, min_chars: int = MIN_OVERLAP_CHARS
) -> list[tuple[int, str]]:
    """``(training text index, evaluation prompt id)`` for every training text that equals an
    evaluation prompt or, for prompts of at least ``min_chars`` characters, contains one verbatim
    (both compared without surrounding whitespace)."""
    exact: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        exact.setdefault(text.strip(), []).append(i)
    # One search per prompt over all texts joined by a character no prompt contains.
    haystack = "\x00".join(texts)
    starts = [0]
    for text in texts[:-1]:
        starts.append(starts[-1] + len(text) + 1)
    hits: set[tuple[int, str]] = set()
    for k, prompt in enumerate(eval_prompts):
        needle = (prompt.text if isinstance(prompt, Prompt) else prompt).strip()
        name = prompt.id if isinstance(prompt, Prompt) else f"#{k}"
        if not needle:
            continue
        hits.update((i, name) for i in exact.get(needle, []))
        if len(needle) < min_chars:
            continue
        pos = haystack.find(needle)
        while pos != -1:
            i = bisect.bisect_right(starts, pos) - 1
            hits.add((i, name))
            pos = haystack.find(needle, starts[i + 1] if i + 1 < len(starts) else len(haystack))
    return sorted(hits)


def assert_no_eval_overlap(
    texts: Sequence[str], eval_prompts: Iterable[Prompt | str], *, min_chars: int = MIN_OVERLAP_CHARS
) -> None:
    """Raise ``EvalOverlapError`` if any evaluation prompt appears in a training text (see
    ``find_eval_overlap``)."""
    hits = find_eval_overlap(texts, eval_prompts, min_chars=min_chars)
    if hits:
        i, name = hits[0]
        raise EvalOverlapError(
            f"{len(hits)} training text(s) contain evaluation prompts; first: text {i} contains "
            f"{name} ({texts[i][:80]!r}...). Train on rows past the evaluation rows or drop them."
        )


# --- rows -------------------------------------------------------------------------------------


def _encode(texts: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> Iterable[list[int]]:
    for start in range(0, len(texts), _ENCODE_BATCH):
        batch = list(texts[start : start + _ENCODE_BATCH])
        # verbose=False: documents longer than the model's context are expected here, they are cut into rows.
        yield from tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]


def tokenize_and_pack(
    texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, seq_len: int, eos_id: int
) -> torch.Tensor:
    """All documents' tokens, each followed by ``eos_id``, concatenated and cut into rows.

    Returns ``[N, seq_len]`` int64 with no padding (static shapes; every position is a real
    token to train on). The last partial row is dropped; ``N`` may be 0. Rows start mid-document
    and may span documents: the EOS teaches the draft where a document ends.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    eos = torch.tensor([eos_id], dtype=torch.long)
    pieces = []
    for ids in _encode(texts, tokenizer):
        pieces += [torch.tensor(ids, dtype=torch.long), eos]
    stream = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)  # [total]
    n_rows = stream.numel() // seq_len
    return stream[: n_rows * seq_len].view(n_rows, seq_len)  # [N, seq_len]


def pad_to_fixed(seqs: Sequence[Sequence[int]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per sequence, cut to ``seq_len`` and right-padded: ``(input_ids, labels)``, both
    ``[N, seq_len]``, ``labels`` equal to ``input_ids`` with -100 on padding.

    Padding is marked by position, not by value, so ``pad_id`` may equal a real token (Qwen pads
    with ``<|endoftext|>``). Right padding means a causal model never attends to padding from a
    real token, so no attention mask is needed for training.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    input_ids = torch.full((len(seqs), seq_len), pad_id, dtype=torch.long)  # [N, L]
    labels = torch.full((len(seqs), seq_len), IGNORE_INDEX, dtype=torch.long)  # [N, L]
    for row, seq in enumerate(seqs):
        ids = torch.as_tensor(list(seq[:seq_len]), dtype=torch.long)
        input_ids[row, : ids.numel()] = ids
        labels[row, : ids.numel()] = ids
    return input_ids, labels


def split_train_val(rows: Rows, val_fraction: float, seed: int = 0) -> tuple[Rows, Rows]:
    """``(train, val)``: a ``seed``-determined ``val_fraction`` of ``rows`` (a tensor's first
    dimension or a list) held out, each part in the original order.

    Uses its own ``random.Random(seed)``, so the split ignores and leaves alone every global RNG.
    Any ``val_fraction > 0`` holds out at least one row and always leaves one for training.
    Splitting packed rows can put two halves of one document on both sides; split documents
    before packing where that matters.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(rows)
    n_val = min(n - 1, max(1, round(n * val_fraction))) if val_fraction > 0 and n > 1 else 0
    val_set = set(random.Random(seed).sample(range(n), n_val))
    train_idx = [i for i in range(n) if i not in val_set]
    val_idx = sorted(val_set)
    if isinstance(rows, torch.Tensor):
        return rows[torch.tensor(train_idx, dtype=torch.long)], rows[torch.tensor(val_idx, dtype=torch.long)]
    return [rows[i] for i in train_idx], [rows[i] for i in val_idx]

"""The routing workload: six task families, like Spec-Bench's, with a fixed split by prompt.

    load_family("edit", "test", 5)        # five held-out code-editing prompts
    load_workload("train", 8)             # eight training prompts of every family
    split_of("HumanEval/12")              # "train", "val" or "test", forever

Families and where their prompts come from (``serving.prompts``, data shipped on PyPI):

* ``chat``: open chat and writing, the first user turn of ShareGPT conversations.
* ``code``: code generation, HumanEval stubs.
* ``edit``: code editing, rewriting, annotating or fixing a given standard-library function.
* ``extract``: extraction and summaries of a given passage (the ``extract`` and ``summarize``
  domains, alternating).
* ``math``: mathematics-dataset questions.
* ``quoted``: a question about a quoted multi-turn conversation.

``port`` is outside the six, for drift experiments (train on the six, then serve it): port a given
standard-library function to Rust. Its prompts look like ``edit``'s (instruction plus Python code),
but the answer repeats little of the code, so drafters that copy from the prompt do much worse
there than on edits.

The split is a function of the prompt id alone (a sha256 bucket: 60% train, 20% val, 20% test),
so it never depends on which prompts, drafts or settings a run picks: a test prompt is a test
prompt in every collection, benchmark and report. Drafts, router settings and K choices are fit
and tuned on ``train`` and ``val``; ``test`` is read only by the final evaluation. A workload
prompt's ``domain`` is its family's name, so rows, reports and the router's per-domain shrinkage
see families.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Iterator

from serving.prompts import Prompt, load_grounded, load_prompts

FAMILIES: dict[str, tuple[str, ...]] = {
    "chat": ("chat",),
    "code": ("code",),
    "edit": ("edit",),
    "extract": ("extract", "summarize"),
    "math": ("math",),
    "quoted": ("quoted",),
}
"""Family -> the ``serving.prompts`` domains it draws from (several: alternating)."""
SHIFTED = "port"
"""A family outside FAMILIES (see the module docstring)."""
_PORT_TASK = "Port this Python function to idiomatic Rust. Reply with the Rust code only."
SPLITS = ("train", "val", "test")
_BOUNDS = {"train": (0, 60), "val": (60, 80), "test": (80, 100)}  # percent buckets of the id hash
_CHUNK = 64  # rows read from a domain at a time while looking for a split's prompts


def split_of(prompt_id: str) -> str:
    """The split a prompt belongs to: a fixed function of its id."""
    bucket = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:4], "little") % 100
    return next(s for s, (lo, hi) in _BOUNDS.items() if lo <= bucket < hi)


def check_family(family: str) -> None:
    if family not in FAMILIES and family != SHIFTED:
        raise ValueError(f"unknown family {family!r}; the workload's families are {', '.join(FAMILIES)} "
                         f"(and {SHIFTED!r}, outside them)")  # fmt: skip


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")


def _domain_rows(domain: str, seed: int) -> Iterator[Prompt]:
    """Every row of a domain, in its fixed order, read a chunk at a time."""
    for offset in itertools.count(0, _CHUNK):
        chunk = load_prompts(domain, _CHUNK, offset=offset, seed=seed)
        yield from chunk
        if len(chunk) < _CHUNK:
            return


def _port_rows() -> Iterator[Prompt]:
    """``edit``'s standard-library functions, each once, with the porting task instead."""
    seen = set()
    for offset in itertools.count(0, _CHUNK):
        chunk = load_grounded("edit", _CHUNK, offset=offset)
        for g in chunk:
            if g.prompt.id not in seen:
                seen.add(g.prompt.id)
                yield Prompt(SHIFTED, g.prompt.id.replace("edit/", f"{SHIFTED}/", 1), f"{_PORT_TASK}\n\n```python\n{g.source}\n```")
        if len(chunk) < _CHUNK:
            return


def load_family(family: str, split: str, n: int, *, offset: int = 0, seed: int = 0) -> list[Prompt]:
    """Prompts ``offset .. offset+n-1`` of ``family``'s ``split`` (fewer if the family runs out:
    HumanEval has 164 prompts in all), labelled with the family as their domain."""
    check_family(family)
    check_split(split)
    if n < 0 or offset < 0:
        raise ValueError(f"n and offset must be >= 0, got n={n}, offset={offset}")
    if family == SHIFTED:
        sources = [_port_rows()]
    else:
        sources = [_domain_rows(d, seed) for d in FAMILIES[family]]
    # Alternate between a family's domains: row i of each, in turn.
    rows = (p for group in itertools.zip_longest(*sources) for p in group if p is not None)
    mine = (dataclasses.replace(p, domain=family) for p in rows if split_of(p.id) == split)
    return list(itertools.islice(mine, offset, offset + n))


def load_workload(split: str, n_per_family: int, *, families: tuple[str, ...] | list[str] | None = None,
                  offset: int = 0, seed: int = 0) -> list[Prompt]:
    """``load_family`` for each family (default: all six), concatenated in ``FAMILIES`` order."""
    return [p for f in (families or FAMILIES) for p in load_family(f, split, n_per_family, offset=offset, seed=seed)]

'''HumanEval-shaped code prompts that the target writes itself.

HumanEval (all 164 rows) is the code evaluation, so no HumanEval prompt may be trained on. The
target's answers to standard-library stubs teach a draft the target's library code, and that does
not carry over to HumanEval's short algorithmic tasks (docs/experiments/drafts-code.md). So
the target writes the training prompts: given two hand-written exercises in HumanEval's form
(signature, docstring, doctest examples) and a topic, it samples a third. ``parse_stub`` keeps a
well-formed stub and ``write_exercises`` drops any that shares a function name or a long line with a
HumanEval prompt; the target then answers the rest like any other on-policy prompt. (A whole
0.5B distilled on these answers did not gain on HumanEval either; a layer-cut student did: same record.)

    humaneval = [p.text for p in load_prompts("code", HUMANEVAL_ROWS)]
    stubs = write_exercises(target, tokenizer, 160, seed=0, cache=Path("runs/x/exercises.json"), eval_prompts=humaneval)
'''

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from pathlib import Path

from serving.engine import Request
from serving.engine.sampling import SamplingParams
from training.checkpoint import write_json_atomic
from training.generate import target_generate

FEW_SHOT = '''# Short Python exercises: each is a function signature and a docstring with examples.
from typing import Dict, List, Optional, Tuple


# Topic: runs of equal numbers
def count_runs(values: List[int]) -> int:
    """Count the maximal runs of equal adjacent numbers in the list.
    >>> count_runs([1, 1, 2, 2, 2, 1])
    3
    >>> count_runs([])
    0
    """


# Topic: digits of a number
def nonzero_digit_product(n: int) -> int:
    """Return the product of the non-zero digits of the positive integer n.
    >>> nonzero_digit_product(1203)
    6
    >>> nonzero_digit_product(7)
    7
    """


'''
"""The few-shot prefix: hand-written exercises, none taken from HumanEval."""

TOPICS = (
    "vowels in a word", "running maximum of a list", "roman numerals", "matrix transpose",
    "balanced brackets", "leap years", "binary strings", "anagrams", "prime factors",
    "integer sequences", "overlapping intervals", "grades and scores", "shifting letters",
    "sums of digits", "word frequencies", "pairs with a given sum", "sorting by a key",
    "greatest common divisor", "palindromes", "run-length encoding", "rotating a list",
    "even and odd positions", "nested lists", "temperature conversion", "clock times",
    "inverting a dictionary", "triangles", "perfect squares", "counting characters",
    "removing duplicates", "the longest word", "alternating signs", "counting bits",
    "number bases", "median of a list", "moving averages", "valid identifiers",
    "camelCase and snake_case", "points on a grid", "making change with coins",
    "stairs and steps", "prices and totals", "game scores", "splitting a string",
    "filtering a list", "the closest number", "counting words", "string padding",
)
"""One per request, in turn: the sampled exercises spread over topics instead of repeating one."""

_TYPING = ("Dict", "List", "Optional", "Tuple")


def exercise_prompt(topic: str) -> str:
    return f"{FEW_SHOT}# Topic: {topic}\ndef"  # no space: names are tokenized with theirs


def parse_stub(generated: str) -> str | None:
    """The HumanEval-shaped prompt in ``generated`` (what follows ``def`` up to, not including,
    the docstring's closing quotes and newline), or None unless it is one function whose body is
    a docstring with at least one ``>>>`` example. The typing names it uses are imported first,
    as HumanEval does."""
    stub = 'def' + generated.rstrip(' ') + '    """\n'
    try:
        tree = ast.parse(stub + "    pass\n")
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(fn := tree.body[0], ast.FunctionDef):
        return None
    doc = ast.get_docstring(fn)
    if not doc or ">>>" not in doc or len(fn.body) != 2:  # the docstring and the appended pass
        return None
    used = [name for name in _TYPING if re.search(rf"\b{name}\[", stub)]
    return (f"from typing import {', '.join(used)}\n\n\n" if used else "") + stub


def _function_name(stub: str) -> str:
    return re.search(r"^def\s+(\w+)", stub, re.M).group(1)  # type: ignore[union-attr]


def eval_leaks(stub: str, eval_prompts: Sequence[str], *, min_chars: int = 24) -> bool:
    """True if ``stub`` names a function an evaluation prompt defines, or has a line (from ``def``
    on) of at least ``min_chars`` characters, stripped of blanks and quotes, that occurs in one:
    the target may have seen HumanEval."""
    name = _function_name(stub)
    if any(re.search(rf"^def\s+{name}\s*\(", p, re.M) for p in eval_prompts):
        return True
    # From the def line on: the typing import is one HumanEval's prompts share.
    own = stub[re.search(r"^def\s", stub, re.M).start() :]  # type: ignore[union-attr]
    lines = [s for line in own.splitlines() if len(s := line.strip().strip('"').strip()) >= min_chars]
    return any(line in p for line in lines for p in eval_prompts)


def write_exercises(
    model, tokenizer, n: int, *, seed: int, cache: Path, eval_prompts: Sequence[str], max_new_tokens: int = 160
) -> list[str]:
    """Up to ``n`` distinct exercises the target samples (temperature 0.8, top-p 0.95, one seed and
    topic per request), minus malformed ones, repeats and any that ``eval_leaks``. What the target
    wrote is cached as JSON in ``cache`` and reused when it holds as many requests of this seed."""
    saved = json.loads(cache.read_text()) if cache.exists() else {}
    if saved.get("seed") == seed and saved.get("requests", 0) >= n:
        raw = saved["raw"][:n]
    else:
        requests = [
            Request(
                tokenizer.encode(exercise_prompt(TOPICS[i % len(TOPICS)]), add_special_tokens=False),
                SamplingParams(temperature=0.8, top_p=0.95, seed=seed * 1_000_003 + i),
                max_new_tokens=max_new_tokens,
                stop=('"""\n',),
            )
            for i in range(n)
        ]
        done = target_generate(model, tokenizer, requests, desc="the target writes code exercises")
        raw = [c.text if c.finish_reason == "stop" else "" for c in done]
        write_json_atomic(cache, {"seed": seed, "requests": n, "raw": raw})
    stubs, dropped = _keep(raw, eval_prompts)
    print(f"code exercises: {len(stubs)} of {n} kept ({dropped['malformed']} malformed, "
          f"{dropped['duplicate']} duplicate, {dropped['eval']} like a HumanEval prompt)")
    return stubs


def _keep(raw: Sequence[str], eval_prompts: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    stubs, names = [], set()
    dropped = {"malformed": 0, "duplicate": 0, "eval": 0}
    for text in raw:
        stub = parse_stub(text) if text else None
        if stub is None:
            dropped["malformed"] += 1
        elif _function_name(stub) in names:
            dropped["duplicate"] += 1
        elif eval_leaks(stub, eval_prompts):
            dropped["eval"] += 1
        else:
            names.add(_function_name(stub))
            stubs.append(stub)
    return stubs, dropped

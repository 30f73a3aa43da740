"""llguidance or xgrammar for structured outputs (issue 72, step 1): each library measured on this
machine's CPU with the target's tokenizer, on what a speculative server needs of it.

    python scripts/experiments/grammar_libraries.py --schemas 10 --tokens 300 --batch 8 --out runs/grammar-libraries

Neither library is a dependency of the project yet: run this in a virtualenv that has torch,
transformers and both libraries (``pip install torch==2.13.0 transformers llguidance xgrammar``).
``--libraries llguidance`` measures one alone. For each library, in rounds A, B, A, B (so that a
busy machine weighs on both alike; the load average before and after each is recorded):

1. Tokenizer setup: ``llguidance.hf.from_tokenizer`` / ``xgrammar.TokenizerInfo.from_huggingface``
   on the Hugging Face tokenizer (``--tokenizer``, the bundled target's by default), with the
   model's logits width (``config.json``'s ``vocab_size``: 151,936 for Qwen2.5, above the
   tokenizer's 151,665 tokens) as the mask width.
2. Compile per JSON schema: ten strict extraction schemas (names, dates, amounts, lists, nested
   objects, enums, required and optional fields, ``additionalProperties: false``) and
   ``json_object`` mode (any object). Timed: the compile (llguidance: the grammar and a new
   ``LLMatcher``; xgrammar: ``compile_json_schema`` with its cache cleared, and a ``GrammarMatcher``)
   and the first mask after it; then the same schema compiled again (xgrammar's compiler caches it,
   llguidance has no cache: a server keeps a matcher per schema and ``deep_copy``s it).
3. Masks at batch ``--batch``: one matcher per row, row r following schema r's sample answer
   (``json.dumps`` of a valid object, tokenized, then EOS; a row that ends starts again). Each step
   fills the [batch, ceil(V/32)] int32 bitmask for every row, then advances each row by one token,
   ``--tokens`` steps. Filled two ways: a Python loop over the rows, and the library's batch call
   on all cores (llguidance ``LLExecutor``, xgrammar ``BatchGrammarMatcher``).
4. What speculation needs, at K = ``--k``: advancing a row K tokens and rolling it back; validating a
   draft whose token j is wrong (llguidance ``validate_tokens``; xgrammar has no such call: accept
   until refused, then ``rollback``); the K + 1 masks of a verify step for the whole batch in one
   call (llguidance ``fill_next_token_bitmask_par_with_draft_tokens``, xgrammar
   ``traverse_draft_tree`` on a chain) against filling them one position at a time; forced tokens
   (llguidance ``compute_ff_tokens``, xgrammar ``find_jump_forward_tokens``); applying the bitmask to
   [batch, V] float32 logits (each library's CPU call, and a plain torch unpack for scale).
5. Agreement, untimed: at every position of every sample, the two libraries' allowed token sets
   with their default whitespace policy, and again with both set to compact JSON (no whitespace,
   separators "," and ":"); a difference is reported with the tokens only one side allows.

Writes ``grammar_libraries.json`` (command, date, machine, versions, installed sizes, every
measurement) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEFAULT_TOKENIZER = Path.home() / ".cache" / "choral" / "models" / "qwen2.5-coder-1.5b-instruct"
LIBRARIES = ("llguidance", "xgrammar")
DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
MONEY = {"type": "number", "minimum": 0}
CURRENCY = {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    """A strict object: every property named, none other allowed, ``required`` (default: all)."""
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}  # fmt: skip


def arr(items: dict, **bounds) -> dict:
    return {"type": "array", "items": items, **bounds}


S = {"type": "string"}
INT, NUM, BOOL = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}

# (name, schema, a valid answer): realistic extraction tasks, in the order --schemas takes them.
SCHEMAS: list[tuple[str, dict, dict]] = [
    ("person", obj({"full_name": S, "birth_date": DATE, "email": S, "nationality": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                   ["full_name", "birth_date", "age"]),
     {"full_name": "José María García", "birth_date": "1987-03-14", "email": "jm.garcia@example.com", "age": 39}),
    ("invoice", obj({"invoice_number": {"type": "string", "pattern": r"^INV-[0-9]{4,8}$"}, "issue_date": DATE, "due_date": DATE,
                     "vendor": obj({"name": S, "address": S, "vat_id": S}, ["name", "address"]),
                     "line_items": arr(obj({"description": S, "quantity": {"type": "integer", "minimum": 1}, "unit_price": MONEY, "amount": MONEY}), minItems=1),
                     "subtotal": MONEY, "tax": MONEY, "total": MONEY, "currency": CURRENCY}),
     {"invoice_number": "INV-20931", "issue_date": "2026-10-01", "due_date": "2026-10-31",
      "vendor": {"name": "Acme Office Supplies Ltd", "address": "12 High Street, Leeds LS1 4DY", "vat_id": "GB123456789"},
      "line_items": [{"description": "A4 paper, 5 reams", "quantity": 2, "unit_price": 21.5, "amount": 43.0},
                     {"description": "Black toner cartridge", "quantity": 1, "unit_price": 89.99, "amount": 89.99}],
      "subtotal": 132.99, "tax": 26.6, "total": 159.59, "currency": "GBP"}),
    ("event", obj({"title": S, "start_date": DATE, "end_date": DATE, "location": obj({"venue": S, "city": S, "country": S}),
                   "attendees": arr(S, maxItems=20), "is_virtual": BOOL}),
     {"title": "Quarterly planning offsite", "start_date": "2026-11-03", "end_date": "2026-11-04",
      "location": {"venue": "Hotel Adlon", "city": "Berlin", "country": "Germany"},
      "attendees": ["Priya Natarajan", "Tom O'Brien", "Mei Chen"], "is_virtual": False}),
    ("transaction", obj({"date": DATE, "merchant": S, "amount": NUM, "currency": CURRENCY,
                         "category": {"enum": ["groceries", "transport", "dining", "utilities", "rent", "entertainment", "other"]},
                         "note": {"type": ["string", "null"]}}, ["date", "merchant", "amount", "currency", "category"]),
     {"date": "2026-09-28", "merchant": "Whole Foods Market", "amount": -84.37, "currency": "USD", "category": "groceries", "note": None}),
    ("contact", obj({"name": obj({"first": S, "last": S}), "company": S,
                     "phones": arr(obj({"kind": {"enum": ["mobile", "work", "home"]}, "number": {"type": "string", "pattern": r"^\+?[0-9 ()-]{6,20}$"}})),
                     "emails": arr(S), "tags": arr(S)}, ["name", "phones", "emails"]),
     {"name": {"first": "Aisha", "last": "Okafor"}, "company": "Northwind Traders",
      "phones": [{"kind": "mobile", "number": "+44 7700 900123"}, {"kind": "work", "number": "(020) 7946 0018"}],
      "emails": ["aisha.okafor@northwind.example"], "tags": ["supplier", "priority"]}),
    ("job_posting", obj({"title": S, "company": S, "seniority": {"enum": ["intern", "junior", "mid", "senior", "staff", "principal"]},
                         "remote": BOOL, "salary": obj({"min": MONEY, "max": MONEY, "currency": CURRENCY, "period": {"enum": ["hour", "month", "year"]}}),
                         "skills": arr(S, minItems=1), "years_experience": {"type": "integer", "minimum": 0}}),
     {"title": "Backend Engineer (Python)", "company": "Fjord Analytics", "seniority": "senior", "remote": True,
      "salary": {"min": 85000, "max": 110000, "currency": "EUR", "period": "year"},
      "skills": ["Python", "PostgreSQL", "Kubernetes", "gRPC"], "years_experience": 5}),
    ("review", obj({"product": S, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                    "sentiment": {"enum": ["positive", "neutral", "negative"]}, "pros": arr(S), "cons": arr(S), "summary": S}),
     {"product": "Kettle Pro 1.7L", "rating": 4, "sentiment": "positive", "pros": ["boils fast", "quiet"],
      "cons": ["lid sticks"], "summary": "Good value kettle with a slightly awkward lid."}),
    ("address", obj({"street": S, "city": S, "postal_code": S, "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                     "geo": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}})},
                    ["street", "city", "country_code"]),
     {"street": "221B Baker Street", "city": "London", "postal_code": "NW1 6XE", "country_code": "GB",
      "geo": {"lat": 51.5237, "lon": -0.1585}}),
    ("meeting_notes", obj({"meeting_date": DATE, "decisions": arr(S),
                           "action_items": arr(obj({"owner": S, "task": S, "due_date": {"anyOf": [DATE, {"type": "null"}]},
                                                    "priority": {"enum": ["low", "medium", "high"]}}))}),
     {"meeting_date": "2026-10-12", "decisions": ["Ship v2 API on Nov 1", "Freeze schema changes"],
      "action_items": [{"owner": "Dana", "task": "Write migration guide", "due_date": "2026-10-20", "priority": "high"},
                       {"owner": "Luis", "task": "Check load test results", "due_date": None, "priority": "medium"}]}),
    ("flight_booking", obj({"booking_reference": {"type": "string", "pattern": "^[A-Z0-9]{6}$"},
                            "passengers": arr(obj({"first_name": S, "last_name": S, "date_of_birth": DATE}), minItems=1, maxItems=9),
                            "segments": arr(obj({"flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
                                                 "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                 "departure": S, "cabin": {"enum": ["economy", "premium_economy", "business", "first"]}}), minItems=1),
                            "total_price": MONEY, "currency": CURRENCY}),
     {"booking_reference": "Q7XK2P",
      "passengers": [{"first_name": "Lena", "last_name": "Schmidt", "date_of_birth": "1990-07-22"},
                     {"first_name": "Jonas", "last_name": "Schmidt", "date_of_birth": "2018-02-05"}],
      "segments": [{"flight_number": "LH123", "from": "FRA", "to": "JFK", "departure": "2026-12-20T10:35", "cabin": "economy"}],
      "total_price": 1460.2, "currency": "EUR"}),
]  # fmt: skip
JSON_OBJECT = ("json_object", {"type": "object"},
               {"answer": "The meeting moved to Thursday.", "confidence": 0.82, "sources": [1, 4], "meta": {"checked": True}})  # fmt: skip


def quantiles(values: list[float]) -> dict:
    """Median, p90, max and mean of ``values`` (milliseconds), rounded for the record."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"n": len(values), "median": round(statistics.median(values), 4), "p90": round(p90, 4),
            "max": round(ordered[-1], 4), "mean": round(statistics.fmean(values), 4)}  # fmt: skip


def ms_since(t0: float) -> float:
    return 1e3 * (time.perf_counter() - t0)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def allowed(row) -> set[int]:
    """The token ids whose bit is set in one int32 bitmask row (numpy array or torch tensor)."""
    import numpy as np

    row = row.numpy() if hasattr(row, "numpy") else row
    return set(np.nonzero(np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little"))[0].tolist())


# ---- sizes ---------------------------------------------------------------------------------------


def closure(dist_name: str) -> dict[str, float]:
    """A distribution and, recursively, the requirements it declares (those installed here, less
    those of an extra: a requirement's platform marker is not evaluated, so this is what pip laid
    down on this machine): name -> MiB of its files on disk."""
    import re
    from importlib import metadata

    seen, sizes, todo = set(), {}, [dist_name]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        total = 0
        for f in dist.files or []:
            try:
                total += os.path.getsize(f.locate())
            except OSError:
                pass
        sizes[dist.metadata["Name"]] = round(total / 2**20, 1)
        for spec in dist.requires or []:
            if "extra ==" not in spec.partition(";")[2]:
                todo.append(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec).group())
    return sizes


def installed_size(dist_name: str) -> dict:
    """What ``pip install NAME`` lays down here: the library, everything it pulls, and what it pulls
    beyond torch and transformers (and theirs), which Choral installs anyway."""
    sizes = closure(dist_name)
    have = set(closure("torch")) | set(closure("transformers"))
    beyond = {n: v for n, v in sizes.items() if n not in have}
    return {"own_mib": sizes.get(next(iter(sizes), ""), 0.0), "with_requirements_mib": round(sum(sizes.values()), 1),
            "beyond_torch_transformers_mib": round(sum(beyond.values()), 1),
            "beyond_torch_transformers": dict(sorted(beyond.items(), key=lambda kv: -kv[1])),
            "requirements_mib": dict(sorted(sizes.items(), key=lambda kv: -kv[1]))}  # fmt: skip


# ---- the two libraries behind one interface --------------------------------------------------------
# Imported by name at run time: neither is a dependency of the project (tests/test_dependencies.py
# reads the imports of scripts/), and this script's --help runs without them.


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int | None, threads: int):
        self.lib = import_module("llguidance")
        self.np = import_module("llguidance.numpy")
        t0 = time.perf_counter()
        self.tokenizer = import_module("llguidance.hf").from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.setup_ms = ms_since(t0)
        self.width = self.tokenizer.vocab_size
        self.eos = self.tokenizer.eos_token
        self.executor = self.lib.LLExecutor(threads)
        self.version = self.lib.__version__

    def compile(self, schema: dict, compact: bool = False, fresh: bool = True):
        overrides = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"} if compact else None
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher  # the compiled form: new matchers are deep copies of it

    def matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, rows: int):
        return self.np.allocate_token_bitmask(rows, self.width)

    def fill(self, matcher, bitmask, index: int = 0):
        self.np.fill_next_token_bitmask(matcher, bitmask, index)

    def fill_batch(self, matchers, bitmask):
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_drafts(self, matchers, drafts, bitmask):
        """The K + 1 masks of each row's verify (row i's at i * (K + 1) ...), state unchanged."""
        k1 = len(drafts[0]) + 1
        self.np.fill_next_token_bitmask_par_with_draft_tokens(
            self.executor, [(m, i * k1, d) for i, (m, d) in enumerate(zip(matchers, drafts))], bitmask
        )

    def advance(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def advance_many(self, matcher, tokens: list[int]) -> bool:
        return matcher.consume_tokens(tokens)

    def rollback(self, matcher, n: int):
        matcher.rollback(n)

    def validate(self, matcher, tokens: list[int]) -> int:
        return matcher.validate_tokens(tokens)

    def forced(self, matcher) -> list[int]:
        return matcher.compute_ff_tokens()

    def reset(self, matcher):
        matcher.reset()

    def done(self, matcher) -> bool:
        return matcher.is_stopped()

    def apply(self, logits, bitmask):
        self.np.apply_token_bitmask_inplace(logits.numpy(), bitmask)

    def apply_compiled(self, logits, bitmask):
        import torch

        import_module("llguidance.torch").apply_token_bitmask_inplace(logits, torch.from_numpy(bitmask))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int | None, threads: int):
        self.lib = import_module("xgrammar")
        t0 = time.perf_counter()
        self.info = self.lib.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.setup_ms = ms_since(t0)
        self.compiler = self.lib.GrammarCompiler(self.info, max_threads=threads)
        self.batch = self.lib.BatchGrammarMatcher(max_threads=threads)
        self.width = self.info.vocab_size
        self.eos = self.info.stop_token_ids[0]
        from importlib import metadata

        self.version = metadata.version("xgrammar")

    def compile(self, schema: dict, compact: bool = False, fresh: bool = True):
        if fresh:
            self.compiler.clear_cache()
        options = {"strict_mode": False} if schema == JSON_OBJECT[1] else {}  # json_object: any object
        if compact:
            options |= {"any_whitespace": False, "separators": (",", ":")}
        compiled = self.compiler.compile_json_schema(schema, **options)
        return compiled

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        return self.lib.allocate_token_bitmask(rows, self.width)

    def fill(self, matcher, bitmask, index: int = 0):
        matcher.fill_next_token_bitmask(bitmask, index)

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_drafts(self, matchers, drafts, bitmask):
        import torch

        k = len(drafts[0])
        nxt = torch.tensor([*range(1, k + 1), -1], dtype=torch.int64)
        sibling = torch.full((k + 1,), -1, dtype=torch.int64)
        for i, (m, d) in enumerate(zip(matchers, drafts)):
            tokens = torch.tensor([0, *d], dtype=torch.int64)  # node 0 is the current state
            m.traverse_draft_tree(nxt, sibling, tokens, bitmask[i * (k + 1) : (i + 1) * (k + 1)])

    def advance(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def advance_many(self, matcher, tokens: list[int]) -> bool:
        return all(matcher.accept_token(t) for t in tokens)

    def rollback(self, matcher, n: int):
        matcher.rollback(n)

    def validate(self, matcher, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if not matcher.accept_token(t):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def forced(self, matcher) -> list[int]:
        return matcher.find_jump_forward_tokens()

    def reset(self, matcher):
        matcher.reset()

    def done(self, matcher) -> bool:
        return matcher.is_terminated()

    def apply(self, logits, bitmask):
        self.lib.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")

    def apply_compiled(self, logits, bitmask):
        self.lib.apply_token_bitmask_inplace(logits, bitmask, backend="torch_compile")


def torch_apply(logits, bitmask):
    """A plain torch unpack of the bitmask onto the logits (no library, no compile), for scale:
    each byte of the mask through a [256, 8] table of bits."""
    import torch

    bitmask = bitmask if isinstance(bitmask, torch.Tensor) else torch.from_numpy(bitmask)
    table = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
    bits = table[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(~bits, float("-inf"))


# ---- measurements ------------------------------------------------------------------------------------


def sequences(hf_tokenizer, cases, eos: int, compact: bool = False) -> list[list[int]]:
    separators = (",", ":") if compact else None
    return [hf_tokenizer.encode(json.dumps(answer, ensure_ascii=False, separators=separators), add_special_tokens=False) + [eos]
            for _, _, answer in cases]  # fmt: skip


def measure_compile(lib, cases, reps: int) -> dict:
    rows = []
    for name, schema, _ in cases:
        cold, first_mask, again, copy = [], [], [], []
        bitmask = lib.bitmask(1)
        for _ in range(reps):
            t0 = time.perf_counter()
            compiled = lib.compile(schema)
            matcher = lib.matcher(compiled)
            cold.append(ms_since(t0))
            t0 = time.perf_counter()
            lib.fill(matcher, bitmask)
            first_mask.append(ms_since(t0))
            t0 = time.perf_counter()
            lib.matcher(lib.compile(schema, fresh=False))
            again.append(ms_since(t0))
            t0 = time.perf_counter()
            lib.matcher(compiled)
            copy.append(ms_since(t0))
        rows.append({"schema": name, "compile_ms": round(statistics.median(cold), 3),
                     "first_mask_ms": round(statistics.median(first_mask), 3), "again_ms": round(statistics.median(again), 3),
                     "new_matcher_ms": round(statistics.median(copy), 4)})  # fmt: skip
    strict = [r for r in rows if r["schema"] != JSON_OBJECT[0]]
    return {"per_schema": rows, "compile_ms": quantiles([r["compile_ms"] for r in strict]),
            "first_mask_ms": quantiles([r["first_mask_ms"] for r in strict]),
            "again_ms": quantiles([r["again_ms"] for r in strict]),
            "new_matcher_ms": quantiles([r["new_matcher_ms"] for r in strict])}  # fmt: skip


def measure_masks(lib, compiled, seqs, batch: int, steps: int, mode: str) -> dict:
    """``steps`` batch steps: fill every row's mask (``mode``: a loop, or the batch call), then
    advance each row one token along its sample; a row past its EOS starts its sample again."""
    rows = [i % len(seqs) for i in range(batch)]
    matchers = [lib.matcher(compiled[r]) for r in rows]
    at = [0] * batch
    bitmask = lib.bitmask(batch)
    fill, advance, rejected = [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        if mode == "batch":
            lib.fill_batch(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                lib.fill(m, bitmask, i)
        fill.append(ms_since(t0))
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            rejected += not lib.advance(m, seqs[rows[i]][at[i]])
            at[i] += 1
        advance.append(ms_since(t0))
        for i, m in enumerate(matchers):
            if at[i] == len(seqs[rows[i]]):
                lib.reset(m)
                at[i] = 0
    return {"fill_ms": quantiles(fill), "advance_ms": quantiles(advance),
            "step_ms": quantiles([f + a for f, a in zip(fill, advance)]), "rejected_tokens": rejected}  # fmt: skip


def measure_speculation(lib, compiled, seqs, bad_token: int, k: int, batch: int) -> dict:
    """Per position t of each sample: advance K then roll back; validate a draft whose token
    (t mod K) is wrong; forced tokens. And the K + 1 verify masks of a batch in one call against
    filling them one position at a time (checked equal)."""
    cycle, validate, forced, forced_positions, forced_tokens, counts = [], [], [], 0, 0, []
    for compiled_one, seq in zip(compiled, seqs):
        m = lib.matcher(compiled_one)
        for t in range(len(seq) - 1):
            ahead = seq[t : t + k]
            t0 = time.perf_counter()
            lib.advance_many(m, ahead)
            lib.rollback(m, len(ahead))
            cycle.append(ms_since(t0))
            draft = list(ahead)
            draft[t % len(draft)] = bad_token
            t0 = time.perf_counter()
            counts.append(lib.validate(m, draft))
            validate.append(ms_since(t0))
            t0 = time.perf_counter()
            ff = lib.forced(m)
            forced.append(ms_since(t0))
            forced_positions += bool(ff)
            forced_tokens += len(ff)
            lib.advance(m, seq[t])
    # verify masks: batch rows at positions spread over their samples, drafts = the next K tokens
    one_call, stepwise, same = [], [], True
    width_rows = batch * (k + 1)
    for offset in range(0, max(len(s) for s in seqs) - k - 1, max(1, k)):
        rows = [i % len(seqs) for i in range(batch)]
        starts = [min(offset, len(seqs[r]) - k - 1) for r in rows]
        matchers = [lib.matcher(compiled[r]) for r in rows]
        for m, r, s in zip(matchers, rows, starts):
            lib.advance_many(m, seqs[r][:s])
        drafts = [seqs[r][s : s + k] for r, s in zip(rows, starts)]
        a = lib.bitmask(width_rows)
        t0 = time.perf_counter()
        lib.fill_drafts(matchers, drafts, a)
        one_call.append(ms_since(t0))
        b = lib.bitmask(width_rows)
        t0 = time.perf_counter()
        for i, (m, d) in enumerate(zip(matchers, drafts)):
            for j in range(k + 1):
                lib.fill(m, b, i * (k + 1) + j)
                if j < k:
                    lib.advance(m, d[j])
            lib.rollback(m, k)
        stepwise.append(ms_since(t0))
        same &= bool((a == b).all())
    return {"advance_k_rollback_ms": quantiles(cycle), "validate_draft_ms": quantiles(validate),
            "validate_counts": counts, "forced_tokens_ms": quantiles(forced),
            "positions_with_forced_tokens": forced_positions, "forced_tokens_total": forced_tokens, "positions": len(forced),
            "verify_masks_one_call_ms": quantiles(one_call), "verify_masks_stepwise_ms": quantiles(stepwise),
            "verify_masks_equal": same}  # fmt: skip


def measure_apply(lib, batch: int, reps: int, compiled_apply: bool) -> dict:
    import torch

    bitmask = lib.bitmask(batch)
    bitmask[:, ::3] = 0  # some tokens masked
    logits = torch.randn(batch, lib.width)
    out = {}
    calls = [("library_cpu", lib.apply), ("plain_torch", torch_apply)]
    if compiled_apply:
        calls.append(("library_torch_compile", lib.apply_compiled))
    for name, fn in calls:
        t0 = time.perf_counter()
        fn(logits.clone(), bitmask)
        first = ms_since(t0)
        times = []
        for _ in range(reps):
            x = logits.clone()
            t0 = time.perf_counter()
            fn(x, bitmask)
            times.append(ms_since(t0))
        out[name] = {"first_call_ms": round(first, 2), **quantiles(times)}
    ref = logits.clone()
    torch_apply(ref, bitmask)
    x = logits.clone()
    lib.apply(x, bitmask)
    out["library_cpu_equals_plain_torch"] = bool(torch.equal(x, ref))
    return out


def run_library(lib, cases, seqs, args, bad_token: int) -> dict:
    before = load_average()
    result = {"tokenizer_setup_ms": round(lib.setup_ms, 1)}
    result["compile"] = measure_compile(lib, cases, args.reps)
    compiled = [lib.compile(schema, fresh=False) for _, schema, _ in cases]
    result["masks"] = {mode: measure_masks(lib, compiled, seqs, args.batch, args.tokens, mode) for mode in ("loop", "batch")}
    result["speculation"] = measure_speculation(lib, compiled, seqs, bad_token, args.k, args.batch)
    result["apply"] = measure_apply(lib, args.batch, args.reps * 10, args.compiled_apply)
    result["load_average_before"], result["load_average_after"] = before, load_average()
    return result


def agreement(libs, hf_tokenizer, cases, compact: bool, examples: int = 6) -> dict:
    """Each position of each sample: the allowed sets of the two libraries (same policy). A token
    only one side allows is classed as an added token (the tokenizer's ``<|...|>`` and
    ``<tool_call>`` entries), a string escape (its text has a backslash), a piece of forced text
    (the other side allows a few tokens there, one of which this token's text starts or is the start
    of: another tokenization of the same forced bytes), or other (shown in the examples)."""
    a, b = libs
    added = set(hf_tokenizer.added_tokens_decoder)
    seqs = sequences(hf_tokenizer, cases, a.eos, compact)
    same, positions, shown, seen = 0, 0, [], set()
    rejected = {a.name: 0, b.name: 0}
    classes = ("positions", "added_token", "escape", "forced_text_split", "other")
    only = {a.name: dict.fromkeys(classes, 0), b.name: dict.fromkeys(classes, 0)}

    def classify(side: str, tokens: set[int], theirs: set[int]) -> list[int]:
        others = []
        only[side]["positions"] += bool(tokens)
        forced = [hf_tokenizer.decode([i]) for i in theirs] if len(theirs) <= 16 else []
        for i in tokens:
            text = hf_tokenizer.decode([i])
            if i in added:
                only[side]["added_token"] += 1
            elif "\\" in text:
                only[side]["escape"] += 1
            elif text and any(f != text and (f.startswith(text) or text.startswith(f)) for f in forced):
                only[side]["forced_text_split"] += 1
            else:
                only[side]["other"] += 1
                others.append(i)
        return others

    for (name, schema, _), seq in zip(cases, seqs):
        ma, mb = a.matcher(a.compile(schema, compact)), b.matcher(b.compile(schema, compact))
        ba, bb = a.bitmask(1), b.bitmask(1)
        for t, token in enumerate(seq):
            a.fill(ma, ba)
            b.fill(mb, bb)
            sa, sb = allowed(ba[0]), allowed(bb[0])
            positions += 1
            if sa == sb:
                same += 1
            else:
                other_a, other_b = classify(a.name, sa - sb, sb), classify(b.name, sb - sa, sa)
                key = (tuple(sorted(other_a)), tuple(sorted(other_b)))
                if (other_a or other_b) and key not in seen and len(shown) < examples:
                    seen.add(key)
                    shown.append({"schema": name, "after": hf_tokenizer.decode(seq[:t])[-40:], "allowed": {a.name: len(sa), b.name: len(sb)},
                                  f"other_only_{a.name}": [repr(hf_tokenizer.decode([i])) for i in sorted(other_a)[:8]],
                                  f"other_only_{b.name}": [repr(hf_tokenizer.decode([i])) for i in sorted(other_b)[:8]]})  # fmt: skip
            rejected[a.name] += not a.advance(ma, token)
            rejected[b.name] += not b.advance(mb, token)
    return {"positions": positions, "identical": same, "tokens_only_one_allows": only, "sample_tokens_rejected": rejected,
            "examples_of_other": shown}  # fmt: skip


def summary_table(results: dict) -> str:
    lines = ["| library | tokenizer setup ms | compile ms median / max | cached again ms | mask step ms median / p90 (loop) | (batch call) | advance K=4 + rollback ms | validate ms | verify masks one call ms | forced tokens ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        c, m, s = r["compile"], r["masks"], r["speculation"]
        lines.append(f"| {name} | {r['tokenizer_setup_ms']} | {c['compile_ms']['median']} / {c['compile_ms']['max']} | {c['again_ms']['median']}"
                     f" | {m['loop']['step_ms']['median']} / {m['loop']['step_ms']['p90']} | {m['batch']['step_ms']['median']} / {m['batch']['step_ms']['p90']}"
                     f" | {s['advance_k_rollback_ms']['median']} | {s['validate_draft_ms']['median']} | {s['verify_masks_one_call_ms']['median']}"
                     f" | {s['forced_tokens_ms']['median']} |")  # fmt: skip
    return "\n".join(lines)


def pooled(rounds: list[dict]) -> dict:
    """The rounds of one library into one record: the median of each number over the rounds."""
    if len(rounds) == 1:
        return rounds[0]

    def merge(values):
        first = values[0]
        if isinstance(first, dict):
            return {key: merge([v[key] for v in values]) for key in first}
        if isinstance(first, list):
            return first if not first or not isinstance(first[0], dict) else [merge(list(x)) for x in zip(*values)]
        if isinstance(first, bool) or not isinstance(first, (int, float)):
            return first if all(v == first for v in values) else values
        return round(statistics.median(values), 4)

    return merge(rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="a Hugging Face folder with tokenizer.json (and config.json for the logits width)")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated: llguidance, xgrammar")
    parser.add_argument("--schemas", type=int, default=len(SCHEMAS), help=f"how many of the {len(SCHEMAS)} strict schemas (json_object mode is added)")
    parser.add_argument("--tokens", type=int, default=300, help="batch steps timed in the mask loop")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="draft length for rollback, validation and verify masks")
    parser.add_argument("--reps", type=int, default=3, help="compiles per schema (the median is kept)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of A, B (each library measured once a round)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the libraries' batch calls and compiler")
    parser.add_argument("--compiled-apply", action=argparse.BooleanOptionalAction, default=True,
                        help="also time each library's torch.compile'd bitmask apply (its first call compiles)")  # fmt: skip
    parser.add_argument("--out", default="runs/grammar-libraries")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from serving.engine.devices import describe_machine

    names = [n.strip() for n in args.libraries.split(",") if n.strip()]
    unknown = set(names) - set(LIBRARIES)
    if unknown:
        parser.error(f"unknown libraries {sorted(unknown)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(args.tokenizer)
    config = folder / "config.json"
    vocab_size = json.loads(config.read_text()).get("vocab_size") if config.exists() else None
    t0 = time.perf_counter()
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    hf_load_ms = ms_since(t0)
    cases = SCHEMAS[: args.schemas] + [JSON_OBJECT]
    classes = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    libs = {}
    for r in range(args.rounds):
        for name in names:
            before = load_average()
            lib = classes[name](hf_tokenizer, vocab_size, args.threads)  # tokenizer set up again each round: timed
            libs[name] = lib
            seqs = sequences(hf_tokenizer, cases, lib.eos)
            bad_token = hf_tokenizer.encode("}}]", add_special_tokens=False)[0]
            result = run_library(lib, cases, seqs, args, bad_token)
            result["load_average_before"] = before
            rounds[name].append(result)
            print(f"round {r + 1} {name}: load {before} -> {result['load_average_after']}", flush=True)
    results = {n: pooled(rs) for n, rs in rounds.items()}
    for n, rs in rounds.items():
        results[n]["load_averages"] = [[x["load_average_before"], x["load_average_after"]] for x in rs]
        results[n]["per_round_mask_step_ms_median"] = [x["masks"]["loop"]["step_ms"]["median"] for x in rs]
        results[n]["version"] = libs[n].version
        results[n]["mask_width"] = libs[n].width
        results[n]["installed"] = installed_size(n)
    checks = {}
    if len(libs) == 2:
        pair = [libs[n] for n in LIBRARIES]
        checks = {"default_whitespace": agreement(pair, hf_tokenizer, cases, compact=False),
                  "compact": agreement(pair, hf_tokenizer, cases, compact=True)}  # fmt: skip
    record = {
        "command": "python scripts/experiments/grammar_libraries.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
        "tokenizer": str(folder), "tokenizer_tokens": len(hf_tokenizer), "logits_width": vocab_size,
        "hf_tokenizer_load_ms": round(hf_load_ms, 1), "batch": args.batch, "k": args.k, "threads": args.threads,
        "schemas": [{"name": n, "schema": s, "answer": a, "tokens": len(q)} for (n, s, a), q in zip(cases, sequences(hf_tokenizer, cases, 0))],
        "torch": torch.__version__, "results": results, "agreement": checks,
    }  # fmt: skip
    (out / "grammar_libraries.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(summary_table(results))
    print(f"wrote {out / 'grammar_libraries.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

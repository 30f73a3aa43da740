"""The drafter conformance kit (issue 70): one set of checks that every drafter kind runs, on tiny
models, through the engine's public API only (``SpeculativeEngine``, ``Request``, ``Completion``,
the ``Verifier`` it verifies with and the drafter protocol of ``serving.engine.drafters.base``).

A new drafter kind gets every check here by adding one entry to the kit's table, ``KINDS`` (its
name -> how to build the engine's drafters for it); ``test_every_drafter_kind_is_in_the_kit``
fails, naming the kind, while a drafter class of ``serving.engine.drafters`` or a built-in of
``serving.engine.drafters.registry`` has no entry.

The kinds: every built-in (``ngram``, ``suffix``, ``prediction``, ``auto``), the model drafter (a
tiny draft model), an ``eagle3`` head, and ``random_length``, a test-only host drafter whose
proposals have random lengths (0..k, from a hash of the row's own tokens), so short and empty
proposals meet every check. The properties, each for every kind:

1. greedy output is the target's alone, alone and in every slot of a mixed batch;
2. seeded sampled output and the drafter's statistics do not depend on the batch, with per-request
   K (1 beside 3 beside 8);
3. a neighbour whose drafter raises mid-step (after every other drafter proposed, so the engine
   runs each row alone again): every other row finishes with its solo output and statistics;
4. a row that skipped steps (``step_k="goodput"`` capping it at 0, ``auto`` choosing another
   drafter) proposes what a row that never skipped proposes;
5. token origins are what each step did (draft / correction / bonus / target);
6. threshold rows beside exact rows: exact rows unchanged, no threshold row accepts padding;
7. a request's K bounds its drafts per step, whatever K its neighbours have;
8. (slow) sampled output follows the target's distribution (joint chi-square of three tokens).

What each step proposed and what the target answered is read off the engine's verifier (a spy
around ``engine.verifier.verify``: the ``VerifyBatch`` holds every row's proposal), and ``auto``'s
choices off its ``choose``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import pkgutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from serving.engine.core import SpeculativeEngine
from serving.engine.drafters import registry
from serving.engine.drafters.auto import AutoDrafter
from serving.engine.drafters.base import BatchDrafter, Drafter, HostDrafter, RoutingDrafter
from serving.engine.drafters.eagle3 import Eagle3Drafter
from serving.engine.engine_settings import EngineConfig, EngineSettings, SuffixSettings
from serving.engine.goodput import RowCosts
from serving.engine.request import Request, RequestFailed, TokenOrigin
from serving.engine.sampling import SamplingParams
from tests.conftest import perturbed, tiny_qwen2
from tests.test_eagle3 import peaked_target  # its greedy answers loop: the copying drafters' proposals are accepted
from tests.test_engine_tiny import hf_greedy, ragged_prompts

pytestmark = pytest.mark.integration

MAX_NEW = 20  # tokens per request: short, the kit runs every kind
K = 3  # the engine's K; requests set their own (1, 8) up to request_k_max
K_MAX = 8


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed)


# ---- test-only drafters ----------------------------------------------------------------------


class RandomLength(HostDrafter):
    """Proposes 0..k tokens, the count from a hash of the row's tokens (so a proposal depends on the
    row's own tokens only, and is empty or short as often as long): the tokens that followed the
    last earlier occurrence of the row's last token, repeating that span (the tiny target's answers
    loop, so these are often accepted), one of them replaced by another of the row's tokens."""

    kind = "random_length"

    def propose(self, row, tokens, k):
        h = zlib.crc32(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
        n = h % (k + 1)
        if n == 0:
            return []
        last = tokens[-1]
        before = [j for j in range(len(tokens) - 1) if tokens[j] == last]
        if before:
            span = list(tokens[before[-1] + 1 :])
            out = [span[i % len(span)] for i in range(n)]
        else:
            out = [last] * n
        wrong = (h >> 8) % 6  # at or past n: nothing replaced
        if wrong < n:
            out[wrong] = tokens[(h >> 12) % len(tokens)]
        return out


class Raising(BatchDrafter):
    """A neighbour that raises mid-step: ``propose_rows`` drafts nothing, and from its ``at``-th call
    with a row of its own (counted from its last ``start``) raises whenever the step holds other
    rows too. The engine has it last, so every other drafter has proposed the step before it raises;
    the engine then runs each row alone, where it proposes nothing and its request goes on: every
    later step of its neighbours is run twice, first in the batch (raising), then alone."""

    kind = "raising"

    def __init__(self, at: int = 2) -> None:
        self.at, self.calls, self.rows, self.raised = at, 0, set(), 0

    def start(self, row, ctx):
        self.rows.add(row)
        self.calls = 0

    def stop(self, row, finished):
        self.rows.discard(row)

    def propose_rows(self, batch):
        mine = [b for b in self.rows if b < len(batch.budgets) and batch.budgets[b]]
        if not mine:
            return None
        self.calls += 1
        running = int((~batch.state.done).sum())  # a row run alone: the others sit it out (done)
        if self.calls >= self.at and running > len(mine):
            self.raised += 1
            raise RuntimeError(f"the raising neighbour raises on its call {self.calls}")
        return None


# ---- the kit's table -------------------------------------------------------------------------


@dataclass
class Models:
    target: Any
    draft: Any
    head: Any


# auto's choices priced by fixed costs (not measured ones), so they depend on the row's own tokens
# only, in every engine: a draft forward is cheap next to a verify (so auto drafts the model's
# whole K when its record is fair), a wider verify a little dearer, a catch-up dearer with its width.
AUTO_COSTS = RowCosts(verify=[[1, 30.0], [2, 31.0], [3, 32.0], [4, 33.0], [5, 34.0], [9, 38.0]],
                      model={"model": [[1, 2.0], [2, 2.2], [4, 2.4], [16, 4.0], [64, 10.0]]},
                      host={"ngram": 0.01, "suffix": 0.01})  # fmt: skip
SETTINGS = EngineSettings(suffix=SuffixSettings(max_cached_requests=0))  # suffix: each row's own tokens only


def _auto(models: Models) -> dict:
    a = SETTINGS.auto
    auto = AutoDrafter(("model", "ngram", "suffix"), prior_a=a.prior_a, default_prior=a.default_prior,
                       prior_weight=a.prior_weight, catch_up_weight=a.catch_up_weight, costs=AUTO_COSTS)  # fmt: skip
    hosts = {name: registry.build(name, SETTINGS) for name in ("ngram", "suffix")}
    return {"model": models.draft, **hosts, "auto": auto}


@dataclass(frozen=True)
class Kind:
    """One drafter kind of the kit. ``build``: the engine's drafters for it (name -> drafter, or a
    draft model), the kind's own name among them, new ones on every call. ``prediction``: its
    requests carry a prediction (the prediction drafter drafts only those). ``fresh``: a fresh row
    admitted on a row's committed tokens is what that row's drafter must propose from (False where
    the proposal depends on where the prompt ends: the prediction aligns the answer only).
    ``grammar``: its requests (those without processors of their own) carry a grammar forcing the
    target's own greedy answer token by token (the grammar drafter drafts only what a grammar
    forces; the output stays the target's; a fresh row's grammar is its own prompt's answer)."""

    build: Callable[[Models], dict]
    prediction: bool = False
    grammar: bool = False
    fresh: bool = True


KINDS: dict[str, Kind] = {
    "ngram": Kind(lambda m: {"ngram": registry.build("ngram", SETTINGS)}),
    "suffix": Kind(lambda m: {"suffix": registry.build("suffix", SETTINGS)}),
    "prediction": Kind(lambda m: {"prediction": registry.build("prediction", SETTINGS)}, prediction=True, fresh=False),
    "auto": Kind(_auto),
    "model": Kind(lambda m: {"model": m.draft}),
    "eagle3": Kind(lambda m: {"eagle3": Eagle3Drafter(m.head)}),
    "random_length": Kind(lambda m: {"random_length": RandomLength()}),
    "grammar": Kind(lambda m: {"grammar": registry.build("grammar", SETTINGS)}, grammar=True, fresh=False),
}
NAMES = list(KINDS)


def others(kind: str) -> list[str]:
    """The other kinds, starting after ``kind``, then the target alone."""
    i = NAMES.index(kind)
    return [*NAMES[i + 1 :], *NAMES[:i], "none"]


# ---- models, engines and a spy on what each step verified ------------------------------------

AUX = (1, 2, 3)


def context_draft(target):
    """A draft model near the target (its weights plus noise) whose attention writes five times more
    into the residual stream: its drafts read the whole context, so a cache position it never read
    (a catch-up that claimed more than it read) changes them; the target still accepts a good share."""
    draft = perturbed(target, 0.2, seed=1)
    with torch.no_grad():
        for layer in draft.model.layers:
            layer.self_attn.o_proj.weight.mul_(5)
    return draft


def eagle3_head(target, seed: int = 0, draft_vocab: int | None = None, scale: float = 0.02):
    """An EAGLE-3 head over the target's whole vocabulary but its three lowest ids (or the last
    ``draft_vocab`` ids), its other weights random, its LM head and final norm the target's (as
    ``training.eagle3.init_from_target`` starts one): no training, and its drafts are accepted
    now and then."""
    from serving.engine.eagle3 import Eagle3Config, Eagle3Head

    vocab = target.config.vocab_size
    draft_vocab = draft_vocab or vocab - 3
    torch.manual_seed(seed)
    aux = AUX if target.config.num_hidden_layers >= 4 else (0, 1)
    head = Eagle3Head(Eagle3Config.for_target(target.config, aux_layers=aux, draft_vocab_size=draft_vocab),
                      embed=target.model.embed_tokens.weight)  # fmt: skip
    for p in head.parameters():
        if p.requires_grad and p.dim() > 1:
            torch.nn.init.normal_(p, std=scale)
    head.set_draft_vocab(list(range(vocab - draft_vocab, vocab)))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[head.head_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    return head.eval().requires_grad_(False)


@dataclass
class Step:
    """One row of one verification: the row's committed tokens, its proposal, the verdict."""

    committed: tuple[int, ...]
    proposal: list[int]
    q0: torch.Tensor | None = field(repr=False)  # [V] the first proposed token's distribution
    accepted: int
    next: int


class Spy:
    """Records every row of every verification of ``engine`` and every ``choose`` of its routing
    drafters (by the row's committed tokens)."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.steps: list[Step] = []
        self.choices: list[tuple[tuple[int, ...], Any]] = []  # (committed tokens, the choice made on them)
        verify = engine.verifier.verify

        def spy(batch):
            verdict = verify(batch)
            lengths, n = batch.state.lengths.tolist(), batch.n_draft.tolist()
            drafts, done = batch.draft_tokens.tolist(), batch.state.done.tolist()
            accepted, nxt = verdict.n_accepted.tolist(), verdict.next_token.tolist()
            for b, params in enumerate(batch.params):
                if params is None or done[b]:
                    continue
                committed = tuple(batch.state.tokens[b, : lengths[b]].tolist())
                q0 = batch.q[b, 0].clone() if n[b] else None
                self.steps.append(Step(committed, drafts[b][: n[b]], q0, accepted[b], nxt[b]))
            return verdict

        engine.verifier.verify = spy
        self.routing = {n for n, d in engine.drafters.items() if isinstance(d, RoutingDrafter)}
        for d in {id(d): d for d in engine.drafters.values()}.values():
            if isinstance(d, RoutingDrafter):
                choose = d.choose

                def chosen(row, tokens, k, prior=None, _choose=choose):
                    choice = _choose(row, tokens, k, prior)
                    self.choices.append((tuple(tokens), choice))
                    return choice

                d.choose = chosen

    def mark(self) -> tuple[int, int]:
        return len(self.steps), len(self.choices)

    def of(self, prompt: list[int], since: tuple[int, int] = (0, 0)) -> list[Step]:
        """The steps of the row with this prompt (recorded from ``since``, a ``mark``), in order."""
        steps = [s for s in self.steps[since[0] :] if list(s.committed[: len(prompt)]) == prompt]
        return sorted(steps, key=lambda s: len(s.committed))

    def proposer(self, kind: str, step: Step, since: tuple[int, int] = (0, 0)) -> str:
        """Whose proposal a step of a ``kind`` row verified: a routing kind's choice on its tokens."""
        if kind in self.routing:
            chosen = [c for t, c in self.choices[since[1] :] if t == step.committed]
            if not chosen:  # not asked (a goodput cap of 0): it proposed nothing
                assert not step.proposal, f"{kind} proposed {step.proposal} without a choice"
                return "none"
            return chosen[-1].drafter or "none"
        return kind


class Kit:
    """The kit's models and engines (built once per module), the target's greedy answers and the
    solo outputs of requests, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        target = peaked_target()
        self.models = Models(target, context_draft(target), eagle3_head(target))
        self.target = target
        self._engines: dict[tuple, tuple[SpeculativeEngine, Spy]] = {}
        self._answers: dict[tuple, list[int]] = {}
        self._solos: dict[str, Any] = {}

    def config(self, batch: int, **changes) -> EngineConfig:
        return EngineConfig(**{**dict(max_batch_size=batch, max_len=128, k=K, request_k_max=K_MAX), **changes})

    def drafters(self, kind: str | None) -> dict:
        """The drafters of one kind's engine, or (None) of the mixed engine: every kind's (a name two
        kinds share, such as auto's ngram, is one drafter), the target alone, and the raising
        neighbour last."""
        if kind is not None:
            return {**KINDS[kind].build(self.models), "none": None}
        merged: dict = {}
        for name in KINDS:
            for n, d in KINDS[name].build(self.models).items():
                merged.setdefault(n, d)
        return {**merged, "none": None, "raising": Raising()}

    def engine(self, kind: str | None = None, batch: int = 4, **changes) -> tuple[SpeculativeEngine, Spy]:
        key = (kind, batch, tuple(sorted(changes.items())))
        if key not in self._engines:
            engine = SpeculativeEngine(self.target, self.tokenizer, config=self.config(batch, **changes),
                                       drafters=self.drafters(kind))  # fmt: skip
            self._engines[key] = engine, Spy(engine)
        return self._engines[key]

    def answer(self, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
        key = (tuple(prompt), max_new)
        if key not in self._answers:
            self._answers[key] = hf_greedy(self.target, prompt, max_new)
        return self._answers[key]

    def request(self, kind: str, prompt: list[int], params: SamplingParams = SamplingParams(), k: int | None = None,
                max_new: int = MAX_NEW) -> Request:  # fmt: skip
        """A request of ``kind`` (a prediction kind's carries the target's answer with its middle
        token wrong: accepted up to there, then rejected, then accepted again)."""
        prediction = None
        if kind in KINDS and KINDS[kind].prediction:
            prediction = list(self.answer(prompt, max_new))
            prediction[len(prediction) // 2] = 3 + (prediction[len(prediction) // 2] + 1) % 380
        if kind in KINDS and KINDS[kind].grammar and not params.processors:  # a request's own processors stand
            params = dataclasses.replace(params, grammar=token_grammar([[t] for t in self.answer(prompt, max_new)]))
        return Request(list(prompt), params, max_new_tokens=max_new, drafter=kind, k=k, prediction=prediction)

    def solo(self, request: Request):
        """The request alone in an engine of its kind's drafters only (batch 1)."""
        key = repr(request)
        if key not in self._solos:
            kind = request.drafter if request.drafter in KINDS else None
            engine, _ = self.engine(kind, batch=1)
            [self._solos[key]] = engine.generate([request])
        return self._solos[key]


def token_grammar(positions: list[list[int]]) -> str:
    """An llguidance grammar of token ids: at each position, one of the listed ids (one: forced)."""
    import llguidance

    return llguidance.grammar_from("lark", "start: " + " ".join("(" + "|".join(f"<[{t}]>" for t in ids) + ")" for ids in positions))


@pytest.fixture(scope="module")
def kit(tokenizer):
    return Kit(tokenizer)


def run(engine: SpeculativeEngine, requests: list[Request]):
    """Every request through add_request/step, as a server drives it: (completions in order, None
    for a request that failed; errors by index)."""
    ids = [engine.add_request(r) for r in requests]
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RequestFailed as e:
            failed.update(e.errors)
            continue
        done.update({o.request_id: o.finished for o in outs if o.finished is not None})
    return [done.get(i) for i in ids], {ids.index(i): e for i, e in failed.items()}


STAT_KEYS = ("new_tokens", "target_calls", "drafted", "accepted", "per_position_acceptance", "mean_k", "drafts",
             "drafter_shares", "drafter")  # fmt: skip


def stats(completion) -> dict:
    """What a drafter decides of a request: its counts, per position, per drafter (no timings)."""
    return {key: completion.stats[key] for key in STAT_KEYS}


def differences(kit: Kit, request: Request, completion, what: str) -> list[str]:
    """How a completion differs from the same request alone (tokens, statistics, origins)."""
    solo = kit.solo(request)
    if completion is None:
        return [f"{what}: the request failed"]
    out = []
    if completion.token_ids != solo.token_ids:
        out.append(f"{what}: tokens differ from the request alone")
    if stats(completion) != stats(solo):
        diff = {k: (completion.stats[k], solo.stats[k]) for k in STAT_KEYS if completion.stats[k] != solo.stats[k]}
        out.append(f"{what}: statistics differ from the request alone (here, alone): {diff}")
    if completion.origins != solo.origins:
        out.append(f"{what}: origins differ from the request alone")
    return out


def same_as_solo(kit: Kit, request: Request, completion, what: str) -> None:
    problems = differences(kit, request, completion, what)
    assert not problems, "; ".join(problems)


# ---- 1. greedy output is the target's --------------------------------------------------------


@pytest.mark.parametrize("kind", NAMES)
def test_greedy_output_is_the_targets_alone_and_in_every_slot(kit, kind):
    """The kind's greedy rows alone, then in slots 0 and 2, then 1 and 3, beside rows of other
    kinds and of the target alone: every row is the target's own greedy output."""
    a, b, c, d = ragged_prompts(4, seed=11)
    engine, _ = kit.engine()
    fill = others(kind)
    alone = kit.solo(kit.request(kind, a))
    assert alone.token_ids == kit.answer(a)
    for mine in ((0, 2), (1, 3)):  # the kind's rows in every slot, beside other kinds and the target alone
        names = iter(fill[:2] if mine == (1, 3) else fill[2:4])
        kinds = [kind if slot in mine else next(names) for slot in range(4)]
        outs = engine.generate([kit.request(n, p) for n, p in zip(kinds, (a, b, c, d))])
        for slot, (p, out) in enumerate(zip((a, b, c, d), outs)):
            assert out.token_ids == kit.answer(p), f"slot {slot} ({kinds[slot]}) beside {kinds}"
    assert sum(o.stats["drafted"] for o in outs if o.stats["drafter"] == kind) > 0, "the kind never drafted"


@pytest.mark.parametrize("kind", NAMES)
def test_greedy_output_with_logits_processors_is_the_processed_targets(kit, kind):
    """Issue 71 through the kit: the kind's rows with logit_bias and the three penalties (and
    logprobs), beside rows without them, equal the target alone with the same settings, logprobs
    to 1e-5; the processors move the output, so the check has something to see."""
    params = SamplingParams(logit_bias=((7, 4.0), (11, -100.0)), repetition_penalty=1.6, frequency_penalty=0.8,
                            presence_penalty=0.5, logprobs=2)  # fmt: skip
    a, b, c = ragged_prompts(3, seed=17)
    alone = SpeculativeEngine(kit.target, kit.tokenizer, config=kit.config(2, k=0))
    want = {tuple(p): alone.generate([Request(list(p), params, max_new_tokens=MAX_NEW)])[0] for p in (a, c)}
    assert any(w.token_ids != kit.answer(p) for p, w in zip((a, c), want.values())), "the processors moved nothing"
    engine, _ = kit.engine()
    fill = others(kind)[0]
    outs = engine.generate([kit.request(kind, a, params), kit.request(fill, b), kit.request(kind, c, params)])
    for p, out in ((a, outs[0]), (c, outs[2])):
        w = want[tuple(p)]
        assert out.token_ids == w.token_ids and out.stats["processors"] == list(params.processors)
        assert [x.logprob for x in out.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-5)
    assert outs[1].token_ids == kit.answer(b) and outs[1].logprobs is None


@pytest.mark.parametrize("kind", NAMES)
def test_greedy_output_under_a_json_schema_is_the_constrained_targets(kit, kind):
    """Issue 72 through the kit: the kind's rows under a JSON schema, beside an unconstrained row,
    equal the constrained target alone (its forced tokens drafted as the ``grammar`` proposer)."""
    from serving.engine.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(grammar=json_schema_grammar(schema))
    a, b, c = ragged_prompts(3, seed=18)
    alone = SpeculativeEngine(kit.target, kit.tokenizer, config=kit.config(2, k=0))
    want = {tuple(p): alone.generate([Request(list(p), params, max_new_tokens=MAX_NEW)])[0].token_ids for p in (a, c)}
    engine, _ = kit.engine()
    outs = engine.generate([kit.request(kind, a, params), kit.request(others(kind)[0], b), kit.request(kind, c, params)])
    assert [outs[0].token_ids, outs[2].token_ids] == [want[tuple(a)], want[tuple(c)]]
    assert outs[1].token_ids == kit.answer(b)
    assert all(o.text.startswith("{") for o in (outs[0], outs[2]))


# ---- 2. seeded sampled output and statistics do not depend on the batch ----------------------


@pytest.mark.parametrize("kind", NAMES)
def test_seeded_output_and_statistics_do_not_depend_on_the_batch_or_the_neighbours_k(kit, kind):
    """Rows of the kind with K 1, 3 and 8 beside a sampled row of another kind: each row's tokens,
    counts and origins are the ones it has alone."""
    ps = ragged_prompts(4, seed=12)
    mine = [kit.request(kind, p, seeded(20 + i), k=k) for i, (p, k) in enumerate(zip(ps, (1, None, 8)))]
    other = kit.request(others(kind)[0], ps[3], SamplingParams(temperature=1.0))
    engine, _ = kit.engine()
    outs = engine.generate([mine[0], other, mine[1], mine[2]])
    for request, out in zip(mine, [outs[0], outs[2], outs[3]]):
        same_as_solo(kit, request, out, f"{kind} row with k={request.k}")
    assert any(o.stats["drafted"] for o in (outs[0], outs[2], outs[3])), "the kind never drafted"


# ---- 3. a neighbour that raises mid-step -----------------------------------------------------


@pytest.mark.parametrize("kind", NAMES)
def test_a_neighbour_that_raises_mid_step_changes_no_other_row(kit, kind):
    """The raising neighbour's drafter raises in every step it shares, after every other drafter
    proposed; the engine then runs each row alone from where the step began. Every other row (the
    kind's, seeded sampled at a low temperature and greedy, one admitted mid-way, and a seeded row
    of the target alone) finishes with its solo tokens, statistics and origins: a drafter must keep
    nothing of a step that never committed (a routing drafter's scores of the proposals it saw, a
    head's features it read)."""
    a = ragged_prompts(4, seed=14)[0]
    _, b, c, d = ragged_prompts(4, seed=16)
    cool = SamplingParams(temperature=0.3, seed=42)
    mine = [kit.request(kind, a, cool), kit.request(kind, c * 2, cool), kit.request(kind, d)]
    other = kit.request("none", a * 2, seeded(32))
    engine, _ = kit.engine()
    raising = engine.drafters["raising"]
    raised = raising.raised
    neighbour = Request(b, max_new_tokens=MAX_NEW, drafter="raising")
    outs, failed = run(engine, [mine[0], neighbour, mine[1], mine[2], other])
    assert raising.raised > raised, "the neighbour never raised"
    problems = [f"request {i} failed: {type(e).__name__}: {e}" for i, e in failed.items()]
    for i, request, what in ((0, mine[0], "seeded"), (2, mine[1], "seeded"), (3, mine[2], "greedy")):
        problems += differences(kit, request, outs[i], f"{what} {kind} row (request {i})")
    problems += differences(kit, other, outs[4], "seeded row of the target alone (request 4)")
    assert not problems, "beside a neighbour that raises mid-step: " + "; ".join(problems)
    assert outs[1].token_ids == kit.answer(b) and engine.num_running == 0


# ---- 4. a row that skipped steps catches up --------------------------------------------------


class Toggle:
    """step_k goodput's step costs: while ``blocked`` any proposal makes a step a million times
    dearer (every greedy row is capped at 0: it skips the step); otherwise a wider step is cheaper
    (every row drafts its whole K)."""

    def __init__(self) -> None:
        self.blocked = False

    def observe(self, *args) -> None:
        pass

    observe_draft = observe

    def step_ms(self, rows, cap, model_budget=0):
        if self.blocked:
            return 1.0 if cap == 0 else 1e6
        return 1.0 / (1 + cap)


DRAFTING = (0, 3, 9, 10, 15)  # of every 16 steps; the others skip


def skipped(step: int) -> bool:
    """Runs of 2, 5 and 4 skipped steps between drafting ones (and two drafting steps in a row):
    catch-ups of every width (a model drafter's gap after t skipped one-token steps is about t - 1,
    read in chunks of 4, 16, 64: a gap of exactly 4 fills a chunk, a gap of 1 overshoots by 3), and
    after each catch-up a later one that starts where it left off."""
    return step % 16 not in DRAFTING


def first_proposal(kit: Kit, kind: str, committed: tuple[int, ...], k: int) -> list[int]:
    """What a fresh greedy row of ``kind`` proposes first on ``committed`` (admitted on all but the
    last token, which its prefill commits)."""
    engine, spy = kit.engine(kind, batch=1)
    since = spy.mark()
    request = Request(list(committed[:-1]), max_new_tokens=2, drafter=kind, k=k)
    [out] = engine.generate([request])
    assert out.token_ids[0] == committed[-1], "the fresh row's prefill commits the row's last token"
    first = [s for s in spy.steps[since[0] :] if s.committed == committed]
    assert first, "the fresh row verified a step"
    return first[0].proposal


@pytest.mark.parametrize("kind", NAMES)
def test_a_row_that_skipped_steps_proposes_what_a_row_that_never_skipped_proposes(kit, kind):
    """Greedy rows under step_k goodput, capped at 0 (no proposal) in runs of skipped steps
    (``skipped``): every proposal, a model drafter's or a head's after its catch-up included (and
    under auto a model drafter's after auto chose the target alone or a copy, or started it late),
    is the one a fresh row on the same committed tokens proposes (auto's cut to the K it chose).
    For ``prediction``, whose alignment needs the prompt's end, the reference is the same request
    never skipping, where both reach the same committed tokens."""
    toggle = Toggle()
    engine, spy = kit.engine(kind, batch=4, step_k="goodput")
    engine.step_costs = toggle
    ps = ragged_prompts(4, seed=14)
    since = spy.mark()
    ids = [engine.add_request(kit.request(kind, p, max_new=24)) for p in ps]
    done, step = {}, 0
    while engine.has_unfinished_requests():
        toggle.blocked = skipped(step)
        done.update({o.request_id: o.finished for o in engine.step() if o.finished is not None})
        step += 1
    compared = 0
    for p, i in zip(ps, ids):
        assert done[i].token_ids == kit.answer(p, 24)
        steps = [s for s in spy.of(p, since) if s.proposal]
        if not KINDS[kind].fresh:
            reference_engine, reference_spy = kit.engine(kind, batch=1)
            mark = reference_spy.mark()
            reference_engine.generate([kit.request(kind, p, max_new=24)])
            never = {s.committed: s.proposal for s in reference_spy.of(p, mark)}
            for s in steps:
                if s.committed in never:
                    assert s.proposal == never[s.committed], f"{kind} after skips at {len(s.committed)} tokens"
                    compared += 1
            continue
        for s in steps:
            proposer = spy.proposer(kind, s, since)
            fresh = first_proposal(kit, proposer, s.committed, k=K)
            where = f"{kind} ({proposer}) at {len(s.committed)} tokens"
            if proposer != kind:  # auto cuts its drafter's proposal to the K it chose
                assert s.proposal == fresh[: len(s.proposal)], where
            else:
                assert s.proposal == fresh, where
            compared += 1
    assert compared >= 4, f"only {compared} proposals compared"


# ---- 5. token origins ------------------------------------------------------------------------


def expected_origins(kit: Kit, spy: Spy, since, prompt: list[int], kind: str) -> list[TokenOrigin]:
    """A greedy row's origins from what each step proposed and the target's greedy answer: the
    accepted drafts name their drafter (auto: the one it chose), then a correction after a
    rejection, a bonus after a whole proposal, the target's token after no proposal."""
    answer = kit.answer(prompt)
    origins = [TokenOrigin("target")]
    for s in spy.of(prompt, since):
        g = len(s.committed) - len(prompt)
        assert list(s.committed[len(prompt) :]) == answer[:g]
        rest = answer[g:]
        a = 0
        while a < len(s.proposal) and a < len(rest) and s.proposal[a] == rest[a]:
            a += 1
        new = min(a + 1, len(rest))
        drafter = spy.proposer(kind, s, since) if s.proposal else None
        last = "target" if not s.proposal else "bonus" if a == len(s.proposal) else "correction"
        origins += [TokenOrigin("draft", drafter)] * min(a, new) + ([TokenOrigin(last)] if new > a else [])
    return origins


@pytest.mark.parametrize("kind", NAMES)
def test_token_origins_are_what_each_step_did(kit, kind):
    """Greedy rows of the kind with K 1, 3 and 8 (short and empty proposals among them) beside a
    row of another kind: each row's origins are the ones its steps' proposals and the target's
    answer give (``expected_origins``)."""
    ps = ragged_prompts(4, seed=15)
    engine, spy = kit.engine()
    since = spy.mark()
    kinds = [kind, kind, others(kind)[0], kind]
    requests = [kit.request(n, p, k=k) for n, p, k in zip(kinds, ps, (1, None, None, 8))]
    outs = engine.generate(requests)
    counts = {"draft": 0, "correction": 0, "bonus": 0, "target": 0}
    for n, p, out in zip(kinds, ps, outs):
        expected = expected_origins(kit, spy, since, p, n)
        assert out.origins == expected, f"{n} row: origins {[o.origin for o in out.origins]}"
        if n == kind:
            for o in out.origins[1:]:
                counts[o.origin] += 1
    assert counts["draft"] + counts["correction"] + counts["bonus"] > 0, counts


# ---- 6. threshold rows beside exact rows -----------------------------------------------------


@pytest.mark.parametrize("kind", NAMES)
def test_threshold_rows_never_accept_padding_and_leave_exact_rows_alone(kit, kind):
    """Threshold rows (lossy, a threshold so low that every real draft passes) with short budgets
    beside exact rows with longer ones (the step's K is the longest, so the threshold rows' tails
    are padding, token 0): no threshold row accepts more than it proposed, none emits the padding
    token; the exact rows are the target's greedy output and their solo seeded output."""
    ps = ragged_prompts(4, seed=16)
    lossy = SamplingParams(verification="threshold", verification_threshold=1e-6)
    exact = [kit.request(kind, ps[0], k=8), kit.request(kind, ps[2], seeded(61), k=K)]
    threshold = [kit.request(kind, ps[1], lossy, k=1), kit.request(kind, ps[3], lossy, k=2)]
    engine, spy = kit.engine()
    since = spy.mark()
    outs = engine.generate([exact[0], threshold[0], exact[1], threshold[1]])
    assert outs[0].token_ids == kit.answer(ps[0])
    same_as_solo(kit, exact[1], outs[2], f"exact seeded {kind} row beside threshold rows")
    for p, out in ((ps[1], outs[1]), (ps[3], outs[3])):
        assert not out.stats["exact"] and out.stats["verification"] == "threshold"
        for s in spy.of(p, since):
            where = f"a threshold {kind} row at {len(s.committed)} tokens"
            assert s.accepted <= len(s.proposal), f"{where} accepted {s.accepted} of its drafts {s.proposal}"
        assert 0 not in out.token_ids, f"a threshold {kind} row emitted the padding token: {out.token_ids}"
        assert out.stats["accepted"] <= out.stats["drafted"]


# ---- 7. a request's K bounds its drafts ------------------------------------------------------


@pytest.mark.parametrize("kind", NAMES)
def test_a_requests_k_bounds_its_drafts_beside_larger_ks(kit, kind):
    """Rows of the kind with K 1 (greedy and seeded) beside ones with K 3 and 2: no step proposes
    more than the row's own K, its per-position record is no longer, the seeded row is its solo
    self."""
    ps = ragged_prompts(4, seed=17)
    ks = (1, 3, 1, 2)
    requests = [kit.request(kind, p, seeded(70 + i) if i == 2 else SamplingParams(), k=k)
                for i, (p, k) in enumerate(zip(ps, ks))]  # fmt: skip
    engine, spy = kit.engine()
    since = spy.mark()
    outs = engine.generate(requests)
    for p, k, out in zip(ps, ks, outs):
        longest = max((len(s.proposal) for s in spy.of(p, since)), default=0)
        assert longest <= k, f"a k={k} {kind} row proposed {longest} tokens in a step"
        assert len(out.stats["per_position_acceptance"]) <= k
    for i in (0, 1, 3):
        assert outs[i].token_ids == kit.answer(ps[i])
    same_as_solo(kit, requests[2], outs[2], f"seeded k=1 {kind} row beside k=3")


# ---- 8. sampled output follows the target's distribution -------------------------------------

SMALL_V = 8  # the chi-square's target: a vocabulary of 8 (its EOS outside it), so 8^3 sequences
SMALL_PROMPT = [1, 2, 3, 1, 2]
SMALL_N = 3000  # seeded requests per kind
SMALL_FORCED = 4  # the grammar kind's forced second token


class SmallKit(Kit):
    """The kit's kinds over a target of 8 tokens (a few likely ones after each context), a draft and
    a head that agree with it a third of the time or so, the head's vocabulary one token short
    (q = 0 there)."""

    def __init__(self, tokenizer) -> None:
        import copy

        self.tokenizer = copy.deepcopy(tokenizer)
        eos = 300  # outside the vocabulary: every request runs its three tokens
        self.tokenizer.eos_token = self.tokenizer.convert_ids_to_tokens(eos)
        target = tiny_qwen2(7, layers=2, vocab_size=SMALL_V, eos_token_id=eos)
        with torch.no_grad():
            target.lm_head.weight.mul_(5)  # a few likely tokens after each context, not one
        self.target = target
        head = eagle3_head(target, seed=3, draft_vocab=SMALL_V - 1, scale=0.3)
        self.models = Models(target, perturbed(target, 0.5, seed=2), head)
        self._engines, self._answers, self._solos = {}, {}, {}

    def config(self, batch: int, **changes) -> EngineConfig:
        return EngineConfig(**{**dict(max_batch_size=batch, max_len=16, k=K, reuse_prefill=True), **changes})


def exact_joint(target, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V, V] P(x1, x2, x3 | prompt) under the target with the request's sampling transform."""
    from serving.engine.sampling import SamplingTensors, probs_from_logits

    V = SMALL_V
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [V*V, 2]
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), pairs], 1)  # [V*V, L+2]
    with torch.no_grad():
        logits = target(ids).logits[:, -3:].float()  # [V*V, 3, V]: after the prompt, x1, x2
    p = probs_from_logits(logits, SamplingTensors.build([params] * (V * V), "cpu")).double()  # [V*V, 3, V]
    p1 = p[0, 0]  # [V]
    p2 = p[:, 1].view(V, V, V)[:, 0]  # [V(x1), V(x2)]
    p3 = p[:, 2].view(V, V, V)  # [V(x1), V(x2), V(x3)]
    return p1[:, None, None] * p2[:, :, None] * p3


def joint_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of [N, 3] samples against the joint ``probs`` [V, V, V] (cells expected
    below 5 pooled)."""
    from scipy.stats import chisquare

    V, N = probs.shape[0], samples.shape[0]
    counts = torch.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], minlength=V**3).double()
    expected = probs.flatten() * N
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] < 1e-9:
        assert obs[-1] == 0, "a sample the target gives no probability"
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * (N / exp.sum().item())).pvalue)


@pytest.fixture(scope="module")
def small_kit(tokenizer):
    return SmallKit(tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("kind", NAMES)
def test_sampled_output_follows_the_targets_distribution(small_kit, kind):
    """SMALL_N seeded requests of the kind (temperature 1, K 3) through one engine: the joint
    distribution of their three tokens passes a chi-square test against the target's own. It has
    the power to see a head that draws its drafts with the acceptance tests' uniforms."""
    # The grammar kind: the second token forced (its one draft; the first is the prefill's), the others free.
    free = list(range(SMALL_V))
    grammar = token_grammar([free, [SMALL_FORCED], free]) if KINDS[kind].grammar else None
    params = [SamplingParams(temperature=1.0, seed=1000 + i, grammar=grammar) for i in range(SMALL_N)]
    engine, _ = small_kit.engine(kind, batch=64)
    prediction = list(range(SMALL_V)) * 2 if KINDS[kind].prediction else None
    requests = [Request(SMALL_PROMPT, p, max_new_tokens=3, drafter=kind, prediction=prediction) for p in params]
    outs = engine.generate(requests)
    samples = torch.tensor([o.token_ids for o in outs])
    assert samples.shape == (SMALL_N, 3)
    assert sum(o.stats["drafted"] for o in outs) > SMALL_N // 2, "the kind hardly drafted"
    exact = exact_joint(small_kit.target, SMALL_PROMPT, SamplingParams(temperature=1.0))  # [V, V, V]
    if grammar is not None:  # x2 forced: P(x1) P(x3 | x1, forced)
        given = exact[:, SMALL_FORCED] / exact[:, SMALL_FORCED].sum(-1, keepdim=True)  # [V(x1), V(x3)]
        exact = torch.zeros_like(exact).index_copy_(1, torch.tensor([SMALL_FORCED]),
                                                    (exact.sum((1, 2))[:, None] * given).unsqueeze(1))  # fmt: skip
    assert joint_p_value(samples, exact) > 1e-3


# ---- 9. every kind is in the kit -------------------------------------------------------------


def drafter_classes() -> dict[str, type]:
    """Every concrete drafter class of the serving.engine.drafters package, by qualified name."""
    import serving.engine.drafters as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    found, todo = {}, [HostDrafter, BatchDrafter, RoutingDrafter]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith(package.__name__ + ".") and not inspect.isabstract(cls):
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_drafter_kind_is_in_the_kit(kit):
    """Each concrete Drafter of serving.engine.drafters is the drafter of some kit entry (the one
    its engine holds under the entry's name), and each registry built-in is an entry."""
    covered = set()
    for name in KINDS:
        engine, _ = kit.engine(name, batch=1)
        covered.add(type(engine.drafters[name]))
    missing = [qual for qual, cls in drafter_classes().items() if cls not in covered]
    missing += [f"registry built-in {ref!r}" for ref in registry.BUILT_IN if ref not in KINDS]
    assert not missing, f"drafter kinds missing from the kit: {missing}: add an entry to KINDS in {__name__}"
    assert all(issubclass(c, Drafter) for c in covered)

"""Tier 3: one engine, many drafters. Rows of one batch draft with different drafters (a draft
model, ``ngram``, ``suffix``, ``prediction``, ``none``) and every row's greedy output is the
target's own; seeded sampled output does not depend on the batch; a step runs at the smallest
batch bucket that holds its rows."""

import pytest
import torch

from serving.engine.core import SpeculativeEngine
from serving.engine.drafting import draft
from serving.engine.engine_settings import EngineConfig
from serving.engine.request import Request
from serving.engine.speculative import step_uniforms
from serving.engine.drafters.base import HostDrafter
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.drafters.suffix import SuffixDrafter
from serving.engine.sampling import SamplingParams
from tests.test_engine_tiny import hf_greedy, ragged_prompts

pytestmark = pytest.mark.integration


def engine_with_every_drafter(target, draft, tokenizer, batch, k=4):
    drafters = {"small": draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(max_cached_requests=4), "none": None}
    return SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=batch, max_len=128, k=k), drafters=drafters)


def mixed_requests(target, prompts, max_new=24):
    """Every drafter kind in turn; the prediction requests carry the target's own answer (all
    accepted) or a corrupted one (rejections mid-way)."""
    names = ["small", "ngram", "suffix", "none", "prediction", "prediction"]
    requests = []
    for i, p in enumerate(prompts):
        name = names[i % len(names)]
        prediction = None
        if name == "prediction":
            prediction = hf_greedy(target, p, max_new)
            if i % 2:
                prediction[len(prediction) // 2] = (prediction[len(prediction) // 2] + 1) % 300 + 3
        requests.append(Request(p, max_new_tokens=max_new, drafter=name, prediction=prediction))
    return requests


@pytest.mark.parametrize("k", [3, "auto"])
def test_every_row_of_a_mixed_batch_is_the_targets_greedy_output(tiny_target, tiny_draft, tokenizer, k):
    prompts = ragged_prompts(12, seed=31)
    batched = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=4, k=k)
    outs = batched.generate(mixed_requests(tiny_target, prompts))
    single = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=1, k=k)
    alone = [single.generate([r])[0] for r in mixed_requests(tiny_target, prompts)]
    for prompt, out, one in zip(prompts, outs, alone):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 24) == one.token_ids
    by_name = {}
    for out in outs:
        by_name.setdefault(out.stats["drafter"], []).append(out.stats)
    assert set(by_name) == {"small", "ngram", "suffix", "none", "prediction"}
    assert all(s["drafted"] == 0 for s in by_name["none"])
    assert all(s["drafted"] > 0 for s in by_name["small"])
    # The right prediction is accepted whole: far fewer target calls than tokens.
    right = by_name["prediction"][0]
    assert right["acceptance_rate"] > 0.9 and right["target_calls"] < right["new_tokens"] / 2


def test_a_prediction_alone_picks_the_prediction_drafter(tiny_target, tiny_draft, tokenizer):
    prompt = ragged_prompts(1, seed=3)[0]
    expected = hf_greedy(tiny_target, prompt, 20)
    engine = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=2)
    [out] = engine.generate([Request(prompt, max_new_tokens=20, prediction=expected)])
    assert out.token_ids == expected and out.stats["drafter"] == "prediction"
    [plain] = engine.generate([Request(prompt, max_new_tokens=20)])
    assert plain.stats["drafter"] == "small"  # the engine's default: the first drafter given


@pytest.mark.parametrize("name", ["ngram", "suffix", "prediction", "small"])
def test_seeded_sampling_does_not_depend_on_the_batch_for_any_drafter(tiny_target, tiny_draft, tokenizer, name):
    prompts = ragged_prompts(4, seed=41)
    seeded = SamplingParams(temperature=0.9, seed=123)

    def request(p, params, drafter):
        prediction = hf_greedy(tiny_target, p, 16) if drafter == "prediction" else None
        return Request(p, params=params, max_new_tokens=16, drafter=drafter, prediction=prediction)

    engine = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=4, k="auto")
    [alone] = engine.generate([request(prompts[0], seeded, name)])
    others = [request(p, SamplingParams(temperature=1.5), d) for p, d in zip(prompts[1:], ["small", "ngram", "none"])]
    mixed = engine.generate([*others[:1], request(prompts[0], seeded, name), *others[1:]])
    assert mixed[1].token_ids == alone.token_ids


# ---- each row drafts from its own state, in every slot ---------------------------------------
# Greedy identity cannot see a drafter that reads another row's history or cache row: the output
# stays the target's, only acceptance (greedy) or the seeded draws (sampled) change. The seeded
# test above puts its row in the lowest row of its drafter; these put it everywhere.


@pytest.mark.parametrize("name", ["ngram", "suffix", "small"])
# Position 3 (above a row of its own drafter and one of the target alone) in the fast tier; all in CI.
@pytest.mark.parametrize("position", [pytest.param(p, marks=() if p == 3 else pytest.mark.slow) for p in range(4)])
def test_seeded_output_is_the_same_in_every_slot_position(tiny_target, tiny_draft, tokenizer, name, position):
    """The seeded row at slot ``position``, below and above rows of the same drafter and of the
    target alone (so a model drafter's cache row differs from its slot): its tokens are the ones it
    draws alone."""
    prompts = ragged_prompts(4, seed=67)
    prompts = [p * 2 for p in prompts]  # repeats, so that ngram and suffix propose
    # A low temperature keeps the tiny model's answers repetitive enough for ngram and suffix to
    # propose; the draws are still seeded samples, and so is everything they consume.
    seeded = SamplingParams(temperature=0.02, seed=321)
    engine = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=4)
    [alone] = engine.generate([Request(prompts[0], params=seeded, max_new_tokens=24, drafter=name)])
    fillers = iter([Request(p, params=SamplingParams(temperature=1.2), max_new_tokens=24, drafter=d)
                    for p, d in zip(prompts[1:], ["none", name, "none"])])  # fmt: skip
    batch = [Request(prompts[0], params=seeded, max_new_tokens=24, drafter=name) if i == position else next(fillers)
             for i in range(4)]  # fmt: skip
    mixed = engine.generate(batch)[position]
    assert alone.stats["drafted"] > 0
    assert mixed.token_ids == alone.token_ids
    # the same proposals and draws, so the same counts (a proposal from another row's state changes them)
    assert (mixed.stats["drafted"], mixed.stats["accepted"]) == (alone.stats["drafted"], alone.stats["accepted"])


def test_a_draft_equal_to_the_target_accepts_every_token_in_every_row_and_slot(tiny_target, tokenizer):
    """Greedy, with a draft that is a copy of the target: whatever slot and cache row a request
    lands in, beside other drafters, every drafted token is accepted."""
    import copy

    twin = copy.deepcopy(tiny_target)
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=128, k=4),
                               drafters={"twin": twin, "ngram": NgramDrafter(), "none": None})  # fmt: skip
    prompts = ragged_prompts(8, seed=71)
    names = ["none", "twin", "ngram", "twin", "twin", "none", "twin", "ngram"]
    outs = engine.generate([Request(p, max_new_tokens=20, drafter=n) for p, n in zip(prompts, names)])
    for p, n, out in zip(prompts, names, outs):
        assert out.token_ids == hf_greedy(tiny_target, p, 20)
        if n == "twin":
            assert out.stats["drafted"] > 0 and out.stats["accepted"] == out.stats["drafted"], out.stats


def test_ngram_rows_accept_in_a_batch_what_they_accept_alone(tiny_target, tokenizer):
    """``ngram`` proposes from the row's own prompt and output: greedy, each row drafts and accepts
    the same tokens in a batch of other ngram rows as alone."""
    prompts = [p * 3 for p in ragged_prompts(4, seed=73)]
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=160, k=4),
                               drafters={"ngram": NgramDrafter(), "none": None})  # fmt: skip
    alone = [engine.generate([Request(p, max_new_tokens=24, drafter="ngram")])[0] for p in prompts]
    batched = engine.generate([Request(p, max_new_tokens=24, drafter="ngram") for p in prompts])
    assert sum(a.stats["drafted"] for a in alone) > 0
    for a, b in zip(alone, batched):
        assert (b.stats["drafted"], b.stats["accepted"]) == (a.stats["drafted"], a.stats["accepted"])


def test_fallbacks_from_a_draft_model_free_its_rows_for_later_requests(tiny_target, tokenizer):
    """Two rounds of draft-model requests that fall back to the target alone (a draft that never
    agrees), then more draft-model requests: each gets a cache row and the target's output."""
    from serving.engine.request import Fallback
    from tests.conftest import tiny_qwen2

    stranger = tiny_qwen2(5)  # another random model: almost nothing it drafts is accepted
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=160, k=4),
                               drafters={"stranger": stranger, "none": None})  # fmt: skip
    rule = Fallback(min_acceptance=0.5, after_drafted=8)
    prompts = ragged_prompts(6, seed=79)
    for round_ in range(3):
        pair = prompts[2 * round_ : 2 * round_ + 2]
        outs = engine.generate([Request(p, max_new_tokens=24, drafter="stranger", fallback=rule if round_ < 2 else None)
                                for p in pair])  # fmt: skip
        for p, out in zip(pair, outs):
            assert out.token_ids == hf_greedy(tiny_target, p, 24)
            assert ("fallback" in out.stats) == (round_ < 2), (round_, out.stats)


def test_a_lone_request_runs_at_the_smallest_batch_bucket(tiny_target, tiny_draft, tokenizer):
    engine = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=8)
    assert engine.config.batch_buckets == (1, 2, 4, 8)
    seen = []
    forward = engine.verifier.runner.forward
    engine.verifier.runner.forward = lambda tokens, positions, last_only=False: seen.append(tokens.shape[0]) or forward(tokens, positions, last_only)
    prompts = ragged_prompts(3, seed=5)
    engine.generate([Request(prompts[0], max_new_tokens=8)])
    assert set(seen) == {1}
    seen.clear()
    engine.generate([Request(p, max_new_tokens=8) for p in prompts])  # slots 0-2: the bucket of 4, then fewer
    assert max(seen) == 4 and set(seen) <= {1, 2, 4}


def test_an_unknown_drafter_is_a_clear_error(tiny_target, tiny_draft, tokenizer):
    engine = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=1)
    with pytest.raises(ValueError, match=r"unknown drafter 'eagle'; this engine has small, ngram, suffix, prediction, none"):
        engine.add_request(Request([5, 6, 7], drafter="eagle"))


def test_host_drafters_see_every_committed_token(tiny_target, tokenizer):
    """A host drafter's view of a row (its start, then every step's new tokens) is the row's
    whole output, so its proposals are built from the same tokens the target committed."""

    class Recorder(NgramDrafter):
        def __init__(self):
            super().__init__()
            self.seen = {}

        def start(self, row, ctx):
            super().start(row, ctx)
            self.seen[ctx.request_id] = []
            self._row_request = getattr(self, "_row_request", {}) | {row: ctx.request_id}

        def observe(self, row, new_tokens, hidden=None):
            super().observe(row, new_tokens)
            self.seen[self._row_request[row]] += list(new_tokens)

    recorder = Recorder()
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=96, k=3),
                               drafters={"rec": recorder})  # fmt: skip
    prompts = ragged_prompts(3, seed=8)
    outs = engine.generate([Request(p, max_new_tokens=12) for p in prompts])
    assert [recorder.seen[i] for i in range(3)] == [o.token_ids for o in outs]


def test_point_masses_enter_the_acceptance_rule_as_one_hot_q(tiny_target, tokenizer):
    """A host drafter's proposal reaches accept/reject as q = one-hot at each token (with padding
    masked by n_draft), so min(1, p/q) = p(x) and the residual is p without x."""
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=96, k=4),
                               drafters={"ngram": NgramDrafter()})  # fmt: skip

    class Fixed(NgramDrafter):
        def propose(self, row, tokens, k):
            return [7, 8][:k]

    engine.drafters["ngram"] = Fixed()
    for b, request in enumerate([Request([5, 6, 7, 8, 5], max_new_tokens=8), Request([9, 9, 9], max_new_tokens=8, drafter="none")]):
        engine._slots[b], _ = engine._admit(b, b, request)
    slots = engine._slots[:2]
    state = engine.state.head(2)
    k_rows = [engine.k_policy.row_k(s) for s in slots]
    rand = step_uniforms([s.generator for s in slots], k_rows, max(k_rows), "cpu")
    d = draft(engine.drafters, slots, state, engine._batch_sampling(slots), rand, k_rows, engine.k_policy,
              engine.step_costs, engine.config, engine.vocab_size, engine.device)  # fmt: skip
    tokens, q, n_draft = d.tokens, d.q, d.n
    assert tokens[0, :2].tolist() == [7, 8] and n_draft.tolist() == [2, 0] and tokens.shape[1] == 2
    assert torch.equal(q[0], torch.nn.functional.one_hot(torch.tensor([7, 8]), q.shape[-1]).float())


def test_a_host_drafters_own_k_between_buckets_rounds_up_to_a_bucket(tiny_target, tokenizer):
    """A drafter's own k (3) that is not a K bucket (2, 4): its proposals verify at the next bucket,
    padded and masked, with uniforms wide enough for that bucket."""
    from serving.engine.drafters.prediction import PredictionDrafter

    prompt = ragged_prompts(1, seed=12)[0]
    expected = hf_greedy(tiny_target, prompt, 12)
    config = EngineConfig(max_batch_size=2, max_len=96, k=4, k_buckets=(2, 4))
    engine = SpeculativeEngine(tiny_target, tokenizer, config=config, drafters={"prediction": PredictionDrafter(k=3)})
    outs = engine.generate([Request(prompt, max_new_tokens=12, prediction=expected), Request([9, 9, 9], max_new_tokens=12, drafter="none")])
    assert outs[0].token_ids == expected and outs[0].stats["drafted"] > 0 and outs[0].stats["mean_k"] <= 3


def test_a_prediction_drafts_past_the_engines_k_up_to_its_own(tiny_target, tokenizer):
    """engine.prediction.k above engine.k: a right prediction verifies 8 tokens a step while the
    ngram row beside it keeps the engine's k of 2; both stay the target's own output."""
    from serving.engine.engine_settings import EngineSettings, PredictionSettings

    settings = EngineSettings(k=2, k_buckets=(2, 4, 8), max_batch_size=2, max_len=96, prediction=PredictionSettings(k=8),
                              step_k="rows")  # each row's own K, not a load cap: what this test is about
    config = settings.engine_config(draft=True)
    assert config.k_max == 8 and config.verify_widths == (3,)
    engine = SpeculativeEngine(tiny_target, tokenizer, config=config,
                               drafters={"ngram": NgramDrafter(), "prediction": settings.host_drafter("prediction")})  # fmt: skip
    a, b = ragged_prompts(2, seed=21)
    expected = [hf_greedy(tiny_target, p, 24) for p in (a, b)]
    outs = engine.generate([Request(a, max_new_tokens=24, prediction=expected[0]), Request(b, max_new_tokens=24, drafter="ngram")])
    assert [o.token_ids for o in outs] == expected
    assert outs[0].stats["drafter"] == "prediction" and outs[0].stats["mean_k"] > 4  # 8 a step until the end nears
    assert outs[0].stats["target_calls"] <= 4
    assert outs[1].stats["mean_k"] <= 2
    with pytest.raises(ValueError, match=r"prediction.k=12 exceeds the largest of k_buckets \[2, 4, 8\]: add 12"):
        EngineSettings(k=2, k_buckets=(2, 4, 8), prediction=PredictionSettings(k=12))


def test_each_draft_model_drafts_over_its_own_rows_only(tiny_target, tiny_draft, tokenizer):
    """Two draft models in one batch of 4: each runs at the smallest batch bucket holding its own
    requests (one row each here), not over the engine's whole batch; outputs stay the target's."""
    import copy

    other = copy.deepcopy(tiny_draft)
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=128, k=3),
                               drafters={"a": tiny_draft, "b": other, "ngram": NgramDrafter()})  # fmt: skip
    rows_seen = {"a": set(), "b": set()}
    for name in rows_seen:
        runner = engine.drafters[name].runner
        forward = runner.forward

        def spy(tokens, positions, last_only=False, _forward=forward, _name=name):
            rows_seen[_name].add(tokens.shape[0])
            return _forward(tokens, positions, last_only)

        runner.forward = spy
    prompts = ragged_prompts(4, seed=7)
    requests = [Request(p, max_new_tokens=12, drafter=d) for p, d in zip(prompts, ["a", "ngram", "b", "none"])]
    outs = engine.generate(requests)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 12)
    assert rows_seen == {"a": {1}, "b": {1}}  # the engine's batch bucket was 4 throughout
    assert all(engine.drafters[n].owner == [None] * 4 for n in ("a", "b"))  # every draft row freed


class _Poisoned(NgramDrafter):
    """An ngram drafter that raises at one stage for rows whose prompt starts with POISON."""

    POISON = 377

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage, self.bad = stage, set()

    def start(self, row, ctx):
        if ctx.prompt[0] == self.POISON:
            if self.stage == "start":
                raise RuntimeError("poisoned start")
            self.bad.add(row)
        super().start(row, ctx)

    def propose(self, row, tokens, k):
        if self.stage == "propose" and row in self.bad:
            raise OverflowError("poisoned propose")
        return super().propose(row, tokens, k)

    def observe(self, row, new_tokens, hidden=None):
        if self.stage == "observe" and row in self.bad and len(new_tokens) and self.bad:
            raise ValueError("poisoned observe")
        super().observe(row, new_tokens)

    def stop(self, row, finished):
        self.bad.discard(row)
        super().stop(row, finished)


def _run(engine, requests):
    """Every request through add_request/step, as the server drives it: (ids, completions by id,
    errors by id of the requests that failed alone)."""
    from serving.engine.request import RequestFailed

    ids = [engine.add_request(r) for r in requests]
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RequestFailed as e:
            assert e.request_ids == sorted(e.errors)
            failed.update(e.errors)
            continue
        done.update({o.request_id: o.finished for o in outs if o.finished is not None})
    return ids, done, failed


@pytest.mark.parametrize("stage", ["start", "propose", "observe"])
def test_a_request_that_raises_in_the_engine_fails_alone(tiny_target, tiny_draft, tokenizer, stage):
    """A row whose admission, draft or post-commit update raises fails alone: every other row of
    the batch (a draft model, ngram with a seeded sample, the target alone) finishes with exactly
    its solo output, and the engine serves the next request."""
    def engine():
        drafters = {"small": tiny_draft, "ngram": NgramDrafter(), "poison": _Poisoned(stage), "none": None}
        return SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=128, k=4), drafters=drafters)

    a, b, c, d = ragged_prompts(4, seed=61)
    seeded = SamplingParams(temperature=1.0, seed=7)
    good = [Request(a, max_new_tokens=16, drafter="small"), Request(b, params=seeded, max_new_tokens=16, drafter="ngram"),
            Request(c, max_new_tokens=16, drafter="none")]  # fmt: skip
    solo = [engine().generate([r])[0].token_ids for r in good]
    bad = Request([_Poisoned.POISON, *d], max_new_tokens=16, drafter="poison")
    e = engine()
    ids, done, failed = _run(e, [good[0], bad, good[1], good[2]])
    assert set(failed) == {ids[1]} and "poisoned" in str(failed[ids[1]])
    assert [done[i].token_ids for i in (ids[0], ids[2], ids[3])] == solo
    assert e.num_running == 0 and e.generate([good[0]])[0].token_ids == solo[0]


def test_the_scheduler_fails_only_the_request_that_raised(tiny_target, tiny_draft, tokenizer):
    """Through the server's scheduler: the poisoned request's ticket gets a 500 of its own
    (code request_failed), its neighbours finish with their solo output."""
    import asyncio

    from serving.server.scheduler import Failed, Finished, Scheduler, Ticket

    drafters = {"small": tiny_draft, "poison": _Poisoned("propose"), "none": None}
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=128, k=4), drafters=drafters)
    a, b, c = ragged_prompts(3, seed=71)
    solo = [engine.generate([Request(p, max_new_tokens=12, drafter=d)])[0].token_ids for p, d in ((a, "small"), (c, "none"))]

    async def run():
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(engine)
        tickets = [Ticket(Request(a, max_new_tokens=12), "a", loop, forced_draft="small"),
                   Ticket(Request([_Poisoned.POISON, *b], max_new_tokens=12), "b", loop, forced_draft="poison"),
                   Ticket(Request(c, max_new_tokens=12), "c", loop, forced_draft="none")]  # fmt: skip
        scheduler.start()
        try:
            for t in tickets:
                scheduler.submit(t)
            ends = []
            for t in tickets:
                while not isinstance(event := await asyncio.wait_for(t.events.get(), 60), (Finished, Failed)):
                    pass
                ends.append(event)
            return ends
        finally:
            scheduler.stop()

    ok_a, bad, ok_c = asyncio.run(run())
    assert isinstance(bad, Failed) and bad.error.status == 500 and bad.error.code == "request_failed"
    assert "poisoned propose" in bad.error.message
    assert [ok_a.completion.token_ids, ok_c.completion.token_ids] == solo


# ---- per-request K and mid-request fallback (the router's choices) ----------------------------


def test_each_request_drafts_its_own_k_in_one_batch(tiny_target, tiny_draft, tokenizer):
    prompts = ragged_prompts(6, seed=53)
    drafters = {"small": tiny_draft, "ngram": NgramDrafter(), "none": None}
    config = EngineConfig(max_batch_size=4, max_len=128, k=2, request_k_max=6)
    engine = SpeculativeEngine(tiny_target, tokenizer, config=config, drafters=drafters)
    ks = [1, 6, None, 3, 5, 2]
    outs = engine.generate([Request(p, max_new_tokens=20, drafter="small", k=k) for p, k in zip(prompts, ks)])
    for p, k, out in zip(prompts, ks, outs):
        assert out.token_ids == hf_greedy(tiny_target, p, 20)
        assert len(out.stats["per_position_acceptance"]) == (k or 2)  # its own K, whatever the batch drafts
    with pytest.raises(ValueError, match=r"k=7 \(num_speculative_tokens\) must be in 0..6"):
        engine.add_request(Request(prompts[0], max_new_tokens=4, k=7))


class _Wrong(HostDrafter):
    """Proposes the target's own greedy answer (rows in ``right``) or a token off it (the rest)."""

    def __init__(self, answers, right):
        self.answers, self.right, self.prompts = answers, right, {}

    def start(self, row, ctx):
        self.prompts[row] = ctx.request_id

    def propose(self, row, tokens, k):
        rid = self.prompts[row]
        at = len(tokens) - self.answers[rid][0]
        out = list(self.answers[rid][1][at : at + k])
        return out if rid in self.right else [(t + 7) % 300 + 3 for t in out]


def test_a_row_whose_drafter_stops_paying_falls_back_without_changing_its_output(tiny_target, tokenizer):
    from serving.engine.request import Fallback

    prompts = ragged_prompts(4, seed=59)
    answers = {i: (len(p), hf_greedy(tiny_target, p, 40)) for i, p in enumerate(prompts)}
    drafter = _Wrong(answers, right={3})
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=160, k=4),
                               drafters={"wrong": drafter, "none": None})
    rule = Fallback(min_acceptance=0.3, after_drafted=8)
    # Rows 0 and 2 draft wrong tokens with the rule, row 1 without it, row 3 right ones with it.
    outs = engine.generate([Request(p, max_new_tokens=40, fallback=rule if i != 1 else None)
                            for i, p in enumerate(prompts)])  # fmt: skip
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == answers[i][1]
        assert out.stats["drafter"] == "wrong"
        if i in (0, 2):  # three rejected 4-token drafts (one token each), then one verified token a step:
            # 0 of 8 is not yet evidence of an acceptance below 0.3 (95% bound 0.31), 0 of 12 is (0.22)
            assert out.stats["fallback"] == {"to": "none", "at_token": 4}
            assert out.stats["drafted"] == 12 and out.stats["target_calls"] == 39
        else:
            assert "fallback" not in out.stats and out.stats["drafted"] > 8


@pytest.mark.unit
def test_the_fallback_fires_on_evidence_not_on_a_short_run_of_misses():
    from scipy.stats import binomtest

    from serving.engine.request import Fallback

    model = Fallback(min_acceptance=0.3, after_drafted=8)  # a draft model's floor
    assert not model.fires(0, 8) and model.fires(0, 12)
    assert not model.fires(2, 7)  # too few drafted to judge
    copier = Fallback(min_acceptance=0.03)  # ngram's floor at batch one: a miss costs almost nothing
    assert not copier.fires(0, 16) and not copier.fires(0, 90) and copier.fires(0, 120)
    assert not copier.fires(16, 16)
    # The bound is the exact one: it fires exactly where a one-sided binomial test rejects
    # "acceptance >= floor" at 5%.
    for drafted in (16, 24, 40, 64):
        for accepted in range(drafted):
            rejects = binomtest(accepted, drafted, 0.3, alternative="less").pvalue < 0.05
            assert model.fires(accepted, drafted) == rejects, (accepted, drafted)


def test_a_bad_fallback_rule_names_the_bad_value():
    from serving.engine.request import Fallback

    with pytest.raises(ValueError, match="min_acceptance=1.5"):
        Fallback(min_acceptance=1.5)
    with pytest.raises(ValueError, match="after_drafted=0"):
        Fallback(min_acceptance=0.2, after_drafted=0)
    with pytest.raises(ValueError, match="confidence=1.0"):
        Fallback(min_acceptance=0.2, confidence=1.0)


class FrozenCosts:
    """Step costs that measurement does not move: a goodput test decides from these alone."""

    def __init__(self, ms):
        self.ms = ms  # (rows, width) -> ms

    def observe(self, *args):
        pass

    observe_draft = observe

    def step_ms(self, rows, cap, model_budget=0):
        return self.ms(rows, cap + 1)


def goodput_engine(target, draft, tokenizer, costs=None):
    drafters = {"small": draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(max_cached_requests=4), "none": None}
    config = EngineConfig(max_batch_size=4, max_len=128, k=4, step_k="goodput")
    engine = SpeculativeEngine(target, tokenizer, config=config, drafters=drafters)
    if costs is not None:
        engine.step_costs = FrozenCosts(costs)
    return engine


def test_goodput_steps_keep_every_rows_greedy_output(tiny_target, tiny_draft, tokenizer, monkeypatch):
    """step_k goodput caps proposals per step (here a step of width w costs 1 + (w - 1)^2 / 4, so
    some steps draft and some are capped below their longest proposal): outputs stay the target's."""
    import serving.engine.k_policy as k_policy

    caps, plan = [], k_policy.plan_cap

    def spy(expected, fixed, cost, ks):
        cap = plan(expected, fixed, cost, ks)
        caps.append((cap, max(len(e) - 1 for e in expected)))
        return cap

    monkeypatch.setattr(k_policy, "plan_cap", spy)
    prompts = ragged_prompts(8, seed=41)
    engine = goodput_engine(tiny_target, tiny_draft, tokenizer, lambda rows, width: 1.0 + 0.25 * (width - 1) ** 2)
    outs = engine.generate(mixed_requests(tiny_target, prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 24)
    assert any(o.stats["drafted"] for o in outs)
    assert any(cap is not None and 0 < longest and cap < longest for cap, longest in caps), "no step was capped"


def test_goodput_seeds_its_step_costs_at_load_for_every_width_and_bucket(tiny_target, tiny_draft, tokenizer):
    engine = goodput_engine(tiny_target, tiny_draft, tokenizer)
    widths = engine.verify_widths()
    assert widths == (1, 2, 3, 4, 5)
    assert set(engine.step_costs.verify) == {(rows, w) for rows in (1, 2, 4) for w in widths}
    assert set(engine.step_costs.draft_per_forward) == {1, 2, 4}


@pytest.mark.parametrize("dear", [True, False])
def test_goodput_drafts_only_where_the_wider_step_pays(tiny_target, tiny_draft, tokenizer, dear):
    """Where any proposal makes a step a million times dearer, greedy rows never draft; where a
    wide step costs what a narrow one does, they draft."""
    wide = 1e6 if dear else 1.0
    prompts = ragged_prompts(4, seed=43)
    engine = goodput_engine(tiny_target, tiny_draft, tokenizer, lambda rows, width: 1.0 if width == 1 else wide)
    outs = engine.generate([Request(p, max_new_tokens=16, drafter=n) for p, n in zip(prompts, ["small", "ngram", "suffix", "small"])])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 16)
    drafted = sum(o.stats["drafted"] for o in outs)
    assert (drafted == 0) if dear else (drafted > 0)


def test_goodput_with_auto_k_leaves_a_capped_rows_k_alone(tiny_target, tiny_draft, tokenizer):
    """A row capped to no proposal learned nothing about its drafter: "auto" K must not grow it as
    if every draft had been accepted. Six capped steps, then steps that pay: the first proposal is
    the K every request starts at."""
    config = EngineConfig(max_batch_size=2, max_len=128, k="auto", step_k="goodput")
    engine = SpeculativeEngine(tiny_target, tokenizer, config=config, drafters={"small": tiny_draft})
    engine.step_costs = FrozenCosts(lambda rows, width: 1.0 if width == 1 else 1e6)
    for prompt in ragged_prompts(2, seed=5):  # two rows: a row alone keeps its K
        engine.add_request(Request(prompt, max_new_tokens=40, drafter="small"))
    for _ in range(6):
        engine.step()
    engine.step_costs = FrozenCosts(lambda rows, width: 1.0)
    engine.step()
    stats = engine._slots[0].stats
    assert stats.k_used[:6] == [0] * 6
    assert stats.k_used[6] == engine.k_policy.k_start == 5  # not 8, where six "full accepts" would have moved it


def test_goodput_never_caps_a_seeded_sampled_row(tiny_target, tiny_draft, tokenizer):
    """A seeded sampled row keeps its whole K under goodput (its draws would otherwise depend on
    the batch): its tokens equal the same request alone, though any proposal makes a step a million
    times dearer. (The greedy rows beside it draft too: its K sets the step's width anyway.)"""
    prompts = ragged_prompts(3, seed=47)
    params = SamplingParams(temperature=0.9, seed=77)
    engine = goodput_engine(tiny_target, tiny_draft, tokenizer, lambda rows, width: 1.0 if width == 1 else 1e6)
    outs = engine.generate([Request(prompts[0], max_new_tokens=16, drafter="small", params=params),
                            *[Request(p, max_new_tokens=16, drafter="small") for p in prompts[1:]]])  # fmt: skip
    alone = engine_with_every_drafter(tiny_target, tiny_draft, tokenizer, batch=1)
    [one] = alone.generate([Request(prompts[0], max_new_tokens=16, drafter="small", params=params)])
    assert outs[0].token_ids == one.token_ids and outs[0].stats["drafted"] > 0
    for prompt, out in zip(prompts[1:], outs[1:]):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 16)

"""``auto``: a drafter per row and step (issue 62).

Tier 1: the scores and the policy on hand-made numbers; the catch-up's chunks. Tier 3: ``auto``
rows in a mixed batch give the target's greedy output; seeded sampled ``auto`` rows give the same
tokens whatever else is in the batch; one row's record never steers another's choice; a model
drafter that skipped steps catches up and drafts what a drafter that never skipped drafts."""

import pytest
import torch

from serving.engine.core import SpeculativeEngine
from serving.engine.drafters.auto import AutoDrafter, HybridPolicy, Record, Scores, host_key
from serving.engine.drafters.model import CATCH_UP, ModelDrafter, catch_up_chunks
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.drafters.suffix import SuffixDrafter
from serving.engine.engine_settings import EngineConfig
from serving.engine.goodput import RowCosts
from serving.engine.request import Request
from serving.engine.sampling import SamplingParams
from serving.tools.drafting_replay import Replay, Trace
from tests.test_engine_tiny import hf_greedy, ragged_prompts

# verify by width; a draft forward costs a third of a one-token verify, a catch-up more with its width
COSTS = RowCosts(verify=[[1, 30.0], [2, 33.0], [3, 36.0], [4, 39.0], [5, 42.0]],
                 model={"small": [[1, 10.0], [2, 11.0], [4, 12.0], [16, 20.0], [64, 50.0]]},
                 host={"ngram": 0.01, "suffix": 0.01, "prediction": 0.01})
WIDTHS = (1, 2, 3, 4, 5)


@pytest.mark.unit
def test_a_record_pools_the_positions_a_proposal_tested():
    r = Record()
    r.add(4, 4)  # all held: 4 tested, 4 hits
    r.add(4, 1)  # the second failed: 2 tested, 1 hit
    r.add(3, 0)  # the first failed: 1 tested
    assert (r.hits, r.trials) == (5, 7)
    assert r.acceptance(prior=0.5, weight=1.0) == pytest.approx(5.5 / 8)


@pytest.mark.unit
def test_scores_settle_a_proposal_once_the_committed_tokens_decide_it():
    s = Scores()
    s.propose("suffix", 3, [7, 8, 9])  # positions 3, 4, 5
    s.propose("ngram", 3, [7, 5])
    s.settle([0, 1, 2, 7])  # position 3 committed: both still agree, neither is decided
    assert s.records == {} and len(s.pending) == 2
    s.settle([0, 1, 2, 7, 8])  # ngram's 5 is wrong at position 4: decided, 1 accepted of 2
    assert s.records[host_key("ngram", 2)].hits == 1 and s.records[host_key("ngram", 2)].trials == 2
    s.settle([0, 1, 2, 7, 8, 9, 4])  # suffix's whole proposal held
    assert s.records[host_key("suffix", 3)].hits == 3 and s.pending == []


@pytest.mark.unit
def test_the_policy_picks_by_expected_tokens_per_ms():
    policy = HybridPolicy(COSTS, WIDTHS, default_prior=0.3)
    fresh = Scores()
    # Nothing known: a model accepted 30% of the time does not pay for its forwards.
    assert policy.choose(fresh, 4, {}, {"small": 0}).drafter is None
    # A long copy that has held every time: copy it.
    held = Scores()
    for _ in range(10):
        held.add("suffix", 4, 4, key=host_key("suffix", 4))
    choice = policy.choose(held, 4, {"suffix": [1, 2, 3, 4]}, {"small": 0})
    assert (choice.drafter, choice.k, choice.tokens) == ("suffix", 4, [1, 2, 3, 4])
    # A model that is accepted nearly always: draft with it, the whole budget.
    good = Scores()
    for _ in range(10):
        good.add("small", 4, 4)
    assert policy.choose(good, 4, {}, {"small": 0}) == policy.choose(good, 4, {"ngram": [3]}, {"small": 0})
    assert (policy.choose(good, 4, {}, {"small": 0}).drafter, policy.choose(good, 4, {}, {"small": 0}).k) == ("small", 4)
    # A budget of 0 drafts nothing.
    assert policy.choose(good, 0, {}, {"small": 0}).drafter is None


@pytest.mark.unit
def test_a_long_catch_up_makes_the_model_dearer():
    good = Scores()
    for _ in range(10):
        good.add("small", 4, 3)
    policy = HybridPolicy(COSTS, WIDTHS, catch_up_weight=0.0)
    near = policy.choose(good, 4, {}, {"small": 0})
    far = policy.choose(good, 4, {}, {"small": 200})  # 200 tokens to read first: 4 forwards of 64 and more
    assert near.drafter == "small" and far.drafter is None


@pytest.mark.unit
def test_catch_up_chunks_cover_the_gap_with_few_forwards():
    assert catch_up_chunks(0) == []
    assert catch_up_chunks(3) == [4]
    assert catch_up_chunks(20) == [16, 4]
    assert catch_up_chunks(70) == [64, 4, 4]
    for gap in range(1, 200):
        chunks = catch_up_chunks(gap)
        assert sum(chunks) >= gap and sum(chunks) - chunks[-1] < gap and set(chunks) <= set(CATCH_UP)


@pytest.mark.unit
def test_the_policy_replays_over_a_trace_within_the_bounds():
    T = 40
    proposed = {"suffix": [4 if t % 10 < 5 else 1 for t in range(T)], "small": [4] * T}
    accepted = {"suffix": [4 if t % 10 < 4 else 0 for t in range(T)], "small": [2] * T}
    accepted = {n: [min(a, T - 1 - t) for t, a in enumerate(v)] for n, v in accepted.items()}
    replay = Replay(Trace(T, proposed, accepted), COSTS, WIDTHS, 4)
    out = replay.policy(HybridPolicy(COSTS, WIDTHS))
    assert replay.per_step_best().ms <= out.ms + 1e-9
    assert sum(out.choices.values()) == out.steps
    assert out.choices.get("suffix", 0) > 0  # the long copies are taken


def auto_engine(target, draft, tokenizer, batch, k=4, cached=4):
    drafters = {"small": draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(max_cached_requests=cached),
                "auto": AutoDrafter(costs=COSTS), "none": None}
    return SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=batch, max_len=128, k=k), drafters=drafters)


def auto_requests(prompts, max_new=24, params=None):
    names = ["auto", "small", "auto", "suffix", "auto", "none"]
    return [Request(p, params or SamplingParams(), max_new_tokens=max_new, drafter=names[i % len(names)])
            for i, p in enumerate(prompts)]  # fmt: skip


@pytest.mark.integration
def test_auto_rows_in_a_mixed_batch_are_the_targets_greedy_output(tiny_target, tiny_draft, tokenizer):
    prompts = ragged_prompts(12, seed=41)
    engine = auto_engine(tiny_target, tiny_draft, tokenizer, batch=4)
    outs = engine.generate(auto_requests(prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 24)
    shares = [o.stats["drafter_shares"] for o in outs if o.stats["drafter"] == "auto"]
    assert all(abs(sum(s.values()) - 1.0) < 1e-9 for s in shares)
    used = {d for s in shares for d in s}
    assert "small" in used and len(used) >= 2  # the model drafted some steps and something else others


@pytest.mark.integration
def test_seeded_auto_rows_do_not_depend_on_the_batch(tiny_target, tiny_draft, tokenizer):
    prompts = ragged_prompts(6, seed=43)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    batched = auto_engine(tiny_target, tiny_draft, tokenizer, batch=4).generate(auto_requests(prompts, params=params))
    alone = [auto_engine(tiny_target, tiny_draft, tokenizer, batch=1).generate([r])[0]
             for r in auto_requests(prompts, params=params)]  # fmt: skip
    for a, b in zip(batched, alone):
        assert a.token_ids == b.token_ids
        assert a.stats["drafter_shares"] == b.stats["drafter_shares"]  # the same choices, step by step


@pytest.mark.integration
def test_one_rows_record_never_steers_another(tiny_target, tiny_draft, tokenizer):
    """Each row's scores after a batch are what it builds alone: nothing of the other rows'
    verdicts (``suffix`` without its cross-request cache, which shares answers by design)."""
    prompts = ragged_prompts(4, seed=47)

    def scores_of(requests, batch):
        engine = auto_engine(tiny_target, tiny_draft, tokenizer, batch=batch, cached=0)
        auto, seen = engine.drafters["auto"], {}
        settle = auto.settle

        def spy(row, drafted, accepted):
            settle(row, drafted, accepted)
            seen[row] = {k: (r.hits, r.trials) for k, r in auto.scores(row).records.items()}

        auto.settle = spy
        engine.generate(requests)
        return seen

    together = scores_of([Request(p, max_new_tokens=24, drafter="auto") for p in prompts], 4)
    assert len({str(v) for v in together.values()}) == 4  # four different records
    for b, p in enumerate(prompts):
        assert scores_of([Request(p, max_new_tokens=24, drafter="auto")], 1)[0] == together[b]


@pytest.mark.integration
def test_a_model_drafter_that_skipped_steps_drafts_as_if_it_never_had(tiny_target, tiny_draft, tokenizer):
    """After skipped steps the catch-up reads what the row committed, so the next draft's q is the
    one a drafter that read every token would give; the prompt is read on the first draft only."""
    prompt = ragged_prompts(1, seed=53)[0]
    answer = hf_greedy(tiny_target, prompt, 40)
    runs, prefills = {}, {}
    for skip in (False, True, "late", "never"):
        drafter = ModelDrafter(tiny_draft)
        engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=128, k=4),
                                   drafters={"small": drafter})  # fmt: skip
        if skip:  # True: the row drafts on its first step only, then none until the last; late: none until then
            calls = {"n": 0}
            real = engine.k_policy.row_k

            def row_k(slot, real=real, first=skip is True, last=30 if skip != "never" else 10**6):
                calls["n"] += 1
                return real(slot) if (first and calls["n"] == 1) or len(slot.generated) >= last else 0

            engine.k_policy.row_k = row_k
        prefill = drafter.runner.prefill
        prefills[skip] = []
        drafter.runner.prefill = lambda ids, r, *a, prefill=prefill, seen=prefills[skip]: seen.append(ids.shape[1]) or prefill(ids, r, *a)
        qs = []
        propose = drafter.propose_rows

        def spy(batch, propose=propose):
            p = propose(batch)
            if p is not None:
                qs.append((int(batch.state.lengths[0]), p.q[0, 0].clone()))
            return p

        drafter.propose_rows = spy
        [out] = engine.generate([Request(prompt, max_new_tokens=40, drafter="small")])
        assert out.token_ids == answer
        runs[skip] = dict(qs)
    # The draft reads the prompt once, when the row first drafts; a row that never drafts never reads it.
    assert prefills == {False: [len(prompt)], True: [len(prompt)], "late": [len(prompt)], "never": []}
    for skipping in (True, "late"):
        late = [n for n in runs[skipping] if n >= len(prompt) + 30]
        assert late, "the skipping row drafted again"
        for n in late:
            if n in runs[False]:
                torch.testing.assert_close(runs[skipping][n], runs[False][n], rtol=1e-4, atol=1e-5)
        assert any(n in runs[False] for n in late), "no step of the two runs drafted at the same length"

"""The replay ceiling's math (serving.tools.drafting_replay) and the cost model it prices with
(serving.engine.goodput.RowCosts), on hand-made traces."""

import itertools
import random

import pytest
import torch

from serving.engine.goodput import RowCosts
from serving.tools.drafting_replay import Replay, Trace, verify_width
from tests.conftest import load_script

pytestmark = pytest.mark.unit

WIDTHS = (1, 2, 3, 5)  # K = 4, with the shorter buckets host proposals round up to
COSTS = RowCosts(
    verify=[[1, 10.0], [5, 14.0]],  # 1 ms a token past the first
    model={"draft": [[1, 3.0], [9, 7.0]]},  # a catch-up of w tokens: 2.5 + w / 2 ms
    host={"ngram": 0.1, "suffix": 0.2},
)


def test_row_costs_interpolate_and_price_a_model_chain_with_its_catch_up():
    assert COSTS.verify_ms(3) == pytest.approx(12.0)
    assert COSTS.verify_ms(9) == pytest.approx(18.0)  # past the last point: the last segment's slope
    assert COSTS.draft_ms("draft", 4) == pytest.approx(4 * 3.0)
    assert COSTS.draft_ms("draft", 4, catch_up=5) == pytest.approx(5.0 + 3 * 3.0)
    assert COSTS.draft_ms("ngram", 4) == 0.1 and COSTS.draft_ms(None, 4) == 0.0
    with pytest.raises(KeyError, match="'eagle'"):
        COSTS.draft_ms("eagle", 4)
    with pytest.raises(ValueError, match="catch_up=0"):
        COSTS.draft_ms("draft", 4, catch_up=0)


def test_verify_width_rounds_a_short_proposal_up_to_a_bucket():
    assert [verify_width(n, WIDTHS) for n in range(5)] == [1, 2, 3, 5, 5]
    with pytest.raises(ValueError, match="5 tokens"):
        verify_width(5, WIDTHS)


def test_trace_refuses_an_acceptance_longer_than_its_proposal():
    with pytest.raises(ValueError, match="'ngram'"):
        Trace(3, {"ngram": [0, 2, 1]}, {"ngram": [0, 3, 1]})
    with pytest.raises(ValueError, match="3 proposal"):
        Trace(3, {"ngram": [0, 2]}, {"ngram": [0, 2]})


def test_single_policies_step_through_the_answer():
    T = 11
    trace = Trace(T, {"ngram": [4] * T, "draft": [4] * T}, {"ngram": [4] * T, "draft": [1] * T},
                  prefill_ms=50.0, model_prefill_ms={"draft": 20.0})  # fmt: skip
    replay = Replay(trace, COSTS, WIDTHS, k=4)
    alone = replay.single(None)
    assert alone.steps == T - 1 and alone.ms == pytest.approx(50.0 + 10 * 10.0)
    ngram = replay.single("ngram")  # 5 tokens a step from t = 1: 1 -> 6 -> 11
    assert ngram.steps == 2 and ngram.ms == pytest.approx(50.0 + 2 * (0.1 + 14.0))
    draft = replay.single("draft")  # 2 tokens a step: 1 -> 3 -> 5 -> 7 -> 9 -> 11; catch-up 1 each time
    assert draft.steps == 5 and draft.choices == {"draft": 5}
    assert draft.ms == pytest.approx(50.0 + 20.0 + 5 * (4 * 3.0 + 14.0))


def test_the_model_drafter_pays_for_the_tokens_it_skipped():
    T = 9
    trace = Trace(T, {"ngram": [0, 4, 4, 4, 4, 4, 4, 4, 4], "draft": [4] * T},
                  {"ngram": [0, 3, 0, 0, 0, 0, 0, 0, 0], "draft": [4] * T})  # fmt: skip
    replay = Replay(trace, COSTS, WIDTHS, k=4)
    ms, t, d = replay.step("ngram", 1, 0)
    assert (t, d) == (5, 0) and ms == pytest.approx(0.1 + 14.0)
    ms, t, d = replay.step("draft", 5, 0)  # reads the 5 answer tokens it never saw, then 3 more forwards
    assert (t, d) == (9, 8) and ms == pytest.approx(5.0 + 3 * 3.0 + 14.0)


def test_switching_drafters_per_step_beats_every_single_one():
    T = 21  # ngram knows the first half, suffix the second
    half = T // 2
    trace = Trace(T, {"ngram": [4] * T, "suffix": [4] * T},
                  {"ngram": [4] * half + [0] * (T - half), "suffix": [0] * half + [4] * (T - half)})  # fmt: skip
    replay = Replay(trace, COSTS, WIDTHS, k=4)
    singles = [replay.single(x).ms for x in (None, "ngram", "suffix")]
    greedy, best = replay.per_step_greedy(), replay.per_step_best()
    assert best.ms <= greedy.ms + 1e-9 < min(singles)
    assert set(best.choices) >= {"ngram", "suffix"}


def _brute_force(replay: Replay, options) -> float:
    """The least cost over every sequence of per-step choices (tiny answers only)."""
    T, found = replay.trace.answer_len, []

    def walk(t, d, ms, used_model):
        if t >= T:
            prefill = replay.trace.prefill_ms + (replay.trace.model_prefill_ms.get("draft", 0.0) if used_model else 0.0)
            found.append(ms + prefill)
            return
        for x in options:
            step_ms, t2, d2 = replay.step(x, t, d)
            walk(t2, d2, ms + step_ms, used_model or x == "draft")

    walk(1, 0, 0.0, False)
    return min(found)


@pytest.mark.parametrize("seed", range(12))
def test_per_step_best_is_the_least_cost_over_every_sequence_of_choices(seed):
    rng = random.Random(seed)
    T = rng.randint(2, 8)
    proposed = {x: [rng.randint(0, 4) for _ in range(T)] for x in ("ngram", "suffix")}
    proposed["draft"] = [4] * T
    accepted = {x: [rng.randint(0, p) for p in ps] for x, ps in proposed.items()}
    trace = Trace(T, proposed, accepted, prefill_ms=30.0, model_prefill_ms={"draft": rng.choice([0.0, 8.0, 40.0])})
    replay = Replay(trace, COSTS, WIDTHS, k=4)
    best = replay.per_step_best()
    assert best.ms == pytest.approx(_brute_force(replay, [None, "ngram", "suffix", "draft"]))
    assert sum(best.choices.values()) == best.steps
    for policy in itertools.chain([replay.per_step_greedy()], (replay.single(x) for x in (None, "ngram", "suffix", "draft"))):
        assert best.ms <= policy.ms + 1e-9


@pytest.mark.integration
@pytest.mark.parametrize("drafter", ["small", "ngram", "suffix"])
def test_the_replay_takes_the_steps_the_engine_takes(tiny_target, tiny_draft, tokenizer, drafter):
    """scripts/experiments/replay_ceiling.py's traces (a host drafter asked at every position; the
    draft model teacher-forced over the answer) replayed as a single policy give the live
    engine's own number of target calls, on tiny models."""
    from serving.engine.core import SpeculativeEngine
    from serving.engine.engine_settings import EngineConfig
    from serving.engine.request import Request
    from serving.engine.drafters.ngram import NgramDrafter
    from serving.engine.drafters.suffix import SuffixDrafter

    script, k = load_script("scripts/experiments/replay_ceiling.py"), 4
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=1, max_len=128, k=k),
                               drafters={"small": tiny_draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(), "none": None})  # fmt: skip
    mirror = {"ngram": NgramDrafter(), "suffix": SuffixDrafter()}  # one each, as the engine's: suffix's cache spans requests
    for seed in range(3):
        prompt = torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(seed)).tolist() * 2  # repeats: ngram finds some
        [live] = engine.generate([Request(prompt, max_new_tokens=40, drafter=drafter)])
        answer = list(live.token_ids)
        if drafter == "small":
            proposed, accepted, _ = script.model_trace(engine.drafters["small"].runner, prompt, answer, k, chunk=k + 1)
        else:
            proposed, accepted, _ = script.host_trace(mirror[drafter], prompt, None, answer, k, request_id=seed)
        costs = RowCosts(verify=[[1, 1.0], [5, 2.0]], model={"small": [[1, 0.5], [9, 1.0]]}, host={"ngram": 0.0, "suffix": 0.0})
        replay = Replay(Trace(len(answer), {drafter: proposed}, {drafter: accepted}), costs, engine.verify_widths(), k)
        outcome = replay.single(drafter)
        assert outcome.steps == live.stats["target_calls"], (drafter, seed)

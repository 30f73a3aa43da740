"""Tier 1: the step's K for a whole batch (``serving.engine.goodput``), on hand-made numbers."""

import pytest

from serving.engine.goodput import StepCosts, expected_from_counts, plan_cap

pytestmark = pytest.mark.unit

KS = (1, 2, 4)


def costs(table: dict[int, float]):
    return lambda c: table.get(c)


def test_a_full_batch_speculates_one_token_when_only_one_pays():
    """8 rows that each survive a first draft half the time: K=1 costs 12% more than a one-token
    step for 1.5x the tokens; K=2 costs 67% more for 1.75x; K=4 2.35x for about 1.94x."""
    row = [1.0, 1.5, 1.75, 1.875, 1.9375]
    cap = plan_cap([row] * 8, [False] * 8, costs({0: 142.0, 1: 159.0, 2: 237.0, 4: 333.0}), KS)
    assert cap == 1


def test_one_row_alone_drafts_its_whole_proposal_when_wide_steps_are_cheap():
    row = [1.0, 1.9, 2.7, 3.4, 4.0]
    assert plan_cap([row], [False], costs({0: 68.0, 1: 73.0, 2: 67.0, 4: 88.0}), KS) == 4


def test_rows_that_never_survive_a_draft_make_the_step_verify_one_token():
    assert plan_cap([[1.0, 1.0, 1.0]] * 4, [False] * 4, costs({0: 88.0, 1: 102.0, 2: 124.0}), KS) == 0


def test_the_cap_reaches_the_bucket_that_holds_the_longest_proposal():
    """A proposal of 3 tokens runs at bucket 4: the candidates go up to it, not to 2."""
    row = [1.0, 2.0, 3.0, 4.0]
    assert plan_cap([row], [False], costs({0: 10.0, 1: 10.0, 2: 10.0, 4: 10.0}), KS) == 4


def test_a_seeded_sampled_row_keeps_its_budget_and_sets_the_floor():
    """The fixed row's 2 tokens round up to bucket 2: nothing narrower is a candidate, however cheap."""
    greedy, sampled = [1.0, 1.1, 1.2, 1.3, 1.4], [1.0, 1.1, 1.2]
    cap = plan_cap([greedy, sampled], [False, True], costs({0: 1.0, 1: 1.0, 2: 100.0, 4: 200.0}), KS)
    assert cap == 2


def test_shapes_without_a_cost_are_skipped_and_none_known_leaves_the_rows_alone():
    row = [1.0, 1.9, 2.7]
    assert plan_cap([row], [False], costs({2: 10.0}), KS) == 2
    assert plan_cap([row], [False], costs({}), KS) is None


def test_ties_go_to_the_cheaper_step():
    assert plan_cap([[1.0, 2.0, 2.0]], [False], costs({0: 1.0, 1: 2.0, 2: 2.0}), KS) == 0


def test_expected_tokens_follow_the_prior_then_the_rows_own_record():
    assert expected_from_counts([], [], 3, 0.5) == pytest.approx([1.0, 1.5, 1.75, 1.875])
    # 40 drafts at position 0, all accepted; 40 at position 1, none: the record outweighs the prior.
    e = expected_from_counts([40, 0], [40, 40], 2, 0.5, prior_weight=4.0)
    assert e == pytest.approx([1.0, 1.0 + 42 / 44, 1.0 + 42 / 44 + 1 / 44])


def test_step_costs_measured_then_profiled_then_the_nearest_narrower_shape():
    table = [[1, 1, 60.0], [1, 5, 80.0], [8, 1, 140.0], [8, 5, 330.0]]
    c = StepCosts(table, weight=0.5)
    assert c.verify_ms(8, 3) == pytest.approx(235.0)  # linear in the tokens at 8 rows
    c.observe(8, 3, 200.0)
    c.observe(8, 3, 300.0)
    assert c.verify_ms(8, 3) == pytest.approx(250.0)  # the moving average of what ran
    bare = StepCosts()
    assert bare.verify_ms(4, 2) is None
    bare.observe(4, 1, 90.0)
    assert bare.verify_ms(4, 5) == 90.0  # unmeasured: priced as the nearest narrower measured width
    bare.observe(4, 3, 120.0)
    bare.observe_draft(4, 2, 30.0)  # two draft-model forwards in 30 ms
    assert bare.step_ms(4, 2, model_budget=4) == pytest.approx(120.0 + 2 * 15.0)
    assert bare.step_ms(4, 2, model_budget=1) == pytest.approx(120.0 + 15.0)  # one forward: the budget is 1
    assert bare.step_ms(4, 2, model_budget=0) == 120.0


def test_a_drafter_no_row_has_tried_is_priced_by_its_pooled_record_starting_optimistic():
    """Without a router's prediction a row is priced with its drafter's record over the engine's
    recent steps: it starts optimistic, so a first step drafts (a low start would cap every row at 0,
    and the drafter would never show what it accepts), then follows what the drafter's rows accepted."""
    import torch

    from serving.engine import Request
    from serving.engine.drafters.base import Drafter
    from serving.engine.engine_settings import EngineConfig
    from serving.engine.k_policy import POOL_START, KPolicy
    from serving.engine.slots import Slot
    from serving.engine.stats import RequestStats

    class Small(Drafter):
        kind, host, k, owns_rows = "model", False, None, True

    config = EngineConfig(max_batch_size=2, max_len=64, k=4, step_k="goodput")
    policy = KPolicy(config, {"small": Small()})
    slot = Slot(0, Request([1, 2, 3]), 3, torch.Generator(), [4], [], RequestStats(), 0.0, "small")
    other = Slot(1, Request([1, 2]), 2, torch.Generator(), [4], [], RequestStats(), 0.0, "small")
    step = StepCosts()
    for width, ms in {1: 65.0, 2: 67.0, 3: 69.0, 5: 73.0}.items():
        step.observe(2, width, ms)
    step.observe_draft(2, 1, 20.0)  # a draft forward: K tokens cost K of these
    assert policy.pooled_a("small") == POOL_START
    assert policy.cap([slot, other], [4, 4], None, step)[0] >= 3  # 0.8 a token: about 6 tokens for 130-150 ms beat 2 for 65
    for _ in range(200):  # its rows then reject most first drafts
        policy.after_step(slot, 4, 4, 0)
    assert policy.pooled_a("small") < 0.1 and policy.cap([slot, other], [4, 4], None, step) == [0, 0] and policy.cut == {0, 1}
    assert policy.cap([slot, None], [4, 0], None, step) == [4, 0]  # alone it keeps its K even so
    for s in (slot, other):  # a router's prediction prices its own request
        s.prior_a, s.routed_prior = 0.95, True
    assert policy.cap([slot, other], [4, 4], None, step)[0] >= 3

"""The router's workload (issue 30): six task families with a fixed split by prompt, drafter and K
chosen together for the batch a request joins, the fallback floor, and train-router learning from
served requests' logs (one measured drafter per prompt)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from routing.collect import load_sources
from routing.config import CollectConfig, RouterTrainConfig, SourceConfig
from routing.dataset import load_served, load_table
from routing.router import NONE, Router
from routing.train import train
from serving.engine.goodput import committed_tokens, per_token_acceptance
from serving.workload import FAMILIES, SPLITS, load_family, load_workload, split_of
from tests.conftest import load_script

# ---- the workload ------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_split_is_a_fixed_function_of_the_prompt_id():
    ids = [f"family/{i}" for i in range(4000)]
    shares = Counter(split_of(i) for i in ids)
    assert abs(shares["train"] / 4000 - 0.6) < 0.03 and abs(shares["val"] / 4000 - 0.2) < 0.03
    assert abs(shares["test"] / 4000 - 0.2) < 0.03
    assert [split_of(i) for i in ids[:200]] == [split_of(i) for i in ids[:200]]


@pytest.mark.unit
def test_each_family_gives_disjoint_splits_labelled_with_the_family():
    for family in FAMILIES:
        by_split = {s: load_family(family, s, 3) for s in SPLITS}
        ids = [p.id for ps in by_split.values() for p in ps]
        assert len(ids) == len(set(ids)) == 9, family
        assert all(p.domain == family and split_of(p.id) == s for s, ps in by_split.items() for p in ps)
    assert load_family("code", "test", 3, offset=2) == load_family("code", "test", 5)[2:]
    # Extraction and summaries alternate inside one family.
    assert {p.id.split("/")[0] for p in load_family("extract", "train", 4)} == {"extract", "summarize"}
    assert [p.domain for p in load_workload("val", 1)] == list(FAMILIES)


@pytest.mark.unit
def test_a_bad_family_or_split_names_the_value():
    with pytest.raises(ValueError, match="unknown family 'poetry'"):
        load_family("poetry", "test", 1)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        load_family("code", "dev", 1)


@pytest.mark.unit
def test_collect_takes_a_family_split_as_a_source():
    cfg = CollectConfig(sources=[SourceConfig(family="all", split="val", n=1), SourceConfig(family="edit", split="test", n=2)])
    prompts = load_sources(cfg)
    assert [p.domain for p in prompts] == [*FAMILIES, "edit", "edit"]
    assert [split_of(p.id) for p in prompts] == ["val"] * 6 + ["test"] * 2


# ---- drafter and K for the load ----------------------------------------------------------------


@pytest.fixture(scope="module")
def costed_router():
    """One draft that costs 0.05 of a target step and 1.5 per verification (K = 4, batch 1), a
    target forward of 100 ms + 10 ms per token."""
    router = Router.create({"a": "draft-a", NONE: None}, "target", objective="speedup",
                           costs={"a": {"draft_cost": 0.05, "verify_cost": 1.5}})  # fmt: skip
    router.info |= {"collected_k": 4, "step_model": {"base_ms": 100.0, "per_token_ms": 10.0}}
    return router


@pytest.mark.unit
def test_a_fuller_batch_makes_drafting_worth_less(costed_router):
    r = costed_router
    for rate in (0.2, 0.5, 0.8):
        alone, full = r.decide(torch.tensor([[rate]]), 1)[0], r.decide(torch.tensor([[rate]]), 8)[0]
        assert full.predicted_speedup["a"] < alone.predicted_speedup["a"]
        assert (full.k if full.draft == "a" else 0) <= alone.k
    # Worth drafting alone, not in a batch of eight: the choice flips to the target alone.
    alone, full = r.decide(torch.tensor([[0.3]]), 1)[0], r.decide(torch.tensor([[0.3]]), 8)[0]
    assert (alone.draft, full.draft) == ("a", NONE)
    assert full.k == 0 and full.occupancy == 8
    # A high acceptance earns a long K alone and a shorter one in a full batch.
    alone, full = r.decide(torch.tensor([[0.8]]), 1)[0], r.decide(torch.tensor([[0.8]]), 8)[0]
    assert alone.k == 8 and 1 <= full.k < 8
    with pytest.raises(ValueError, match="occupancy=0"):
        r.choose_batch(["x"], occupancy=0)


@pytest.mark.unit
def test_a_draft_models_own_work_weighs_on_the_whole_batch():
    """At occupancy b a drafter's forwards hold up all b rows: its cost weighs b T(1, 1) / T(b, 1)
    (the step table's), so a draft model that wins alone loses a full batch to a copying drafter
    predicted slower alone; at b = 1 nothing changes."""
    costs = {"model": {"draft_cost": 0.25, "verify_cost": 1.1}, "copy": {"draft_cost": 0.003, "verify_cost": 1.1}}
    r = Router.create({"model": "m", "copy": "c", NONE: None}, "target", objective="speedup", costs=costs)
    table = [[1, 1, 70.0], [1, 5, 72.0], [8, 1, 88.0], [8, 2, 113.0], [8, 5, 213.0]]
    r.info |= {"collected_k": 4, "step_table": table}
    assert r.cost_model.draft_share(1) == 1.0
    assert r.cost_model.draft_share(8) == pytest.approx(8 * 70.0 / 88.0)
    rates = torch.tensor([[0.95, 0.3]])  # [1, D]: the model drafter accepts far more
    alone, full = r.decide(rates, 1)[0], r.decide(rates, 8)[0]
    assert alone.draft == "model" and full.draft == "copy"
    # Exactly the batch-one cost with c scaled by the share (the verify shift unchanged).
    bare = Router.create({"model": "m", "copy": "c", NONE: None}, "target", objective="speedup",
                         costs={**costs, "model": {"draft_cost": 0.25 * r.cost_model.draft_share(8), "verify_cost": 1.1}})  # fmt: skip
    bare.info |= {"collected_k": 4, "step_table": table}
    bare.cost_model.draft_share = lambda occupancy: 1.0
    assert r.cost_model.speedups(rates, 8)[0][0, 0] == pytest.approx(bare.cost_model.speedups(rates, 8)[0][0, 0])
    # Without a step table or model the target's step is taken not to grow: the share is b.
    plain = Router.create({"model": "m", NONE: None}, "target", objective="speedup", costs={"model": costs["model"]})
    assert plain.cost_model.draft_share(8) == 8.0


@pytest.mark.unit
def test_a_drafter_that_proposes_only_on_a_match_pays_the_wider_verify_only_then():
    """``ngram`` with fill 0.5 widens the verify on half its calls: past the collected K its
    predicted speedup loses half the extra width a draft model with the same numbers loses."""
    cost = {"draft_cost": 0.003, "verify_cost": 1.0, "fill": 0.5}
    r = Router.create({"model": "m", "copy": "ngram", NONE: None}, "target", objective="speedup",
                      costs={"model": dict(cost), "copy": dict(cost)}, k_buckets=(8,))  # fmt: skip
    r.info |= {"collected_k": 4, "step_table": [[1, 1, 70.0], [1, 5, 70.0], [1, 9, 105.0]]}
    speed, _ = r.cost_model.speedups(torch.tensor([[0.7, 0.7]]), 1)  # [1, D]
    e = float(committed_tokens(per_token_acceptance(torch.tensor(0.7), 4), torch.tensor(8.0), 0.5))
    assert float(speed[0, 0]) == pytest.approx(e / (8 * 0.003 + 1.0 + 0.5))  # the whole shift, 105 / 70 - 1
    assert float(speed[0, 1]) == pytest.approx(e / (8 * 0.003 + 1.0 + 0.25))  # half of it
    assert r.cost_model.break_even("copy", 8) < r.cost_model.break_even("model", 8)


@pytest.mark.unit
def test_break_even_is_where_the_cost_model_ties_with_the_target_alone(costed_router):
    r = costed_router
    for occupancy in (1, 4, 8):
        rate = r.cost_model.break_even("a", 4, occupancy)
        r.cost_model.k_buckets = [4]
        try:
            speed, _ = r.cost_model.speedups(torch.tensor([[rate]]), occupancy)
        finally:
            r.cost_model.k_buckets = list(range(1, 9))
        assert float(speed) == pytest.approx(1.0, abs=2e-3)
    assert r.cost_model.break_even("a", 4, 8) > r.cost_model.break_even("a", 4, 1)


@pytest.mark.unit
def test_the_fallback_floor_is_the_lower_of_break_even_and_a_share_of_the_prediction(costed_router):
    high = costed_router.decide(torch.tensor([[0.8]]), 1)[0]
    assert high.fallback_floor(0.75) == pytest.approx(high.break_even)  # break-even is far below 0.75 x 0.8
    low = costed_router.decide(torch.tensor([[0.2]]), 1)[0]
    assert low.draft == "a" and low.fallback_floor(0.75) == pytest.approx(min(low.break_even, 0.75 * low.expected_rate))
    # The prediction (a rate at the collected K = 4) read at the chosen K: shorter K, higher rate.
    assert low.k < 4 and low.expected_rate > 0.2 and costed_router.rate_at(0.2, 4) == pytest.approx(0.2, abs=1e-4)
    none = costed_router.decide(torch.tensor([[0.3]]), 8)[0]
    assert none.fallback_floor(0.75) == 0.0


# ---- learning from served requests -------------------------------------------------------------

CODE = [f"def helper_{i}(values):\n    return sorted(values)[{i}]" for i in range(12)]
CHAT = [f"Write a friendly note to my neighbour number {i} about the garden party." for i in range(12)]
SHIFTED = [f"Translate sentence {i} of the letter into French, keeping every name as it is." for i in range(12)]


def _row(pid: str, domain: str, text: str, draft: str, acc: float | None, split: str | None = None, **extra) -> dict:
    return {"prompt_id": pid, "domain": domain, "split": split, "text": text, "use_chat_template": True, "draft": draft,
            "draft_ref": None if draft == NONE else f"ref-{draft}", "target": "target", "target_weights": "int8",
            "mode": "greedy", "repeat": 0, "k": 0 if draft == NONE else 4, "acceptance_rate": acc or 0.0,
            "speedup": 1.0 if draft == NONE else 1.0 + (acc or 0.0), "draft_step_ms": 0.0 if draft != "model" else 30.0,
            "target_step_ms": 100.0 if draft == NONE else 140.0} | extra  # fmt: skip


def _collected(path: Path, prompts: dict[str, list[str]], acc: dict[str, dict[str, float]], split=lambda i: None,
               start: int = 0) -> Path:  # fmt: skip
    rows = []
    for domain, texts in prompts.items():
        for i, text in enumerate(texts, start=start):
            pid = f"{domain}/{i}"
            rows += [_row(pid, domain, text, NONE, None, split(i))]
            rows += [_row(pid, domain, text, d, a, split(i)) for d, a in acc[domain].items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.unit
def test_rows_carry_their_drafts_precision_and_one_router_learns_one(tmp_path):
    """A draft's step cost and acceptance depend on engine.draft_weights as the target's do on
    target_weights: the table keeps the precision the rows record, refuses rows that mix two, and
    refuses served rows of another."""
    def collected(name, weights):
        rows = [_row(f"code/{i}", "code", t, NONE, None) for i, t in enumerate(CODE[:4])]
        rows += [_row(f"code/{i}", "code", t, "model", 0.5, draft_weights=weights(i)) for i, t in enumerate(CODE[:4])]
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    table = load_table([collected("q4.jsonl", lambda i: "q4")])
    assert table.draft_weights == "q4"
    assert load_table([collected("old.jsonl", lambda i: None)]).draft_weights is None  # rows from before the field
    with pytest.raises(ValueError, match=r"mix draft precisions \['int8', 'q4'\]"):
        load_table([collected("mixed.jsonl", lambda i: "q4" if i % 2 else "int8")])
    served = tmp_path / "served.jsonl"
    served.write_text(json.dumps(_row("served/0", "served", SHIFTED[0], "model", 0.4, draft_weights="int8")) + "\n")
    with pytest.raises(ValueError, match="draft_weights=int8, the collected rows at q4"):
        load_served([str(served)], table)


@pytest.mark.integration
def test_train_router_learns_from_served_rows_of_one_drafter_each(tmp_path):
    """Collected: `ngram` pays on code, `model` on chat. Served (shifted) traffic: a kind of
    request the collected rows never had, on which the router's choice (`model`) keeps failing.
    Retrained with the served log, the router predicts that drafter's acceptance there far lower
    and stops choosing it, while the collected domains keep their choices."""
    acc = {"code": {"ngram": 0.8, "model": 0.5}, "chat": {"ngram": 0.05, "model": 0.6}}
    data = _collected(tmp_path / "rows.jsonl", {"code": CODE[:8], "chat": CHAT[:8]}, acc)
    test = _collected(tmp_path / "test.jsonl", {"code": CODE[8:], "chat": CHAT[8:]}, acc, start=8)
    base = RouterTrainConfig(data=[str(data)], test_data=[str(test)], objective="acceptance", output=str(tmp_path / "before"))
    base.mlp.epochs = 150
    train(base)
    before = Router.load(tmp_path / "before" / "router.pt")
    served = tmp_path / "served.jsonl"
    served.write_text("".join(json.dumps(_row(f"served/{i}", "served", t, "model", 0.02, source="served")) + "\n"
                              for i, t in enumerate(SHIFTED)))  # fmt: skip
    table = load_table([str(data)])
    loaded = load_served([str(served)], table)
    assert loaded.texts == sorted(SHIFTED) and torch.isnan(loaded.acceptance[:, table.drafts.index("ngram")]).all()
    after_cfg = RouterTrainConfig(data=[str(data)], test_data=[str(test)], served=[str(served)], objective="acceptance",
                                  output=str(tmp_path / "after"))  # fmt: skip
    after_cfg.mlp.epochs = 150
    train(after_cfg)
    after = Router.load(tmp_path / "after" / "router.pt")
    j = after.drafts.index("model")
    p_before = before.predict_acceptance(SHIFTED)[:, j].mean()
    p_after = after.predict_acceptance(SHIFTED)[:, j].mean()
    assert p_after < p_before - 0.2, (float(p_before), float(p_after))
    assert all(c.draft == "model" for c in after.choose_batch(CHAT[8:]))
    assert all(c.draft == "ngram" for c in after.choose_batch(CODE[8:]))
    assert after.info["served"] == [str(served)]


@pytest.mark.unit
def test_workload_rows_use_their_fixed_split_and_keep_test_rows_out_of_training(tmp_path):
    acc = {"code": {"ngram": 0.8, "model": 0.5}, "chat": {"ngram": 0.05, "model": 0.6}}
    prompts = {"code": CODE[:10], "chat": CHAT[:10]}
    data = _collected(tmp_path / "rows.jsonl", prompts, acc, split=lambda i: "val" if i % 5 == 0 else "train")
    cfg = RouterTrainConfig(data=[str(data)], objective="acceptance", output=str(tmp_path / "r"))
    with pytest.raises(ValueError, match="pass the test split's rows as test_data"):
        train(cfg)
    leaked = _collected(tmp_path / "leak.jsonl", prompts, acc, split=lambda i: "test")
    with pytest.raises(ValueError, match="test split"):
        train(RouterTrainConfig(data=[str(leaked)], objective="acceptance", output=str(tmp_path / "r")))
    table = load_table([str(data)])
    assert table.splits.count("val") == 4 and table.splits.count("train") == 16
    assert table.step_model == pytest.approx({"base_ms": 90.0, "per_token_ms": 10.0})


# ---- the server applies the choice and logs served requests ------------------------------------


@pytest.mark.unit
def test_the_scheduler_applies_the_routers_k_and_fallback_floor(costed_router):
    from types import SimpleNamespace

    from serving.engine import Request
    from serving.server.scheduler import Scheduler
    from serving.server.serve_config import RoutingSettings

    engine = SimpleNamespace(config=SimpleNamespace(k=4, k_max=6), drafter_names=("a", NONE))
    choice = costed_router.decide(torch.tensor([[0.8]]), 1)[0]  # K 8: more than the engine verifies
    sched = Scheduler(engine, routing=RoutingSettings(fallback_ratio=0.5, fallback_after=12, fallback_confidence=0.9))
    request = Request([1, 2, 3])
    sched._apply_choice(request, choice)
    assert request.k == 6 and request.fallback.after_drafted == 12 and request.fallback.confidence == 0.9
    assert request.fallback.min_acceptance == pytest.approx(choice.fallback_floor(0.5))
    off = Scheduler(engine, routing=RoutingSettings(apply_k=False, fallback_ratio=None))
    request = Request([1, 2, 3])
    off._apply_choice(request, choice)
    assert request.k is None and request.fallback is None


@pytest.mark.unit
def test_exploration_sends_a_share_of_routed_requests_to_the_other_drafters():
    """routing.explore, through admission: that share of routed requests drafts with another of
    the router's drafters (never none, uniformly, reproducibly by seed), without the router's K or
    fallback (they belong to its own choice); forced requests are never explored; 0 never explores."""
    import asyncio
    import itertools
    from collections import Counter
    from types import SimpleNamespace

    from serving.engine import Request
    from serving.server.scheduler import Scheduler, Ticket
    from serving.server.serve_config import RoutingSettings

    choice = SimpleNamespace(draft="a", k=6, occupancy=1, fallback_floor=lambda ratio: 0.3, predicted_acceptance={},
                             expected_rate=0.0)  # fmt: skip
    asked: list[list[int] | None] = []  # the prompt lengths admission passed the router (to price prefills)
    router = SimpleNamespace(draft_names=["a", "b", "c", NONE], collected_k=4, rate_at=lambda rate, k: rate,
                             choose_batch=lambda texts, occ, lengths=None: asked.append(lengths) or [choice] * len(texts))  # fmt: skip
    loop = asyncio.new_event_loop()

    def admit(explore, seed=0, forced=None, n=600):
        ids = itertools.count()
        engine = SimpleNamespace(config=SimpleNamespace(k=4, k_max=8), drafter_names=tuple(router.draft_names), num_running=0,
                                 num_waiting=0, add_request=lambda request: next(ids))  # fmt: skip
        sched = Scheduler(engine, router, max_batch_size=n, queue_limit=n,
                          routing=RoutingSettings(explore=explore, explore_seed=seed))  # fmt: skip
        tickets = [Ticket(Request([1, 2, 3]), "text", loop, forced_draft=forced) for _ in range(n)]
        sched._admit(tickets)
        return tickets, sched

    try:
        tickets, sched = admit(0.3)
        assert asked == [[3] * 600]  # each routed request's prompt length, in order
        count = Counter(t.draft for t in tickets)
        assert 0.25 < 1 - count["a"] / 600 < 0.35 and count[NONE] == 0  # about 30% explored, never to none
        assert abs(count["b"] - count["c"]) < 50  # uniformly among the others
        for t in tickets:
            assert t.explored == (t.draft != "a")
            # The router's K (6) and fallback floor go with its own choice only.
            assert (t.request.k, t.request.fallback is None) == ((None, True) if t.explored else (6, False))
        assert sched.metrics.explored.labels("a")._value.get() == 600 - count["a"]
        assert [t.draft for t in admit(0.3)[0]] == [t.draft for t in tickets]  # reproducible by seed
        assert [t.draft for t in admit(0.3, seed=1)[0]] != [t.draft for t in tickets]
        assert {t.draft for t in admit(0.0)[0]} == {"a"}
        assert {(t.draft, t.explored) for t in admit(0.9, forced="b")[0]} == {("b", False)}
    finally:
        loop.close()
    with pytest.raises(ValueError, match=r"routing.explore=1.0 must be in \[0, 1\)"):
        RoutingSettings(explore=1.0)


@pytest.mark.unit
def test_a_seeded_sampled_request_is_routed_as_if_alone():
    """Admission routes greedy and unseeded requests for the batch they join, a seeded sampled one
    for a batch of one: its drafter and K shape its draws, which must not depend on the batch."""
    import asyncio
    import itertools
    from types import SimpleNamespace

    from serving.engine import Request
    from serving.engine.sampling import SamplingParams
    from serving.server.scheduler import Scheduler, Ticket

    asked: list[tuple[int, int]] = []  # (occupancy, prompts) of each call to the router
    choice = SimpleNamespace(draft="a", k=2, occupancy=1, fallback_floor=lambda ratio: 0.0, predicted_acceptance={},
                             expected_rate=0.0)  # fmt: skip
    router = SimpleNamespace(draft_names=["a", NONE], collected_k=4, rate_at=lambda rate, k: rate,
                             choose_batch=lambda texts, occ, lengths=None: asked.append((occ, len(texts))) or [choice] * len(texts))  # fmt: skip
    ids = itertools.count()
    engine = SimpleNamespace(config=SimpleNamespace(k=4, k_max=8), drafter_names=("a", NONE), num_running=3, num_waiting=0,
                             add_request=lambda request: next(ids))  # fmt: skip
    sched = Scheduler(engine, router, max_batch_size=8, queue_limit=8)
    loop = asyncio.new_event_loop()
    try:
        params = [SamplingParams(), SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)]
        tickets = [Ticket(Request([1, 2, 3], params=p), "text", loop) for p in params]
        sched._admit(tickets)
    finally:
        loop.close()
    assert sorted(asked) == [(1, 1), (6, 2)]  # 3 running + 3 arriving; the seeded one alone
    assert [t.occupancy for t in tickets] == [6, 1, 6]


@pytest.mark.integration
def test_served_requests_draft_the_routers_k_and_land_in_the_request_log(model_dirs, tmp_path):
    from routing.rows import read_rows, row_key
    from tests.test_server import MAX_LEN, LiveServer

    draft = str(model_dirs["draft"])
    router_path = tmp_path / "router.pt"
    Router.create({"small": draft}, str(model_dirs["target"]), costs={"small": {"draft_cost": 0.05, "verify_cost": 1.2}},
                  k_buckets=(3, 5)).save(router_path)  # fmt: skip
    log = tmp_path / "served.jsonl"
    srv = LiveServer([f"router={router_path}", f"engine.max_len={MAX_LEN}", "engine.max_batch_size=2", "engine.k=2",
                      f"routing.log_requests={log}"])  # fmt: skip
    try:
        srv.wait_ready()
        prompts = ["def add(a, b):", "def mul(a, b):", "def add(a, b):"]
        outs = [srv.client.completions.create(model=srv.model, prompt=p, max_tokens=12, temperature=0) for p in prompts]
        forced = srv.client.completions.create(model=srv.model, prompt="x = 1", max_tokens=4, temperature=0,
                                               extra_body={"draft": "small"})  # fmt: skip
        metrics = srv.metrics()
    finally:
        srv.stop()
    for out in outs:  # the router's K (3 or 5), not the engine's 2
        c = out.model_extra["choral"]
        assert c["draft"] == "small" and c["k"] == c["suggested_k"] in (3, 5) and c["occupancy"] == 1
    assert forced.model_extra["choral"]["k"] == 2.0  # forced: the engine's K, and not logged
    rows = read_rows(log)
    assert len(rows) == 3 and len({row_key(r) for r in rows}) == 3
    assert [r["repeat"] for r in rows] == [0, 0, 1]  # the same prompt again: the key's next repeat
    assert all(r["source"] == "served" and r["target_weights"] == "fp32" and r["new_tokens"] == 12 for r in rows)
    assert all(r["processors"] == [] for r in rows)  # no logit_bias, penalty or min_p
    assert [r["k"] for r in rows] == [o.model_extra["choral"]["k"] for o in outs]
    # what was drafted, as the simulator's profile reads it: at most K, less where the answer's end capped it
    assert all(0 < r["mean_k"] <= r["k"] for r in rows)
    assert metrics[("choral_logged_requests_total", ())] == 3
    assert not any(r["explored"] for r in rows) and not any(o.model_extra["choral"]["explored"] for o in outs)
    assert metrics[("choral_router_predicted_acceptance_count", (("draft", "small"),))] == 3


@pytest.mark.integration
def test_the_workload_measurement_runs_every_policy_and_checks_identity(model_dirs, tmp_path):
    from routing import workload_eval
    from serving.engine.engine_settings import EngineSettings
    from serving.prompts import Prompt

    draft = str(model_dirs["draft"])
    routers = {"r": Router.create({"small": draft}, str(model_dirs["target"]), k_buckets=(2, 6))}
    prompts = [Prompt("code", "code/a", "def add(a, b):", False), Prompt("chat", "chat/b", "Say hello twice.")]
    settings = EngineSettings(device="cpu", max_len=128, k=2, request_k_max=6)
    with pytest.raises(ValueError, match=r"extra_k=\[7\]: \[7\] outside 1..6"):
        workload_eval.measure(routers, prompts, max_new_tokens=10, settings=settings, extra_k=[7])
    with pytest.raises(ValueError, match=r"repeats=0"):
        workload_eval.measure(routers, prompts, max_new_tokens=10, settings=settings, repeats=0)
    report = workload_eval.measure(routers, prompts, max_new_tokens=10, settings=settings, extra_k=[6], repeats=2)
    assert report["policies"] == ["small", "ngram", "suffix", "small@6", "ngram@6", "suffix@6", NONE, "r"]
    for row in report["rows"]:  # two runs per policy, tokens/s their median
        assert all(len(row["runs"][n]) == 2 for n in report["policies"])
        assert all(row["tokens_per_s"][n] == pytest.approx(sum(row["runs"][n]) / 2) for n in report["policies"])
    # suffix@6 drafts with a suffix cache of its own, never the one suffix (K = 2) filled on the same prompt
    at_k, own = workload_eval.own_drafters({"small": draft, "ngram": "ngram", "suffix": "suffix"}, ["r"], [2, 6], 2)
    assert at_k == {"small@6": ("small", 6), "ngram@6": ("ngram@6", 6), "suffix@6": ("suffix@6", 6)}
    assert own == {"r/ngram": "ngram", "r/suffix": "suffix", "ngram@6": "ngram", "suffix@6": "suffix"}
    assert all(all(row["identical"].values()) for row in report["rows"])
    assert [row["k"]["r"] for row in report["rows"]] == [c.k for c in routers["r"].choose_batch([p.text for p in prompts])]
    s = report["summary"]
    assert set(s) == {"code", "chat", "all"} and s["all"]["prompts"] == 2 and s["all"]["identical"] == 2
    assert s["all"]["oracle"] >= max(s["all"]["speedup"][n] for n in report["policies"][:-1]) - 1e-9
    assert s["all"]["best_single"] in report["policies"][:-1]  # a drafter at K = 6 counts as a single drafter
    assert s["all"]["oracle_held_out"] is not None and s["all"]["family_ceiling"] <= s["all"]["oracle"] + 1e-9
    assert set(s["all"]["family_best"]) == {"code", "chat"} and s["code"]["family_best"] == {"code": s["all"]["family_best"]["code"]}
    md = workload_eval.markdown(report)
    assert "| all | 2 |" in md and "r / best single" in md and "K = 2 and 6" in md and "r / held-out oracle" in md
    assert all(line.count("|") == md.splitlines()[2].count("|") for line in md.splitlines()[2:])  # every row fills every column
    workload_eval.plot(report, tmp_path / "w.png")
    assert (tmp_path / "w.png").stat().st_size > 0


@pytest.mark.unit
def test_the_table_measures_each_drafters_fill_from_its_tokens_per_call(tmp_path):
    """A drafter whose calls committed a third of what its acceptance predicts for full K slots
    (ngram and suffix propose fewer tokens where they find no match) gets fill 1/3 in the costs;
    rows without tokens per call (collected before the field) leave the plain model."""
    from serving.engine.goodput import expected_tokens

    extra = float(expected_tokens(per_token_acceptance(torch.tensor([0.5]), 4), torch.tensor(4.0))[0]) - 1
    rows = []
    for i, t in enumerate(CODE[:4]):
        rows += [_row(f"code/{i}", "code", t, NONE, None, mean_accepted_length=1.0, target_calls=47)]
        rows += [_row(f"code/{i}", "code", t, "sparse", 0.5, mean_accepted_length=1 + extra / 3, target_calls=30)]
        rows += [_row(f"code/{i}", "code", t, "model", 0.5, mean_accepted_length=1 + extra, target_calls=16)]
    # an answer that ended at its prefill made no call: it says nothing about fill
    rows += [_row("code/9", "code", CODE[9], d, 0.0, mean_accepted_length=0.0, target_calls=0) for d in ("sparse", "model")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    costs = load_table([str(path)]).costs
    assert costs["sparse"]["fill"] == pytest.approx(1 / 3, rel=1e-4) and costs["model"]["fill"] == pytest.approx(1.0, rel=1e-4)
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "mean_accepted_length"}) + "\n" for r in rows))
    assert all("fill" not in c for c in load_table([str(old)]).costs.values())


@pytest.mark.unit
def test_pool_oracle_learns_the_family_rule_on_training_rows_and_scores_it_on_test_rows(tmp_path, capsys):
    """scripts/experiments/pool_oracle.py: the family rule is the drafter fastest on a family's
    training prompts (not its test prompts), the oracle the fastest per test prompt, and a
    drafting row whose output differs from its prompt's target-alone row is counted."""
    pool_oracle = load_script("scripts/experiments/pool_oracle.py")

    def rows(pid, family, speeds, differ=()):
        return [{"prompt_id": pid, "domain": family, "draft": d, "mode": "greedy", "repeat": 0, "speedup": s,
                 "output_sha": "other" if d in differ else "same"} for d, s in speeds.items()]  # fmt: skip

    train = rows("c/0", "code", {NONE: 1.0, "a": 1.5, "b": 1.2}) + rows("e/0", "edit", {NONE: 1.0, "a": 1.1, "b": 1.8})
    # On the test prompts "b" is faster on code too (a rule learned there would take it), and the best
    # single drafter overall; per prompt, "a" wins c/1 and "b" the rest.
    test = (rows("c/1", "code", {NONE: 1.0, "a": 1.6, "b": 1.4}) + rows("c/2", "code", {NONE: 1.0, "a": 1.0, "b": 1.5})
            + rows("e/1", "edit", {NONE: 1.0, "a": 1.0, "b": 2.0}, differ=("a",)))  # fmt: skip
    # The training rows come in two files, as the pool at a second K does (each with its own none row):
    # the rule needs both drafters to take "a" for code and "b" for edits.
    files = {"train-a": [r for r in train if r["draft"] != "b"], "train-b": [r for r in train if r["draft"] != "a"],
             "test": test}  # fmt: skip
    for name, data in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    argv = ["--train", str(tmp_path / "train-a.jsonl"), str(tmp_path / "train-b.jsonl"), "--test", str(tmp_path / "test.jsonl")]
    assert pool_oracle.main(argv) == 0
    out = capsys.readouterr().out
    best, oracle, rule = (1.4 + 1.5 + 2.0) / 3, (1.6 + 1.5 + 2.0) / 3, (1.6 + 1.0 + 2.0) / 3
    assert "| code | 2 | 1.30 | 1.45 | 1.55 | 1.30 | a |" in out  # the rule took "a" for code from the training row
    assert "| edit | 1 | 1.00 | 2.00 | 2.00 | 2.00 | b |" in out  # and "b" for edits, from the other file
    assert f"best single drafter: b ({best:.3f}); oracle / best single {oracle / best:.3f}" in out
    assert f"family rule / best single {rule / best:.3f}, {100 * rule / oracle:.1f}% of the oracle" in out
    assert "outputs differing from the target alone: 1 of 6" in out


@pytest.mark.unit
def test_the_table_fits_the_prefills_and_each_drafters_fill_to_the_prompts_length(tmp_path):
    """load_table's prefill model: the target's prefill in target steps as a line in the prompt's
    length (the none rows), each drafter's own prefill on top (its row's prefill_ms minus the none
    row's), the answers' median length; and a fill line per drafter. Rows without prefill times
    or prompt lengths give neither."""
    from serving.engine.goodput import expected_tokens

    rows = []
    for i, (n, rate) in enumerate([(40, 0.3), (120, 0.5), (200, 0.6), (320, 0.4)]):
        step = 80.0 + 10 * i  # each prompt's own target step, ms
        extra = float(expected_tokens(per_token_acceptance(torch.tensor([rate]), 4), torch.tensor(4.0))[0]) - 1
        common = dict(prompt_tokens=n, target_step_ms=step, new_tokens=48, target_calls=20)
        rows.append(_row(f"code/{i}", "code", CODE[i], NONE, None, prefill_ms=step * (0.5 + 0.04 * n), mean_accepted_length=1.0, **common))
        rows.append(_row(f"code/{i}", "code", CODE[i], "model", rate, prefill_ms=step * (0.5 + 0.04 * n + 0.2 + 0.01 * n),
                         mean_accepted_length=1 + extra, **common))  # fmt: skip
        rows.append(_row(f"code/{i}", "code", CODE[i], "copy", rate, prefill_ms=step * (0.5 + 0.04 * n),
                         mean_accepted_length=1 + (0.2 + 0.002 * n) * extra, **common))  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = load_table([str(path)])
    assert table.prompt_tokens.tolist() == [40.0, 120.0, 200.0, 320.0]
    assert table.prefill["target"] == pytest.approx([0.5, 0.04], rel=1e-6)
    assert table.prefill["drafts"]["model"] == pytest.approx([0.2, 0.01], rel=1e-6)
    assert table.prefill["drafts"]["copy"] == pytest.approx([0.0, 0.0], abs=1e-9)
    assert table.prefill["new_tokens"] == 48.0
    assert table.costs["copy"]["fill_line"] == pytest.approx([0.2, 0.002], rel=1e-5)
    assert table.costs["model"]["fill_line"] == pytest.approx([1.0, 0.0], abs=1e-6)
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("prefill_ms", "prompt_tokens")}) + "\n" for r in rows))
    bare = load_table([str(old)])
    assert bare.prefill is None and bare.prompt_tokens is None and all("fill_line" not in c for c in bare.costs.values())


@pytest.mark.unit
def test_the_load_bench_pairs_routed_with_the_best_fixed_policy_round_by_round():
    """bench_routed_load.py's summary: the best fixed policy over all rounds (goodput and routed
    policies are not fixed), aggregate tokens/s as all tokens over all wall time, and routed over
    that best fixed policy in each round, where both ran back to back."""
    bench = load_script("scripts/experiments/bench_routed_load.py")

    def run(tokens, wall, draft):
        rows = [{"prompt_id": "p", "text": "same", "draft": draft}]
        return {"completion_tokens": tokens, "wall_s": wall, "throughput_tokens_per_s": tokens / wall, "rows": rows, "errors": 0}

    # The machine slows down in round 1: every policy's tok/s falls, routed stays ahead of suffix@1.
    results = {"none": [run(100, 10, NONE), run(100, 20, NONE)], "suffix@1": [run(110, 10, "suffix"), run(110, 20, "suffix")],
               "ngram+goodput": [run(200, 10, "ngram"), run(200, 10, "ngram")],
               "routed+goodput": [run(121, 10, "ngram"), run(99, 20, "ngram")]}  # fmt: skip
    s = bench.summarize(results, list(results))
    assert s["best_fixed"] == "suffix@1" and s["best_routed"] == "routed+goodput"
    assert s["tokens_per_s"]["routed+goodput"] == pytest.approx(220 / 30)
    assert s["routed_vs_best_fixed"] == pytest.approx(220 / 220)
    assert s["routed_vs_best_fixed_per_round"] == pytest.approx([1.1, 0.9])
    assert s["routed_choices"] == {"ngram": 2} and s["identical_to_reference"]["suffix@1"] == 1 and s["identity_reference"] == NONE
    # without the target alone, answers are checked against the first policy's (not counted as all differing)
    del results["none"]
    s = bench.summarize(results, list(results))
    assert s["identity_reference"] == "suffix@1" and s["identical_to_reference"] == {"ngram+goodput": 1, "routed+goodput": 1}
    md = bench.markdown({"command": "c", "summary": s | {"fallbacks_total": 0}})
    assert "identical to suffix@1" in md and "| suffix@1 | 7.33 | - | 0 |" in md



@pytest.mark.unit
def test_the_held_out_oracle_times_each_rounds_pick_on_that_round_alone():
    """The in-sample oracle takes each prompt's fastest median, noise included; the held-out oracle
    picks on the other rounds and times the pick on the round left out. Here policy a is truly
    faster, but one lucky run of b makes b's median the highest: the in-sample oracle takes b's
    lucky median, the held-out one does not."""
    from routing import workload_eval

    row = {"tokens_per_s": {"a": 12.0, "b": 13.0, NONE: 10.0},
           "runs": {"a": [12.0, 12.0, 12.0], "b": [8.0, 13.0, 14.0], NONE: [10.0, 10.0, 10.0]}}  # fmt: skip
    # round 0: others say b (13.5 > 12) -> b's run 8; round 1: a (12 > 11) -> 12; round 2: a (12 > 10.5) -> 12
    assert workload_eval.held_out_oracle(row, ["a", "b"]) == pytest.approx(1.2)
    assert workload_eval.held_out_oracle({"tokens_per_s": {NONE: 1.0}, "runs": {"a": [1.0]}}, ["a"]) is None
    own = {"suffix": "suffix", "r/suffix": "suffix"}
    assert workload_eval.round_name("suffix", 0, own) == "suffix" and workload_eval.round_name("r/suffix", 2, own) == "r/suffix#2"
    assert workload_eval.round_name("base", 1, {"suffix": "suffix"}) == "base"



@pytest.mark.unit
def test_train_router_scales_each_drafters_wider_verify_from_rows_at_a_second_k(tmp_path, capsys):
    """Rows of `ngram` at K = 8 that measured more speedup than the step model predicts give it a
    verify-shift scale below 1 (not `model`, collected at K = 4 only); curve rows at the collected
    K or at two other K are refused; only the training prompts' rows count."""
    from routing.dataset import second_k

    acc = {"code": {"ngram": 0.6, "model": 0.5}, "chat": {"ngram": 0.2, "model": 0.6}}
    data = _collected(tmp_path / "rows.jsonl", {"code": CODE[:8], "chat": CHAT[:8]}, acc)
    test = _collected(tmp_path / "test.jsonl", {"code": CODE[8:], "chat": CHAT[8:]}, acc, start=8)
    from routing.rows import read_rows

    rows = read_rows(data)
    curve = [r | {"k": 8, "speedup": 3.0} for r in rows if r["draft"] == "ngram"]
    k8 = tmp_path / "k8.jsonl"
    k8.write_text("".join(json.dumps(r) + "\n" for r in curve))
    prompts = {r["prompt_id"] for r in rows}
    got = second_k([str(data)], [str(k8)], prompts, 4)
    assert set(got) == {"ngram"} and got["ngram"]["k"] == 8 and len(got["ngram"]["prompts"]) == 16
    assert len(second_k([str(data)], [str(k8)], {"code/0"}, 4)["ngram"]["prompts"]) == 1
    with pytest.raises(ValueError, match=r"K \[4\]"):
        second_k([str(data)], [str(data)], prompts, 4)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(k8.read_text() + json.dumps(curve[0] | {"k": 6, "prompt_id": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"K \[6, 8\]"):
        second_k([str(data)], [str(mixed)], prompts | {"x"}, 4)
    cfg = RouterTrainConfig(data=[str(data)], test_data=[str(test)], curve_data=[str(k8)], objective="speedup",
                            output=str(tmp_path / "r"))  # fmt: skip
    cfg.mlp.epochs = 20
    train(cfg)
    router = Router.load(tmp_path / "r" / "router.pt")
    assert router.costs["ngram"]["verify_shift_scale"] < 1 and "verify_shift_scale" not in router.costs["model"]
    assert router.info["curve_data"] == [str(k8)] and "ngram's wider verify weighed x" in capsys.readouterr().out

"""simulate: closed-form agreement, determinism, config errors, sweeps, and profile round trips."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from serving.fleet.cli_simulate import main, run_sweep
from serving.config import ConfigError, load_config
from serving.fleet.profile import (
    CostModel,
    CostPoint,
    DomainProfile,
    DraftProfile,
    LengthDist,
    Link,
    Profile,
    from_bench,
    from_load_test,
    from_router_data,
    iid_curve,
    load_profile,
)
from serving.fleet.simulator import SimulateConfig, Simulation, simulate

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PROFILE = f"profile={ROOT}/configs/profiles/cpu_bundled.yaml"


def reference_profile() -> Profile:
    """The committed profile measured on the bundled pair (configs/profiles/cpu_bundled.yaml)."""
    return load_profile(ROOT / "configs" / "profiles" / "cpu_bundled.yaml")

A, K = 0.7, 4
TARGET_MS, DRAFT_MS, LATENCY_MS = 2.0, 0.25, 0.5


def iid_profile(a: float = A, k: int = K) -> Profile:
    """One draft whose every position is accepted with probability ``a`` given the ones before."""
    return Profile(
        target=CostModel(base_ms=TARGET_MS),
        drafts={"d": DraftProfile(cost=CostModel(base_ms=DRAFT_MS), acceptance={"all": iid_curve(a, k)})},
        domains={"x": DomainProfile(prompt_tokens=LengthDist(mean=16), output_tokens=LengthDist(mean=10**6))},
    )


def one_on_one(tmp_path, *extra: str) -> SimulateConfig:
    """One client, one target, no jitter, a request that never ends within the run."""
    text = f"""# simulate --config c.yaml
duration_s: 40
warmup_s: 1
clients: {{solo: 1}}
devices: {{solo: {{draft_speed: 1.0, link: {{latency_ms: {LATENCY_MS}, bandwidth_mbps: 1.0e6}}}}}}
targets: [{{count: 1, speed: 1.0, max_batch: 8}}]
arrivals: {{kind: closed, think_time_s: 0}}
k: {{kind: fixed, k: {K}}}
messages: {{request_bytes: 0, bytes_per_draft_token: 0, bytes_per_prompt_token: 0, response_bytes: 0}}
output: {{dir: {tmp_path}/out, plots: false}}
"""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(SimulateConfig, path, list(extra))


@pytest.mark.parametrize("architecture", ["distributed", "fused"])
def test_single_client_matches_closed_form(tmp_path, architecture):
    cfg = one_on_one(tmp_path, f"architecture={architecture}")
    s = simulate(cfg, iid_profile())["summary"]
    expected = (1 - A ** (K + 1)) / (1 - A)
    n = s["verify_calls"]
    # Tokens per call take values 1..K+1; their standard deviation is below 1.5.
    assert n > 5000
    assert abs(s["tokens_per_target_call"] - expected) < 4 * 1.5 / math.sqrt(n), (s["tokens_per_target_call"], expected)
    # The clock too: one step = K draft forwards + one verification (+ a round trip when the
    # draft is on the client), so the token rate is tokens per call over that.
    step_ms = K * DRAFT_MS + TARGET_MS + (2 * LATENCY_MS if architecture == "distributed" else 0.0)
    assert s["throughput_tokens_per_s"] == pytest.approx(1e3 * expected / step_ms, rel=0.02)


def test_fused_first_chunk_comes_after_prefill_and_one_step(tmp_path):
    """As in SpeculativeEngine.step: a new request is prefilled and then drafts and verifies in
    the same iteration; its first chunk (1 + K + 1 tokens when all are accepted) goes out at the
    end of that iteration, and every later chunk one iteration apart."""
    p = iid_profile(a=1.0)
    p.target = CostModel(base_ms=TARGET_MS, prefill_per_token_ms=0.5)
    p.domains = {"x": DomainProfile(prompt_tokens=LengthDist(mean=16), output_tokens=LengthDist(mean=1 + 4 * (K + 1)))}
    s = simulate(one_on_one(tmp_path, "architecture=fused"), p)["summary"]
    step_ms = K * DRAFT_MS + TARGET_MS
    prefill_ms = 16 * 0.5  # continuous batching (not static): the prompt rides in the step's forward
    assert s["ttft_ms"]["p50"] == pytest.approx(LATENCY_MS + prefill_ms + step_ms + LATENCY_MS)
    assert s["e2e_ms"]["p50"] == pytest.approx(LATENCY_MS + prefill_ms + 4 * step_ms + LATENCY_MS)
    assert s["tokens_per_target_call"] == pytest.approx(K + 1)


@pytest.mark.parametrize("architecture", ["distributed", "fused"])
def test_a_drafter_that_proposes_on_some_steps_runs_plain_steps_on_the_rest(tmp_path, architecture):
    """vLLM's ngram without a match runs a plain one-token step. A drafter that proposes on 40% of
    steps, i.i.d. 0.9 per position given a proposal (the profile stores the per-step curve, 0.4 x
    that): the drafts are accepted at 0.9's rate, and the clock charges K draft forwards and a K+1
    verify only on a step that proposed, one plain token on the others."""
    rate, per_token_ms = 0.4, 1.0
    given = iid_curve(0.9, K)
    p = iid_profile()
    p.target = CostModel(base_ms=TARGET_MS, per_token_ms=per_token_ms)
    p.drafts = {"d": DraftProfile(cost=CostModel(base_ms=DRAFT_MS), acceptance={"all": [rate * c for c in given]},
                                  proposes={"all": rate})}  # fmt: skip
    cfg = one_on_one(tmp_path, f"architecture={architecture}")
    s = simulate(cfg, p)["summary"]
    n = s["verify_calls"]
    tokens = 1 + rate * sum(given)
    assert s["tokens_per_target_call"] == pytest.approx(tokens, abs=4 * K / 2 / math.sqrt(n))
    assert s["acceptance_rate"] == pytest.approx(sum(given) / K, abs=0.02)  # per drafted token: given a proposal
    step_ms = TARGET_MS + per_token_ms * (1 + rate * K) + rate * K * DRAFT_MS
    step_ms += 2 * LATENCY_MS if architecture == "distributed" else 0.0
    assert s["throughput_tokens_per_s"] == pytest.approx(1e3 * tokens / step_ms, rel=0.03)
    if architecture == "fused":  # the router's and simulate_pools.py's estimate of the same step
        est_tokens, est_ms = Simulation(cfg, p).lone_step(0, 0)
        assert (est_tokens, est_ms) == pytest.approx((tokens, step_ms))
    with pytest.raises(ValueError, match="exceeds proposes.all=0.3"):
        DraftProfile(cost=CostModel(base_ms=0.0), acceptance={"all": [0.4] * K}, proposes={"all": 0.3})
    with pytest.raises(ValueError, match="exceeds proposes.code=0.5"):  # a domain that falls back to `all`
        DraftProfile(cost=CostModel(base_ms=0.0), acceptance={"all": [0.3], "code": [0.8]}, proposes={"all": 0.5})


def test_acceptance_rate_is_per_position_mean(tmp_path):
    s = simulate(one_on_one(tmp_path), iid_profile(a=0.5))["summary"]
    assert s["acceptance_rate"] == pytest.approx(sum(iid_curve(0.5, K)) / K, abs=0.02)


def small(tmp_path, *extra: str) -> SimulateConfig:
    base = [
        "duration_s=60", "warmup_s=10", "clients={phone: 300, laptop: 100, server: 20}",
        "targets=[{count: 3, speed: 20, max_batch: 16, window_ms: 2}, {count: 2, speed: 10, max_batch: 16}]",
        "arrivals.kind=poisson", "arrivals.rate_per_client=0.02", f"output.dir={tmp_path}/out", "output.plots=false", PROFILE,
    ]  # fmt: skip
    return load_config(SimulateConfig, None, [*base, *extra])


def strip(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("wall_s", "cpu_s", "sim_seconds_per_wall_second")}


@pytest.mark.parametrize("architecture", ["distributed", "fused"])
def test_same_seed_same_results_other_seed_differs(tmp_path, architecture):
    runs = [simulate(small(tmp_path, f"architecture={architecture}", f"seed={s}"), reference_profile()) for s in (3, 3, 4)]
    assert strip(runs[0]["summary"]) == strip(runs[1]["summary"])
    assert runs[0]["timeseries"] == runs[1]["timeseries"]
    assert strip(runs[0]["summary"]) != strip(runs[2]["summary"])
    assert runs[0]["summary"]["requests_completed"] > 100


def test_policies_and_arrivals_run(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"time_s": 0.5 * i, "domain": "code", "output_tokens": 20}) for i in range(60)))
    for extra in (
        ["balancer=round_robin", "k.kind=adaptive"], ["balancer=jsq", "arrivals.kind=bursty"],
        ["balancer=weighted", "arrivals.kind=closed", "arrivals.think_time_s=30"],
        ["arrivals.kind=trace", f"arrivals.trace={trace}", "draft.policy=router"],
    ):  # fmt: skip
        s = simulate(small(tmp_path, *extra), reference_profile())["summary"]
        assert s["requests_completed"] > 0 and s["throughput_tokens_per_s"] > 0, extra
        assert 0 < s["utilisation_mean"] <= 1


def test_router_picks_the_draft_that_is_accepted_more(tmp_path):
    p = reference_profile()
    good, bad = iid_curve(0.9, 8), iid_curve(0.2, 8)
    p.drafts = {
        "code-draft": DraftProfile(cost=CostModel(base_ms=100), acceptance={"code": good, "all": bad}),
        "chat-draft": DraftProfile(cost=CostModel(base_ms=100), acceptance={"chat": good, "all": bad}),
    }
    r = simulate(small(tmp_path, "draft.policy=router", "duration_s=20"), p)
    assert r["per_domain_draft"]["code"] == "code-draft" and r["per_domain_draft"]["chat"] == "chat-draft"


@pytest.mark.parametrize(
    "override, key",
    [
        ("balancer=fastest", "balancer"),
        ("arrivals.rate=1", "arrivals.'rate'"),
        ("clients={tablet: 5}", "clients.tablet"),
        ("k.k=0", "k"),
        ("warmup_s=900", "warmup_s"),
        ("draft.name=nope", "draft.name"),
        ("workload.domains={poetry: 1}", "workload.domains.poetry"),
        ("targets=[{count: 0}]", "targets[0]"),
        ("profile=/no/such/profile.yaml", "profile"),
    ],
)
def test_bad_config_names_the_key(tmp_path, capsys, override, key):
    rc = main(["--no-progress", PROFILE, f"output.dir={tmp_path}/out", "duration_s=20", "warmup_s=1", "clients={phone: 10}", override])
    err = capsys.readouterr().err
    assert rc == 2 and key in err, err


def test_sweep_gives_one_result_per_value(tmp_path):
    cfg = small(tmp_path, "duration_s=20", "sweep.param=clients", "sweep.values=[100, 400]", "sweep.compare_values=[round_robin, jsq2]")
    runs = run_sweep(None, [PROFILE], cfg, progress=False)
    assert [(r["value"], r["compare"]) for r in runs] == [(100, "round_robin"), (100, "jsq2"), (400, "round_robin"), (400, "jsq2")]
    # More clients (same class mix) carry more traffic.
    assert runs[2]["summary"]["requests_arrived"] > 2 * runs[0]["summary"]["requests_arrived"]


def test_cli_writes_reports(tmp_path):
    overrides = ["--no-progress", PROFILE, f"output.dir={tmp_path}/out", "duration_s=20", "warmup_s=2", "clients={phone: 50, laptop: 20}",
                 "targets=[{count: 2, speed: 20}]", "arrivals.rate_per_client=0.05"]  # fmt: skip
    assert main(overrides) == 0
    result = json.loads((tmp_path / "out" / "simulate.json").read_text())
    assert result["summary"]["requests_completed"] > 0
    assert (tmp_path / "out" / "simulate.png").stat().st_size > 10_000
    assert main([*overrides, "sweep.param=balancer", "sweep.values=[round_robin, jsq]", "sweep.compare=null"]) == 0
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["value"] for r in sweep["sweep"]] == ["round_robin", "jsq"]
    assert (tmp_path / "out" / "sweep.png").exists() and (tmp_path / "out" / "sweep.md").exists()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trip(tmp_path, suffix):
    p = iid_profile()
    p.network = {"loopback": Link(latency_ms=0.1, bandwidth_mbps=5000)}
    p.target = CostModel.fit([CostPoint(1, 1, 10.0), CostPoint(4, 5, 14.0), CostPoint(8, 5, 18.0), CostPoint(1, 100, 60.0, "prefill")])
    p.meta = {"source": "test"}
    path = p.save(tmp_path / f"profile{suffix}")
    assert load_profile(path) == p


def test_bad_profile_names_the_key(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("target: {base_ms: 1, per_tokn_ms: 2}\ndrafts: {}\ndomains: {}\n")
    with pytest.raises(ConfigError, match="per_tokn_ms"):
        load_profile(path)


def test_cost_fit_recovers_a_linear_model():
    truth = CostModel(base_ms=20, per_row_ms=0.5, per_token_ms=0.2, prefill_per_token_ms=0.05)
    pts = [CostPoint(b, t, truth.ms(b, b * t)) for b in (1, 4, 16, 32) for t in (1, 3, 5, 9)]
    pts += [CostPoint(1, n, truth.ms(1, 0, n), "prefill") for n in (50, 200)]
    fit = CostModel.fit(pts)
    for name in ("base_ms", "per_row_ms", "per_token_ms", "prefill_per_token_ms"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fit.fit_error() < 1e-9


def bench_report() -> dict:
    def row(prompt, calls, accepted, curve=None):
        r = {"prompt_tokens": prompt, "target_tokens": 33, "target_s": 4.0, "target_decode_s": 3.5, "target_step_ms": 100.0,
             "spec_tokens": 33, "spec_s": 3.0, "spec_decode_s": 2.3, "verify_ms": 130.0, "draft_step_ms": 30.0,
             "drafted": 4 * calls, "accepted": accepted, "target_calls": calls}  # fmt: skip
        return r | ({"per_position_acceptance": curve} if curve else {})

    return {
        "config": {"target": "t", "draft": "/models/my-draft", "k": 4, "command": "spec-bench"},
        "rows": {"code": [row(50, 8, 24), row(70, 10, 22)], "chat": [row(30, 12, 20, [0.8, 0.5, 0.3, 0.1])]},
    }


def test_from_bench():
    p = from_bench(bench_report())
    assert list(p.drafts) == ["my-draft"]
    d = p.drafts["my-draft"]
    # Code: 64 tokens over 18 calls -> an i.i.d. curve with that many tokens per call.
    assert 1 + sum(d.acceptance["code"]) == pytest.approx(64 / 18, abs=1e-6)
    assert d.acceptance["chat"] == pytest.approx([0.8, 0.5, 0.3, 0.1])
    assert p.target.ms(1, 1) < p.target.ms(1, 5) and p.target.prefill_per_token_ms > 0
    assert p.domains["code"].prompt_tokens.samples == [50, 70] and p.domains["code"].weight == 2


def test_from_router_data_and_load_test(tmp_path):
    rows = [
        {"domain": "code", "draft": "a", "per_position_acceptance": [0.9, 0.8], "draft_step_ms": 20, "target_step_ms": 90,
         "new_tokens": 64, "prompt_tokens": 40, "mean_k": 4},
        {"domain": "chat", "draft": "a", "acceptance_rate": 0.5, "draft_step_ms": 22, "target_step_ms": 95, "new_tokens": 32,
         "prompt_tokens": 20},
        {"domain": "chat", "draft": "b", "acceptance_rate": 0.7, "draft_step_ms": 10},
    ]  # fmt: skip
    path = tmp_path / "router.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    p = from_router_data(path)
    assert set(p.drafts) == {"a", "b"} and set(p.domains) == {"code", "chat"}
    assert p.drafts["a"].acceptance["code"] == [0.9, 0.8]
    assert sum(p.drafts["b"].acceptance["chat"]) / 4 == pytest.approx(0.7, abs=1e-6)
    with pytest.raises(ValueError, match="draft_step_ms"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"draft": "c", "target_step_ms": 9, "acceptance_rate": 0.5}))
        from_router_data(bad)

    load = {
        "requests": [{"domain": "code", "prompt_tokens": 40, "output_tokens": 50}] * 3,
        "server": {"draft": "a", "steps": [{"rows": 1, "tokens_per_row": 5, "ms": 30}, {"rows": 4, "tokens_per_row": 5, "ms": 50}],
                   "per_position_acceptance": [0.6, 0.3]},
        "network": {"loopback": {"latency_ms": 0.2, "bandwidth_mbps": 9000}},
    }  # fmt: skip
    q = from_load_test(load, base=p)
    assert q.target.ms(4, 20) == pytest.approx(50) and q.drafts["a"].acceptance == {"all": [0.6, 0.3]}
    assert q.drafts["b"] == p.drafts["b"] and q.network["loopback"].latency_ms == 0.2
    with pytest.raises(ValueError, match="server.steps"):
        from_load_test({"requests": load["requests"]})


def test_static_batch_pays_for_every_slot(tmp_path):
    """Choral's engine runs all max_batch rows every step: one client then pays the full batch."""
    p = iid_profile()
    p.target = CostModel(base_ms=TARGET_MS, per_row_ms=0.5)
    s = simulate(one_on_one(tmp_path, "architecture=fused", "targets=[{count: 1, max_batch: 8, static_batch: true}]"), p)["summary"]
    expected = (1 - A ** (K + 1)) / (1 - A)
    step_ms = K * DRAFT_MS + TARGET_MS + 8 * 0.5
    assert s["throughput_tokens_per_s"] == pytest.approx(1e3 * expected / step_ms, rel=0.02)


def test_from_router_data_reads_collect_rows_with_the_target_alone(tmp_path):
    """Rows as collect-router-data writes them: the target alone is draft "none" with k=0 and
    draft_step_ms 0.0; its steps are one-token target steps, not a draft."""
    common = {"domain": "code", "prompt_tokens": 40, "new_tokens": 32, "mode": "greedy", "repeat": 0}
    rows = [
        common | {"prompt_id": "p0", "draft": "none", "k": 0, "acceptance_rate": 0.0, "per_position_acceptance": [],
                  "draft_step_ms": 0.0, "target_step_ms": 100.0, "target_calls": 31},
        common | {"prompt_id": "p0", "draft": "base", "k": 4, "acceptance_rate": 0.6, "per_position_acceptance": [0.8, 0.6, 0.5, 0.5],
                  "draft_step_ms": 40.0, "target_step_ms": 140.0, "target_calls": 12},
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    p = from_router_data(path)
    assert set(p.drafts) == {"base"}
    assert p.target.ms(1, 1) == pytest.approx(100.0, rel=1e-3) and p.target.ms(1, 5) == pytest.approx(140.0, rel=1e-3)


def test_pools_take_only_their_drafters_requests_and_none_is_free(tmp_path):
    """Specialised pools (one drafter per server group, as vLLM replicas run): the router sends
    each domain to the pool of its best drafter, and 'none' (the target alone) drafts nothing."""
    p = reference_profile()
    p.drafts = {"code-draft": DraftProfile(cost=CostModel(base_ms=100), acceptance={"code": iid_curve(0.9, 8), "all": iid_curve(0.05, 8)})}
    pools = "targets=[{count: 2, speed: 20, max_batch: 16, pool: none}, {count: 3, speed: 20, max_batch: 16, pool: code-draft}]"
    r = simulate(small(tmp_path, "architecture=fused", "draft.policy=router", "duration_s=30", pools), p)
    assert r["per_domain_draft"]["code"] == "code-draft"
    assert r["per_domain_draft"]["chat"] == "none"  # a draft accepted 5% of the time loses to the target alone
    pools = r["per_pool"]
    assert set(pools["code-draft"]["domains"]) == {"code"} and "code" not in pools["none"]["domains"]
    assert pools["none"]["servers"] == 2 and pools["none"]["requests"] > 0 and pools["code-draft"]["utilisation_mean"] > 0
    alone = simulate(small(tmp_path, "architecture=fused", "draft.policy=fixed", "draft.name=none", "duration_s=30",
                           "targets=[{count: 5, speed: 20, max_batch: 16}]"), p)["summary"]  # fmt: skip
    assert alone["acceptance_rate"] == 0.0 and alone["tokens_per_target_call"] == 1.0  # nothing drafted
    with pytest.raises(ConfigError, match="pool='big-draft' is neither 'none' nor a draft"):
        simulate(small(tmp_path, "targets=[{count: 1, pool: big-draft}]"), p)

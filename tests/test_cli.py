"""The CLIs, run in-process on tiny model folders."""

import json

import pytest
import torch

from serving.tools import bench, cli_generate

pytestmark = pytest.mark.e2e


def test_spec_generate_json_matches_target_greedy(model_dirs, tiny_target, tokenizer, capsys):
    args = ["--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]), "--prompt", "def add(a, b):",
            "--max-new-tokens", "12", "--k", "3", "--device", "cpu", "--json"]  # fmt: skip
    assert cli_generate.main(args) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    # A folder target keeps its weights; the line says so, and what "identical" is measured against.
    assert f"target {model_dirs['target']}: fp32 on cpu with Choral's CPU kernels" in captured.err
    assert "identical to the fp32 target decoding alone" in captured.err
    ids = tokenizer.encode("def add(a, b):")
    ref = tiny_target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert out["token_ids"] == ref[0, len(ids) :].tolist()
    for key in ("target_calls", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "tokens_per_second"):
        assert key in out["stats"]


def test_spec_generate_chat_prompt_file_and_target_only(model_dirs, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "hello"}\n{"text": "what is 12 + 30?"}\n')
    args = ["--target", str(model_dirs["target"]), "--prompt-file", str(f), "--chat", "--max-new-tokens", "5",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json", "--batch-size", "2"]  # fmt: skip
    assert cli_generate.main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(x["stats"]["drafted"] == 0 for x in lines)


def test_spec_generate_prompt_too_long_is_a_clear_error(model_dirs, capsys):
    args = ["--target", str(model_dirs["target"]), "--prompt", "word " * 200, "--max-len", "64"]
    assert cli_generate.main(args) == 2
    assert "exceeds the context max_len=64" in capsys.readouterr().err


def test_spec_generate_rejects_bad_sampling_values(model_dirs, capsys):
    assert cli_generate.main(["--target", str(model_dirs["target"]), "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "sampling.top_p=1.5 must be in (0, 1]" in capsys.readouterr().err
    assert cli_generate.main(["--target", str(model_dirs["target"]), "--prompt", "x", "--k", "many"]) == 2
    assert capsys.readouterr().err == "spec-generate: error: engine.k='many' must be a positive integer or 'auto'\n"
    assert cli_generate.main(["--target", str(model_dirs["target"])]) == 2
    assert "give one prompt source: --prompt TEXT or --prompt-file FILE" in capsys.readouterr().err


def test_spec_bench_writes_report(model_dirs, tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]), "--prompts-per-domain", "1",
            "--max-new-tokens", "8", "--k", "2", "--k-sweep", "1,3", "--sweep-prompts", "1", "--out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads((out / "bench.json").read_text())
    assert set(report["summary"]) == {"code", "chat", "math", "all"}
    s = report["summary"]["all"]
    assert s["choral_identical"] == 3 and s["prompts"] == 3  # tiny fp32 eager: exact
    assert s["hf_identical"] == 3
    assert {r["k"] for r in report["k_sweep"]} == {1, 3}
    assert (out / "bench.png").stat().st_size > 1000 and "| code |" in (out / "bench.md").read_text()


def test_spec_bench_gives_hf_its_own_dynamic_int8_draft(model_dirs, tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]), "--domains", "code",
            "--prompts-per-domain", "1", "--max-new-tokens", "8", "--k", "2", "--k-sweep", "", "--draft-weights", "int8",
            "--hf-draft-weights", "int8-dynamic", "--out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["hf_draft_weights"] == "int8-dynamic"
    assert report["summary"]["all"]["hf_identical"] == 1  # the fp32 target verifies: still lossless
    assert "HF assisted kernels: stock (draft weights: int8-dynamic)" in (out / "bench.md").read_text()
    assert bench.main([*args, "--hf-kernels", "choral"]) == 2
    assert "hf_draft_weights=int8-dynamic goes with hf_kernels=stock" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_spec_generate_with_a_model_free_drafter_matches_target_greedy(model_dirs, tiny_target, tokenizer, capsys, drafter):
    prompt = "a b c a b c a b c a b"
    args = ["--target", str(model_dirs["target"]), "--draft", drafter, "--prompt", prompt, "--max-new-tokens", "16",
            "--k", "3", "--device", "cpu", "--json"]  # fmt: skip
    assert cli_generate.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    ids = tokenizer.encode(prompt)
    ref = tiny_target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert out["token_ids"] == ref[0, len(ids) :].tolist() and out["stats"]["drafter"] == "draft"


def test_spec_bench_with_ngram_compares_with_transformers_prompt_lookup(model_dirs, tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["--target", str(model_dirs["target"]), "--draft", "ngram", "--domains", "code", "--prompts-per-domain", "1",
            "--max-new-tokens", "8", "--k", "3", "--k-sweep", "", "--out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads((out / "bench.json").read_text())
    s = report["summary"]["all"]
    assert s["choral_identical"] == 1 and s["hf_identical"] == 1 and report["config"]["draft"] == "ngram"


@pytest.mark.unit
def test_auto_precision_is_q4_for_a_bundled_target_on_the_cpu_kernels_only():
    """engine.target_weights=auto: the bundled GGUF target runs its own 4-bit groups where the CPU
    kernels run, and every other target (a folder, another device or dtype) fp32; drafts follow
    (q4 beside q4, int8 beside another target on the kernels, fp32 off them). Nothing loads."""
    from serving.engine.cpu_kernels import rowdot_available
    from serving.engine.engine_settings import EngineSettings

    bundled, folder = "qwen2.5-coder-1.5b-instruct", "/models/my-target"
    kernels = rowdot_available()  # the C++ kernel builds wherever the tests run with a compiler
    s = EngineSettings().resolved(bundled, device="cpu")
    assert (s.target_weights, s.draft_weights) == (("q4", "q4") if kernels else ("fp32", "fp32"))
    s = EngineSettings().resolved(folder, device="cpu")
    assert (s.target_weights, s.draft_weights) == ("fp32", "int8" if kernels else "fp32")
    for off in (dict(cpu_kernels=False), dict(dtype="bfloat16"), dict(compile_backend="inductor")):
        s = EngineSettings(**off).resolved(bundled, device="cpu")
        assert (s.target_weights, s.draft_weights) == ("fp32", "fp32"), off
    s = EngineSettings().resolved(bundled, device="cuda")  # CUDA keeps dtype: no GPU needed to decide
    assert (s.target_weights, s.draft_weights) == ("fp32", "fp32")
    assert EngineSettings(target_weights="fp32").resolved(bundled, device="cpu").target_weights == "fp32"  # asked for
    assert EngineSettings(draft_weights="int8").resolved(bundled, device="cpu").draft_weights == "int8"
    line = EngineSettings().precision_line(bundled, device="cpu")
    if kernels:
        assert line.startswith(f"target {bundled}: q4 (the GGUF's 4-bit groups, W4A8) on cpu") and "identical to the q4 target" in line
    line = EngineSettings(dtype="bfloat16").precision_line(bundled, device="cuda")
    assert line.startswith(f"target {bundled}: bfloat16 on cuda") and "identical to the bfloat16 target decoding alone" in line


@pytest.mark.unit
def test_eagle3_break_even_script_parses_its_arguments(capsys):
    """scripts/experiments/eagle3_break_even.py (it times the real bundled models): its help, and a
    run that names no tokens per call for the 0.5B is refused before anything loads."""
    from tests.conftest import load_script

    module = load_script("scripts/experiments/eagle3_break_even.py")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and "tau" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        module.main(["--rounds", "1"])
    assert e.value.code == 2 and "give --draft-tau TAU or --measure-tau N" in capsys.readouterr().err

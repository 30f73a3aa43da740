"""train-draft end to end on tiny models: distillation lowers the loss and raises held-out
acceptance; a killed run resumes with its step count and optimizer state; two processes under
accelerate; bad configs; the training step compiles with static shapes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo
import yaml

from serving.config import load_config
from tests.conftest import no_recompile, tiny_qwen2
from training import cli
from training.config import TrainDraftConfig
from training.losses import DistillLoss

REPO = Path(__file__).resolve().parents[1]


def tiny_config(model_dirs, out: Path, **sections) -> Path:
    cfg = {
        "model": {"target": str(model_dirs["target"]), "student": str(model_dirs["target"]), "student_layers": [0]},
        "data": {"domain": "code", "n_docs": 40, "seq_len": 32},
        "loss": {"kind": "forward_kl", "ce_ratio": 0.0},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
        "train": {"max_steps": 30, "batch_size": 4, "device": "cpu", "log_every": 1},
        "eval": {"every": 30, "prompts": 4, "max_new_tokens": 12, "engine": {"k": 3}},
        "output": {"dir": str(out), "save_every": 10},
    }
    for section, values in sections.items():
        cfg[section] |= values
    path = out.parent / f"{out.name}.yaml"
    path.write_text("# train-draft --config this.yaml\n" + yaml.safe_dump(cfg))
    return path


def peaked_teacher(tmp_path: Path, tokenizer):
    """A tiny teacher with peaked distributions, so that greedy agreement means something, saved
    with the tokenizer under ``tmp_path / "teacher"``."""
    teacher = tiny_qwen2(0)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20)
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    return teacher


def short_run_config(tmp_path: Path, name: str, model: dict, save_every: int, **sections) -> tuple[Path, Path]:
    """A 12-step run from a one-layer student of the teacher in ``tmp_path / "teacher"``, with
    ``model`` options on top; returns (config file, run folder)."""
    teacher, out = str(tmp_path / "teacher"), tmp_path / name
    config = tiny_config({"target": teacher}, out, model={"target": teacher, "student": teacher, "student_layers": [0]} | model,
                         data={"domain": "code", "n_docs": 20, "seq_len": 32, "max_rows": 64},
                         optim={"lr": 1e-2, "warmup_steps": 1, "schedule": "constant"},
                         train={"max_steps": 12, "batch_size": 4, "device": "cpu", "log_every": 1},
                         eval={"every": 12, "prompts": 2, "max_new_tokens": 4, "engine": {"k": 2}},
                         output={"dir": str(out), "save_every": save_every}, **sections)  # fmt: skip
    return config, out


def distill_tiny(tmp_path: Path, tokenizer, **train_options) -> tuple[dict, Path]:
    """40 steps of distillation from a tiny teacher (``train_options`` override the ``train``
    section); returns (progress, run folder). The teacher folder is ``tmp_path / "teacher"``."""
    from training.recipes import train

    peaked_teacher(tmp_path, tokenizer)
    out = tmp_path / "run"
    config = tiny_config({"target": tmp_path / "teacher"}, out, optim={"lr": 1e-3, "warmup_steps": 2, "schedule": "constant"},
                         data={"domain": "code", "n_docs": 20, "seq_len": 32, "max_rows": 64},
                         train={"max_steps": 40, "batch_size": 4, "device": "cpu", "log_every": 1} | train_options)  # fmt: skip
    return train(load_config(TrainDraftConfig, config, ["eval.every=40"])), out


@pytest.mark.e2e
def test_distillation_lowers_loss_and_raises_held_out_agreement(tmp_path, tokenizer):
    progress, out = distill_tiny(tmp_path, tokenizer)
    losses = [h["loss"] for h in progress["history"] if "loss" in h]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    before, after = progress["before"], progress["after"]
    assert after["val_loss"] < before["val_loss"]
    assert after["val_agreement"] > before["val_agreement"] + 0.05
    assert 0.0 <= after["acceptance_rate"] <= 1.0  # measured with the engine on HumanEval prompts
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 40 and (out / "training.png").exists()
    # best/ is a plain Hugging Face folder the engine loads as a draft.
    from serving.engine import EngineSettings, Request, load_engine

    engine = load_engine(EngineSettings(device="cpu", max_len=64, k=3), str(tmp_path / "teacher"), {"draft": str(out / "best")}).engine
    [res] = engine.generate([Request([5, 6, 7], max_new_tokens=8)])
    assert len(res.token_ids) == 8


@pytest.mark.e2e
def test_time_budget_stops_after_the_last_step_that_fits(tmp_path, tokenizer):
    # A budget no step fits in: the run still takes its first step, then evaluates and saves once.
    progress, out = distill_tiny(tmp_path, tokenizer, time_budget_min=1e-6)
    assert progress["step"] == 1 and progress["steps_this_run"] == 1
    assert [h["step"] for h in progress["history"] if "acceptance_rate" in h] == [1]
    assert json.loads((out / "last" / "progress.json").read_text())["step"] == 1


def run_cli(config: Path, *extra, wait=True):
    cmd = [sys.executable, "-m", "training.cli", "--config", str(config), *extra]
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        return out
    return proc


@pytest.mark.slow  # three training runs; the manifest itself is tested in tests/test_checkpoint.py
@pytest.mark.e2e
def test_a_damaged_checkpoint_falls_back_to_previous_or_is_refused_by_name(tmp_path, tokenizer, capsys):
    """A flipped byte in last/'s model: --resume passes over it to previous/ (saved 3 steps
    earlier) and says why; with previous/ damaged too, train-draft refuses in one line naming the file."""
    from training.recipes import train

    peaked_teacher(tmp_path, tokenizer)
    out = tmp_path / "run"
    config = tiny_config({"target": tmp_path / "teacher"}, out, data={"domain": "code", "n_docs": 20, "seq_len": 32, "max_rows": 64},
                         train={"max_steps": 6, "batch_size": 4, "device": "cpu", "log_every": 1},
                         eval={"every": 1000, "prompts": 2, "max_new_tokens": 4, "engine": {"k": 2}},
                         output={"dir": str(out), "save_every": 3})  # fmt: skip
    train(load_config(TrainDraftConfig, config, []))
    assert json.loads((out / "previous" / "progress.json").read_text())["step"] == 3
    model = out / "last" / "state" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = train(load_config(TrainDraftConfig, config, ["train.max_steps=7"]), resume=True)
    said = capsys.readouterr().out
    assert str(model) in said and "resuming from" in said and str(out / "previous") in said
    assert resumed["step"] == 7 and [h["step"] for h in resumed["history"] if "loss" in h][-4:] == [4, 5, 6, 7]

    for name in ("last", "previous"):  # now both: damage the optimizer state of each
        optimizer = out / name / "state" / "optimizer.bin"
        optimizer.write_bytes(optimizer.read_bytes()[:-10])
    assert cli.main(["--config", str(config), "--resume", "train.max_steps=9"]) != 0
    err = capsys.readouterr().err
    assert str(out / "last" / "state" / "optimizer.bin") in err and "Traceback" not in err


@pytest.mark.slow  # two train-draft processes (~30 s)
@pytest.mark.e2e
def test_kill_and_resume_continues_step_count_and_optimizer(model_dirs, tmp_path):
    out = tmp_path / "killed"
    # max_steps far beyond what the run can reach before the kill, on any machine: the run is
    # killed mid-way (at 400 steps a fast machine once could finish before the test saw step 6).
    config = tiny_config(model_dirs, out, train={"max_steps": 10**6, "batch_size": 4, "device": "cpu", "log_every": 1},
                         eval={"every": 1000, "prompts": 2, "max_new_tokens": 4, "engine": {"k": 2}},
                         output={"dir": str(out), "save_every": 3})  # fmt: skip
    proc = run_cli(config, wait=False)
    progress_file = out / "last" / "progress.json"
    deadline = time.time() + 300
    while time.time() < deadline and not (progress_file.exists() and json.loads(progress_file.read_text())["step"] >= 6):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = json.loads(progress_file.read_text())
    killed_at = saved["step"]
    assert killed_at >= 6 and killed_at % 3 == 0  # only complete checkpoints are visible
    state = torch.load(out / "last" / "state" / "optimizer.bin", weights_only=False)
    adam_steps = {float(s["step"]) for s in state["state"].values()}
    assert adam_steps == {float(killed_at)}

    run_cli(config, "--resume", "train.max_steps=%d" % (killed_at + 6))
    final = json.loads((out / "last" / "progress.json").read_text())
    assert final["step"] == killed_at + 6
    steps = [h["step"] for h in final["history"] if "loss" in h]
    assert steps == list(range(1, killed_at + 7))[-len(steps):] and steps[-1] == killed_at + 6
    state = torch.load(out / "last" / "state" / "optimizer.bin", weights_only=False)
    assert {float(s["step"]) for s in state["state"].values()} == {float(killed_at + 6)}


@pytest.mark.slow  # two processes under accelerate's launcher
@pytest.mark.e2e
def test_two_processes_under_accelerate(model_dirs, tmp_path):
    out = tmp_path / "ddp"
    config = tiny_config(model_dirs, out, train={"max_steps": 4, "batch_size": 2, "device": "cpu", "log_every": 1},
                         eval={"every": 4, "prompts": 2, "max_new_tokens": 4, "engine": {"k": 2}})  # fmt: skip
    # accelerate's torchrun launcher; train.device=cpu makes each process a gloo CPU worker.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "training.cli", "--config", str(config)]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 4
    # Two processes with batch 2 see 2 x 2 x 32 tokens per step.
    assert metrics["tokens"] == 4 * 2 * 2 * 32


@pytest.mark.unit
@pytest.mark.parametrize(
    "override, message",
    [("trian.max_steps=3", "unknown key 'trian'"), ("loss.kind=kl", "loss.kind='kl' must be one of"),
     ("data.seq_len=2", "seq_len=2 must be >= 8"), ("optim.lr=0", "lr=0.0 must be > 0"),
     ("model.draft_vocab=null loss.draft_vocab_only=true", "draft_vocab_only=true needs a reduced model.draft_vocab"),
     ("model.trainable=head model.lora_rank=4", "trainable=head with lora_rank=4"),
     ("model.trainable=head model.draft_vocab=40", "set loss.draft_vocab_only=true")],  # fmt: skip
)
def test_bad_config_is_a_clear_error(override, message, capsys):
    assert cli.main(["--config", str(REPO / "configs" / "distill_code.yaml"), *override.split()]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_wandb_offline_logs_the_run_in_its_folder(tmp_path, tokenizer):
    pytest.importorskip("wandb")
    peaked_teacher(tmp_path, tokenizer)
    config, out = short_run_config(tmp_path, "logged", {}, save_every=4)
    assert cli.main(["--config", str(config), "train.max_steps=4", "eval.every=4", "output.wandb=offline"]) == 0
    [run] = (out / "wandb").glob("offline-run-*")  # what `wandb sync` uploads
    [records] = run.glob("run-*.wandb")
    # The offline records hold metrics.json's scalars: training, held-out evaluation, summary.
    logged = records.read_bytes()
    assert all(key in logged for key in (b"loss", b"lr", b"acceptance_rate", b"val_agreement", b"target_alone/tokens_per_second", b"best_step"))


@pytest.mark.unit
def test_wandb_without_the_package_is_a_clear_error(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert cli.main(["output.wandb=offline"]) == 2
    assert capsys.readouterr().err == ("train-draft: error: output.wandb=offline needs the wandb package: "
                                       "pip install 'choral[wandb]' (or set wandb=off)\n")


@pytest.mark.unit
def test_shipped_configs_load():
    configs = REPO / "configs"
    names = sorted(str(p.relative_to(configs).with_suffix("")) for pattern in ("**/train_*.yaml", "**/distill_*.yaml")
                   for p in configs.glob(pattern))
    assert {"train_code", "distill_code", "distill_chat", "distill_math", "experiments/distill_code_cut"} <= set(names)
    for name in names:
        text = (REPO / "configs" / f"{name}.yaml").read_text()
        assert text.startswith(f"# train-draft --config configs/{name}.yaml")
        load_config(TrainDraftConfig, REPO / "configs" / f"{name}.yaml")


@pytest.mark.slow
@pytest.mark.integration
def test_training_step_compiles_with_static_shapes():
    torch._dynamo.reset()
    teacher, student = tiny_qwen2(0), tiny_qwen2(1, layers=1).train()
    loss_fn = DistillLoss("jsd", ce_ratio=0.2, temperature=1.0, beta=0.5)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)

    def step(ids):
        labels = ids[:, 1:]
        with torch.no_grad():
            t = teacher(input_ids=ids).logits[:, :-1]
        loss, _ = loss_fn(student(input_ids=ids).logits[:, :-1], t, labels, labels != -100)
        return loss

    # Forward and loss in one graph; AOTAutograd compiles the matching backward graph.
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(4):
        ids = torch.randint(0, 384, (2, 16), generator=g)
        if i == 0:  # the one compile; every later step must reuse it
            loss = compiled(ids)
        else:
            with no_recompile():
                loss = compiled(ids)
        loss.backward()
        assert all(p.grad is not None for p in student.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.integration
def test_answers_only_trains_on_the_targets_answers(tmp_path, tokenizer):
    """On-policy rows with ``data.answers_only``: prompt tokens carry no loss, the answer does; a
    cached file from other prompts is regenerated row by row; the reduced head is counted over all text."""
    from training import data as data_mod
    from training import train as tr

    cfg = load_config(TrainDraftConfig, None, ["data.n_docs=20", "data.seq_len=64", "data.on_policy=true",
                                               "data.on_policy_prompts=3", "data.answers_only=true", "data.max_rows=0"])
    texts = data_mod.load_domain_texts("code", 20, tokenizer=tokenizer, seed=0)
    prompts = tr.on_policy_prompts(cfg, tokenizer, texts)
    assert len(prompts) == 3
    torch.save([p + [7, 8, 9] for p in prompts], tmp_path / "on_policy.pt")
    ids, labels, text_ids = tr.build_rows(cfg, tokenizer, None, tmp_path)
    assert ids.shape == labels.shape == (3, 64)
    for row, p in enumerate(prompts):
        n = min(len(p), 64)
        assert (labels[row, :n] == -100).all() and ids[row, :n].tolist() == p[:n]
        if len(p) + 3 <= 64:
            assert labels[row, len(p) : len(p) + 3].tolist() == [7, 8, 9]
    assert len(text_ids) > 0  # max_rows=0 trains on no raw text, but the head still sees it all
    # A cache from other prompts, or one shorter than on_policy_prompts, keeps the rows that match
    # their prompt and has the target generate only the others.
    torch.save([prompts[0] + [7, 8, 9], [1, 2, 3] + prompts[1]], tmp_path / "on_policy.pt")
    teacher = tiny_qwen2(0).eval()
    rows = tr.on_policy_rows(cfg, teacher, tokenizer, prompts, tmp_path)
    assert rows[0] == prompts[0] + [7, 8, 9]
    for row, p in zip(rows[1:], prompts[1:]):
        assert row[: len(p)] == p and len(p) < len(row) <= len(p) + cfg.data.on_policy_new_tokens
    assert torch.load(tmp_path / "on_policy.pt") == rows


@pytest.mark.slow
@pytest.mark.e2e
def test_lora_trains_only_adapters_saves_plain_models_and_resumes(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    peaked_teacher(tmp_path, tokenizer)  # so the one-layer student has something to learn
    model_dirs = {"target": tmp_path / "teacher"}
    config, out = short_run_config(tmp_path, "lora", {"lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]}, save_every=6)
    run_cli(config)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 12
    # Only the adapters train: rank 4 on q_proj and v_proj of the one layer, A and B each.
    state = torch.load(out / "last" / "state" / "optimizer.bin", weights_only=False)
    assert len(state["state"]) == 2 * 2
    assert metrics["trainable_params"] < metrics["student_params"] / 20
    assert metrics["after"]["val_loss"] < metrics["before"]["val_loss"]
    # final/ is a plain model with the adapters merged in: no peft files, other weights than the start.
    assert not (out / "final" / "adapter_config.json").exists()
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    start = AutoModelForCausalLM.from_pretrained(out / "best") if metrics["best_step"] == 0 else None
    names = [n for n, _ in final.named_parameters()]
    assert not any("lora" in n for n in names)
    q = final.model.layers[0].self_attn.q_proj.weight
    k = final.model.layers[0].self_attn.k_proj.weight  # not a target: unchanged
    source = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    assert not torch.equal(q, source.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(k, source.model.layers[0].self_attn.k_proj.weight)
    if start is not None:
        assert torch.equal(start.model.layers[0].self_attn.q_proj.weight, source.model.layers[0].self_attn.q_proj.weight)
    run_cli(config, "--resume", "train.max_steps=15")
    assert json.loads((out / "metrics.json").read_text())["step"] == 15
    state = torch.load(out / "last" / "state" / "optimizer.bin", weights_only=False)
    assert len(state["state"]) == 2 * 2 and {float(s["step"]) for s in state["state"].values()} == {15.0}


@pytest.mark.slow
@pytest.mark.e2e
def test_head_only_training_changes_only_the_head_over_the_draft_vocab(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    teacher = peaked_teacher(tmp_path, tokenizer)
    config, out = short_run_config(tmp_path, "head", {"draft_vocab": 40, "trainable": "head"}, save_every=12,
                                   loss={"kind": "forward_kl", "ce_ratio": 0.0, "draft_vocab_only": True})  # fmt: skip
    run_cli(config)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["after"]["val_loss"] < metrics["before"]["val_loss"]
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    # Only the kept rows (40 and EOS) are parameters of the optimizer (KeptHead), not the whole head.
    assert metrics["trainable_params"] == len(final.config.draft_vocab) * teacher.lm_head.weight.shape[1] < teacher.lm_head.weight.numel()
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")
    assert torch.equal(final.model.layers[0].mlp.up_proj.weight, source.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(final.model.embed_tokens.weight, source.model.embed_tokens.weight)
    # Only the draft vocabulary's rows of the head get a gradient: the others stay as they were.
    keep = torch.tensor(final.config.draft_vocab)
    other = torch.ones(source.lm_head.weight.shape[0], dtype=torch.bool)
    other[keep] = False
    assert not torch.equal(final.lm_head.weight[keep], source.lm_head.weight[keep])
    assert torch.equal(final.lm_head.weight[other], source.lm_head.weight[other])


@pytest.mark.integration
def test_untie_head_gives_the_head_its_own_weights_that_survive_a_save(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from training.students import untie_head

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embeddings = model.model.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        untie_head(model).weight.mul_(2)
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, 2 * embeddings)
    assert torch.equal(loaded.model.embed_tokens.weight, embeddings)


@pytest.mark.integration
def test_lora_target_that_names_no_layer_is_a_clear_error():
    from training.students import add_lora

    model = tiny_qwen2(0)
    with pytest.raises(ValueError, match=r"lora_targets \['qproj'\] name no linear layer"):
        add_lora(model, 4, 8.0, ["qproj", "v_proj"])


@pytest.mark.integration
@pytest.mark.parametrize("draft_weights", ["fp32", "int8"])
def test_evaluation_on_cpu_kernels_leaves_the_trained_student_as_it_was(tokenizer, draft_weights):
    """The held-out evaluation runs the student on the CPU kernels through a copy that shares its
    tensors (no second fp32 student in memory): the student keeps its own Linear modules, its
    weights bit for bit and its trainable flags, and the copy decodes as a deep copy would."""
    import copy

    from serving.engine.cpu_kernels import rowdot_available
    from serving.engine.engine_settings import EngineSettings
    from training.evaluate import measure

    if draft_weights == "int8" and not rowdot_available():
        pytest.skip("int8 drafts need the rowdot C++ kernel")
    teacher, student = tiny_qwen2(0), tiny_qwen2(1).train()
    for name, p in student.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))  # as with model.trainable=head
    before = {name: (p.detach().clone(), p.requires_grad) for name, p in student.named_parameters()}
    linears = [name for name, m in student.named_modules() if type(m) is torch.nn.Linear]
    settings = EngineSettings(cpu_kernels=True, draft_weights=draft_weights, k=3)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    result = measure(teacher, student, tokenizer, prompts, settings, max_new_tokens=8)
    assert [name for name, m in student.named_modules() if type(m) is torch.nn.Linear] == linears
    for name, p in student.named_parameters():
        assert torch.equal(p, before[name][0]) and p.requires_grad == before[name][1], name
    assert student.training
    deep = measure(tiny_qwen2(0), copy.deepcopy(student), tokenizer, prompts, settings, max_new_tokens=8)
    assert result["token_ids"] == deep["token_ids"] and result["acceptance_rate"] == deep["acceptance_rate"]

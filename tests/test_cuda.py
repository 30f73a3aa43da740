"""The CUDA path: the same engine, acceptance math and training loop on a GPU. Skipped where no
CUDA device exists (CI and the development CPU); run on a GPU machine with

    pytest tests/test_cuda.py

Greedy output must equal transformers' own greedy generate on the same GPU; sampled output must
follow the target's distribution (the chi-square test of tests/test_distribution.py, on the GPU);
the decode step must compile with inductor, CUDA's backend, into one graph without recompiling;
and train-draft must train a tiny student on the GPU in bf16 through accelerate.
"""

import json

import pytest
import torch
import torch._dynamo

from serving.engine import EngineConfig, Request, SpeculativeEngine
from serving.runner import ModelRunner
from serving.sampling import SamplingParams, SamplingTensors
from serving.speculative import DecodeState, StepRandom, speculative_step
from tests.conftest import perturbed, tiny_qwen2
from tests.stubs import MarkovStub, state_for
from tests.test_distribution import M, exact_distribution, p_value, tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
EOS = 2


def ragged_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g).tolist()
    return [torch.randint(3, 384, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def gpu_pair():
    target = tiny_qwen2(0)
    draft = perturbed(target, 0.5, seed=1)
    return target.to(CUDA), draft.to(CUDA)


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identical_to_transformers_generate_on_cuda(gpu_pair, tokenizer, k, batch):
    target, draft = gpu_pair
    prompts = ragged_prompts(5, seed=batch * 10 + (k if k != "auto" else 0))
    engine = SpeculativeEngine(target, tokenizer, draft, EngineConfig(max_batch_size=batch, max_len=96, k=k))
    outs = engine.generate([Request(p, max_new_tokens=24) for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(target, prompt, 24)
    assert outs[0].stats["target_calls"] < outs[0].stats["new_tokens"]  # the draft saved target calls


def test_engine_load_puts_both_models_on_the_gpu(model_dirs):
    engine = SpeculativeEngine.load(str(model_dirs["target"]), str(model_dirs["draft"]), device="cuda",
                                    dtype="bfloat16", config=EngineConfig(max_len=64, k=3))  # fmt: skip
    assert {p.device.type for p in engine.target.model.parameters()} == {"cuda"}
    assert {p.dtype for p in engine.draft.model.parameters()} == {torch.bfloat16}
    [out] = engine.generate([Request([5, 6, 7], max_new_tokens=12)])
    assert len(out.token_ids) == 12


@pytest.mark.parametrize("K", [1, 3])
def test_sampled_output_follows_target_distribution_on_cuda(K):
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.9)
    p_table, q_table = tables(K)
    N = 40_000
    target, draft = MarkovStub(p_table.to(CUDA)), MarkovStub(q_table.to(CUDA))
    state = state_for([[0, 1]] * N, capacity=2 + M + K + 8, limit=M + K + 4, eos=[])
    state = DecodeState(*(t.to(CUDA) for t in (state.tokens, state.lengths, state.limits, state.done, state.eos_ids)))
    sampling = SamplingTensors.build([params] * N, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(200 + K)
    while int(state.lengths.min()) < 2 + M:
        u = torch.rand(N, 2 * K + 1, generator=g, device=CUDA)
        speculative_step(target, draft, state, sampling, StepRandom(u[:, :K], u[:, K : 2 * K], u[:, 2 * K]), K)
    samples = state.tokens[:, 2 : 2 + M].cpu()
    assert p_value(samples, exact_distribution(p_table, 1, params)) > 1e-3


def test_decode_step_compiles_with_inductor_once_on_cuda(gpu_pair, monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    torch._dynamo.reset()
    target_model, draft_model = gpu_pair
    B, S, K = 3, 64, 3
    target = ModelRunner(target_model, batch_size=B, max_len=S)
    draft = ModelRunner(draft_model, batch_size=B, max_len=S)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).to(CUDA) for n in (4, 9, 6)]
    state = DecodeState(
        tokens=torch.zeros(B, S + K + 1, dtype=torch.long, device=CUDA),
        lengths=torch.tensor([len(p) for p in prompts], device=CUDA),
        limits=torch.full((B,), 48, device=CUDA),
        done=torch.zeros(B, dtype=torch.bool, device=CUDA),
        eos_ids=torch.tensor([EOS], device=CUDA),
    )
    for b, p in enumerate(prompts):
        state.tokens[b, : len(p)] = p
        target.prefill(p[:-1].unsqueeze(0), b)
        draft.prefill(p[:-1].unsqueeze(0), b)
    sampling = SamplingTensors.build(
        [SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)], CUDA
    )
    step = torch.compile(speculative_step, backend="inductor", fullgraph=True, dynamic=False)
    seen = set()
    gu = torch.Generator(device=CUDA).manual_seed(0)
    for _ in range(8):
        u = torch.rand(B, 2 * K + 1, generator=gu, device=CUDA)
        n_acc, _, _ = step(target, draft, state, sampling, StepRandom(u[:, :K], u[:, K : 2 * K], u[:, 2 * K]), K)
        seen.update(n_acc.tolist())
    assert len(seen) >= 2, f"steps accepted only {seen}; the test needs different acceptance counts"


def test_train_draft_on_cuda_in_bf16(tmp_path, tokenizer):
    from serving.config import load_config
    from tests.test_train_draft import tiny_config
    from training.config import TrainDraftConfig
    from training.train import train

    teacher = tiny_qwen2(0)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20)  # peaked distributions, so greedy agreement means something
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    out = tmp_path / "run"
    config = tiny_config({"target": tmp_path / "teacher"}, out, optim={"lr": 1e-3, "warmup_steps": 2, "schedule": "constant"},
                         data={"domain": "code", "n_docs": 20, "seq_len": 32, "max_rows": 64},
                         train={"max_steps": 40, "batch_size": 4, "device": "cuda", "mixed_precision": "bf16", "log_every": 1})  # fmt: skip
    progress = train(load_config(TrainDraftConfig, config, ["eval.every=40"]))
    losses = [h["loss"] for h in progress["history"] if "loss" in h]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert progress["after"]["val_agreement"] > progress["before"]["val_agreement"] + 0.05
    assert json.loads((out / "metrics.json").read_text())["step"] == 40
    engine = SpeculativeEngine.load(str(tmp_path / "teacher"), str(out / "best"), device="cuda",
                                    config=EngineConfig(max_len=64, k=3))  # fmt: skip
    [res] = engine.generate([Request([5, 6, 7], max_new_tokens=8)])
    assert len(res.token_ids) == 8

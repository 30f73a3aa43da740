"""The CUDA path: the same engine, acceptance math and training loop on a GPU. Skipped where no
CUDA device exists (CI and the development CPU); run on a GPU machine with

    pytest tests/test_cuda.py

Greedy output must equal transformers' own greedy generate on the same GPU; sampled output must
follow the target's distribution (the chi-square test of tests/test_distribution.py, on the GPU);
the decode step must compile with inductor, CUDA's backend, into one graph without recompiling;
the step shapes must replay as CUDA graphs (eager and compiled) with rows of every drafter kind in
one batch, capturing nothing after the warm-up; and train-draft must train a tiny student on the
GPU in bf16 through accelerate.
"""

import json

import pytest
import torch
import torch._dynamo

from serving.engine import EngineConfig, EngineSettings, Request, SpeculativeEngine, load_engine
from serving.engine.sampling import SamplingParams
from tests.conftest import perturbed, tiny_qwen2
from tests.test_compile import compiled_steps
from tests.test_distribution import exact_distribution, p_value, speculative_samples, tables
from tests.test_engine_tiny import hf_greedy, ragged_prompts
from tests.test_train_draft import distill_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_pair():
    target = tiny_qwen2(0)
    draft = perturbed(target, 0.5, seed=1)
    return target.to(CUDA), draft.to(CUDA)


@pytest.mark.integration
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


@pytest.mark.integration
def test_engine_load_puts_both_models_on_the_gpu(model_dirs):
    settings = EngineSettings(device="cuda", dtype="bfloat16", max_len=64, k=3)
    engine = load_engine(settings, str(model_dirs["target"]), {"draft": str(model_dirs["draft"])}).engine
    assert {p.device.type for p in engine.verifier.runner.model.parameters()} == {"cuda"}
    assert {p.dtype for p in engine.drafters["draft"].model.parameters()} == {torch.bfloat16}
    [out] = engine.generate([Request([5, 6, 7], max_new_tokens=12)])
    assert len(out.token_ids) == 12


@pytest.mark.integration
@pytest.mark.parametrize("K", [1, 3])
def test_sampled_output_follows_target_distribution_on_cuda(K):
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.9)
    p_table, q_table = tables(K)
    samples = speculative_samples(p_table, q_table, params, K, seed=200 + K, device=CUDA)
    assert p_value(samples, exact_distribution(p_table, 1, params)) > 1e-3


@pytest.mark.integration
def test_decode_step_compiles_with_inductor_once_on_cuda(gpu_pair):
    seen, _ = compiled_steps(*gpu_pair, "inductor", device=CUDA)
    assert len(seen) >= 2, f"steps accepted only {seen}; the test needs different acceptance counts"


@pytest.mark.integration
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_cuda_graphs_replay_every_drafter_kind_with_the_targets_greedy_output(gpu_pair, tokenizer, backend):
    """A draft model, ngram, suffix and none share a batch of 4 whose step shapes replay as CUDA
    graphs (captured at load): every output is the target's own greedy output, and no graph is
    captured after the warm-up (a capture mid-request would be a shape the warm-up missed)."""
    from serving.engine.drafters.ngram import NgramDrafter
    from serving.engine.drafters.suffix import SuffixDrafter

    torch._dynamo.reset()
    target, draft = gpu_pair
    config = EngineConfig(max_batch_size=4, max_len=96, k=3, k_buckets=(1, 2, 3), compile_backend=backend,
                          cuda_graphs=True)  # fmt: skip
    engine = SpeculativeEngine(target, tokenizer, config=config,
                               drafters={"small": draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(), "none": None})  # fmt: skip
    runners = [engine.verifier.runner, engine.drafters["small"].runner]
    captured = [len(r._graphs) for r in runners]
    assert all(captured), "the warm-up captured no graph"
    prompts = ragged_prompts(6, seed=3)
    names = ["small", "ngram", "suffix", "none", "small", "suffix"]
    outs = engine.generate([Request(p, max_new_tokens=20, drafter=n) for p, n in zip(prompts, names)])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(target, prompt, 20)
    assert [len(r._graphs) for r in runners] == captured
    assert outs[0].stats["target_calls"] < outs[0].stats["new_tokens"]


@pytest.mark.integration
@pytest.mark.parametrize("graphs", [False, True])
def test_seeded_sampling_on_cuda_does_not_depend_on_the_batch(gpu_pair, tokenizer, graphs):
    """A seeded sampled request gives the same tokens alone and beside other requests, on the GPU."""
    target, draft = gpu_pair
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    prompts = ragged_prompts(3, seed=11)

    def run(batch, reqs):
        config = EngineConfig(max_batch_size=batch, max_len=96, k=3, cuda_graphs=graphs)
        return SpeculativeEngine(target, tokenizer, draft, config).generate(reqs)

    [alone] = run(1, [Request(prompts[0], max_new_tokens=20, params=params)])
    others = [Request(p, max_new_tokens=20, params=SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts[1:])]
    together = run(3, [Request(prompts[0], max_new_tokens=20, params=params), *others])
    assert together[0].token_ids == alone.token_ids


@pytest.mark.integration
def test_goodput_steps_with_cuda_graphs_keep_the_targets_greedy_output(gpu_pair, tokenizer):
    """step_k goodput times every graphed shape at load and caps each step's K from those times;
    every row stays transformers' greedy output."""
    from serving.engine.drafters.ngram import NgramDrafter

    target, draft = gpu_pair
    config = EngineConfig(max_batch_size=4, max_len=96, k=3, k_buckets=(1, 2, 3), step_k="goodput", cuda_graphs=True)
    engine = SpeculativeEngine(target, tokenizer, config=config, drafters={"small": draft, "ngram": NgramDrafter()})
    assert set(engine.step_costs.verify) == {(r, w) for r in (1, 2, 4) for w in (1, 2, 3, 4)}
    prompts = ragged_prompts(6, seed=13)
    outs = engine.generate([Request(p, max_new_tokens=20, drafter=("small", "ngram")[i % 2]) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(target, prompt, 20)


@pytest.mark.e2e
def test_train_draft_on_cuda_in_bf16(tmp_path, tokenizer):
    progress, out = distill_tiny(tmp_path, tokenizer, device="cuda", mixed_precision="bf16")
    losses = [h["loss"] for h in progress["history"] if "loss" in h]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert progress["after"]["val_agreement"] > progress["before"]["val_agreement"] + 0.05
    assert json.loads((out / "metrics.json").read_text())["step"] == 40
    engine = load_engine(EngineSettings(device="cuda", max_len=64, k=3), str(tmp_path / "teacher"), {"draft": str(out / "best")}).engine
    [res] = engine.generate([Request([5, 6, 7], max_new_tokens=8)])
    assert len(res.token_ids) == 8

"""The decode step is one static graph: the whole ``speculative_step`` (K draft forwards, the
verification, accept/reject, commit) compiles with fullgraph=True, dynamic=False and runs steps that
accept different numbers of tokens without a single recompile. Neuron's compiler needs exactly this.

The guard is ``torch.compiler.set_stance("fail_on_recompile")`` (``tests.conftest.no_recompile``):
a recompile raises with dynamo's reason (which guard failed, on which tensor), on any CPU.
Which drafting path a step takes must not depend on the machine's rounding either, so the engine
tests force it (``draft_confidence`` 0 never stops early, 1 always does)."""

import pytest
import torch
import torch._dynamo

from serving.engine.runner import ModelRunner
from serving.engine.sampling import SamplingParams, SamplingTensors
from serving.engine.speculative import DecodeState, StepRandom, speculative_step
from tests.conftest import no_recompile, perturbed

pytestmark = pytest.mark.integration


def compiled_steps(target_model, draft_model, backend: str, device="cpu") -> tuple[set[int], DecodeState]:
    """Eight decode steps of one ``speculative_step`` compiled with ``backend`` (fullgraph,
    dynamic=False) on a batch of three prompts; returns the accepted counts seen and the state.
    Every step after the first runs under ``no_recompile``, so a recompile fails the test."""
    torch._dynamo.reset()
    B, S, K = 3, 64, 3
    target = ModelRunner(target_model, batch_size=B, max_len=S)
    draft = ModelRunner(draft_model, batch_size=B, max_len=S)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).to(device) for n in (4, 9, 6)]
    state = DecodeState(
        tokens=torch.zeros(B, S + K + 1, dtype=torch.long, device=device),
        lengths=torch.tensor([len(p) for p in prompts], device=device),
        limits=torch.full((B,), 48, device=device),
        done=torch.zeros(B, dtype=torch.bool, device=device),
        eos_ids=torch.tensor([2], device=device),
    )
    for b, p in enumerate(prompts):
        state.tokens[b, : len(p)] = p
        target.prefill(p[:-1].unsqueeze(0), b)
        draft.prefill(p[:-1].unsqueeze(0), b)
    # A greedy row, a sampled row and a filtered sampled row share the batch.
    sampling = SamplingTensors.build(
        [SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)], device
    )
    step = torch.compile(speculative_step, backend=backend, fullgraph=True, dynamic=False)
    seen = set()
    for i in range(8):
        u = torch.rand(B, 2 * K + 1, generator=g).to(device)
        rand = StepRandom(u[:, :K], u[:, K : 2 * K], u[:, 2 * K])
        if i == 0:  # the one compile
            n_acc, _, _ = step(target, draft, state, sampling, rand, K)
        else:
            with no_recompile():
                n_acc, _, _ = step(target, draft, state, sampling, rand, K)
        seen.update(n_acc.tolist())
    return seen, state


def test_decode_step_compiles_once_and_never_recompiles(tiny_target):
    seen, state = compiled_steps(tiny_target, perturbed(tiny_target, 0.3, seed=4), "aot_eager")
    assert len(seen) >= 2, f"steps accepted only {seen}; the test needs different acceptance counts"
    assert int(state.lengths.min()) > 9


@pytest.mark.slow  # each drafting path's warm-up traced anew: ~30 s a case; the mixed test below stays fast
@pytest.mark.parametrize(
    "k, draft_confidence",
    [(3, None), (3, 0.0), (3, 1.0), ("auto", None)],
    ids=["k3-full-blocks", "k3-confidence-never-stops", "k3-confidence-stops-at-once", "k-auto"],
)
def test_warmup_compiles_every_shape_the_engine_uses(tiny_target, tokenizer, k, draft_confidence):
    """After load (which warms up), decoding ragged prompts with greedy and sampled rows compiles
    nothing. Each drafting path is forced, so the shapes seen never depend on the CPU's rounding."""
    from serving.engine import EngineConfig, Request, SpeculativeEngine
    from serving.engine.sampling import SamplingParams

    torch._dynamo.reset()
    draft = perturbed(tiny_target, 0.3, seed=5)
    config = EngineConfig(max_batch_size=2, max_len=64, k=k, k_buckets=(1, 2, 3), draft_confidence=draft_confidence,
                          compile_backend="aot_eager")  # fmt: skip
    engine = SpeculativeEngine(tiny_target, tokenizer, draft, config)  # warms up at load
    requests = [Request([5, 6, 7, 8], max_new_tokens=16), Request([9, 10], SamplingParams(temperature=0.8, seed=1),
                                                                  max_new_tokens=12)]  # fmt: skip
    with no_recompile():  # nothing may compile now
        outs = engine.generate(requests)
    assert all(o.token_ids for o in outs), "nothing was decoded, so nothing was checked"


@pytest.mark.slow  # ~40 s of tracing; test_decode_step_compiles_once_... guards the fast tier
def test_mixed_drafters_and_batch_buckets_compile_nothing_after_warmup(tiny_target, tokenizer):
    """Rows of a draft model, ``ngram``, ``prediction`` and ``none`` share steps at batch buckets 1,
    2 and 4 (a lone request, then four, then the last ones): after the warm-up, nothing compiles."""
    from serving.engine import EngineConfig, Request, SpeculativeEngine
    from serving.engine.drafters.ngram import NgramDrafter

    torch._dynamo.reset()
    config = EngineConfig(max_batch_size=4, max_len=64, k=3, k_buckets=(1, 2, 3), compile_backend="aot_eager")
    drafters = {"small": perturbed(tiny_target, 0.3, seed=6), "ngram": NgramDrafter(), "none": None}
    engine = SpeculativeEngine(tiny_target, tokenizer, config=config, drafters=drafters)  # warms up at load
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10], [11, 12, 13], [14, 15, 16, 17]]
    with no_recompile():
        [alone] = engine.generate([Request(prompts[0], max_new_tokens=10, drafter="ngram")])
        names = ["small", "ngram", "none", "prediction"]
        outs = engine.generate([Request(p, max_new_tokens=6 + 3 * i, drafter=n, prediction=[20, 21, 22] if n == "prediction" else None)
                                for i, (p, n) in enumerate(zip(prompts, names))])  # fmt: skip
    assert alone.token_ids and all(o.token_ids for o in outs)


def test_a_shape_not_warmed_up_fails_with_the_recompiles_reason(tiny_target):
    """The guard has teeth: a forward width that warm-up never compiled raises, and the message
    names the guard that failed (the tensor and its size), so the cause is found from the log."""
    torch._dynamo.reset()
    runner = ModelRunner(tiny_target, batch_size=1, max_len=32)
    runner.compile("aot_eager")
    runner.forward(torch.zeros(1, 2, dtype=torch.long), torch.arange(2).unsqueeze(0))
    with pytest.raises(RuntimeError, match=r"(?s)Detected recompile.*_eager_forward.*size mismatch at index 1\. expected 2, actual 3"):
        with no_recompile():
            runner.forward(torch.zeros(1, 3, dtype=torch.long), torch.arange(3).unsqueeze(0))


@pytest.mark.unit
def test_cuda_graphs_on_a_cpu_model_name_the_device_and_the_fix(tiny_target):
    """cuda_graphs needs a CUDA device; on a CPU model it says so and names both ways out."""
    runner = ModelRunner(tiny_target, batch_size=1, max_len=32)
    with pytest.raises(ValueError, match=r"cuda_graphs needs a CUDA device; this model is on cpu: set engine.device=cuda or engine.cuda_graphs=false"):
        runner.use_cuda_graphs()

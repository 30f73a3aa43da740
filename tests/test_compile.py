"""The decode step is one static graph: the whole ``speculative_step`` (K draft forwards, the
verification, accept/reject, commit) compiles with fullgraph=True, dynamic=False and runs steps that
accept different numbers of tokens without a single recompile. Neuron's compiler needs exactly this."""

import torch
import torch._dynamo

from serving.runner import ModelRunner
from serving.sampling import SamplingParams, SamplingTensors
from serving.speculative import DecodeState, StepRandom, speculative_step
from tests.conftest import perturbed


def compiled_steps(target_model, draft_model, backend: str, device="cpu") -> tuple[set[int], DecodeState]:
    """Eight decode steps of one ``speculative_step`` compiled with ``backend`` (fullgraph,
    dynamic=False) on a batch of three prompts; returns the accepted counts seen and the state.
    The caller sets ``error_on_recompile``, so a recompile fails the test."""
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
    for _ in range(8):
        u = torch.rand(B, 2 * K + 1, generator=g).to(device)
        n_acc, _, _ = step(target, draft, state, sampling, StepRandom(u[:, :K], u[:, K : 2 * K], u[:, 2 * K]), K)
        seen.update(n_acc.tolist())
    return seen, state


def test_decode_step_compiles_once_and_never_recompiles(tiny_target, monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    seen, state = compiled_steps(tiny_target, perturbed(tiny_target, 0.3, seed=4), "aot_eager")
    assert len(seen) >= 2, f"steps accepted only {seen}; the test needs different acceptance counts"
    assert int(state.lengths.min()) > 9


def test_warmup_compiles_every_shape_the_engine_uses(tiny_target, tokenizer, monkeypatch):
    from serving.engine import EngineConfig, Request, SpeculativeEngine

    torch._dynamo.reset()
    draft = perturbed(tiny_target, 0.3, seed=5)
    config = EngineConfig(max_len=64, k=3, draft_confidence=0.5, compile_backend="aot_eager")
    engine = SpeculativeEngine(tiny_target, tokenizer, draft, config)  # warms up at load
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # nothing may compile now
    [out] = engine.generate([Request([5, 6, 7, 8], max_new_tokens=16)])
    assert len(out.token_ids) == 16

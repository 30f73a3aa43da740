"""serving.engine.decoder (the lean forward on Choral's CPU kernels) on tiny random Qwen2 models:
the Hugging Face forward's numbers to float rounding, one N-token step equal to N one-token
steps bit for bit, a row's result independent of the batch, and fused projections equal to the
separate ones."""

from __future__ import annotations

import pytest
import torch

from serving.engine import cpu_kernels
from serving.engine.decoder import LeanDecoder
from serving.engine.kv_cache import StaticKVCache
from serving.engine.runner import ModelRunner
from tests.test_cpu_kernels import _on_q4_lattice

transformers = pytest.importorskip("transformers")
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels._rowdot_ext() is None, reason="rowdot kernel cannot be built here")


def _tiny(seed=0, weights="fp32", **overrides):
    """A tiny Qwen2; for q4 its weights on 4-bit groups except v_proj (as a Q4_K_M file's Q6_K
    tensors, which go to int8), so q and k are 4-bit and v int8, as in the bundled target."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).eval()
    return _on_q4_lattice(model, skip=("v_proj", "lm_head")) if weights == "q4" else model


def _ids(n, seed):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.unit
@pytest.mark.parametrize("weights", ["fp32", "int8", "q4"])
def test_the_lean_forward_is_the_hugging_face_forward_to_rounding(weights):
    """Prefill (longer than max_rows: SDPA) and steps through ``ModelRunner``, with and without the
    lean forward, on the same prepared weights: the logits agree to float rounding."""
    model = cpu_kernels.prepare_for_cpu(_tiny(weights=weights), weights=weights, token_counts=(1, 5))
    assert isinstance(model._choral_decoder, LeanDecoder)
    prompt, steps = _ids(20, seed=1), _ids(6, seed=2)

    def run(lean: bool) -> torch.Tensor:
        model._choral_decoder.enabled = lean
        runner = ModelRunner(model, batch_size=1, max_len=64)
        out = [runner.prefill(prompt, slot=0)]
        out.append(runner.forward(steps[:, :1], torch.tensor([[20]])))
        out.append(runner.forward(steps[:, 1:], torch.arange(21, 26).unsqueeze(0)))
        return torch.cat(out, dim=1)  # [1, 1 + 1 + 5, V]

    lean, hf = run(True), run(False)
    model._choral_decoder.enabled = True
    torch.testing.assert_close(lean, hf, rtol=1e-4, atol=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_a_lean_n_token_step_is_n_one_token_steps_bit_for_bit_in_any_batch(weights):
    """Rows at different positions share a step (ragged, as a running batch): each row of a 5-token
    step equals its own 1-token steps run alone, and the cache they leave behind gives the same next
    step."""
    model = cpu_kernels.prepare_for_cpu(_tiny(weights=weights), weights=weights, token_counts=(1, 5))
    lengths = (7, 12, 3, 9)  # 4 rows x 5 tokens: more rows in all than max_rows (16), still a step
    prompts = [_ids(n, seed=n) for n in lengths]
    draft = torch.cat([_ids(5, seed=10 + b) for b in range(4)])  # [4, 5]
    together = ModelRunner(model, batch_size=4, max_len=40)
    for slot, p in enumerate(prompts):
        together.prefill(p, slot=slot)
    positions = torch.stack([torch.arange(n, n + 5) for n in lengths])  # [4, 5]
    batch = together.forward(draft, positions)  # [4, 5, V]
    nxt = together.forward(draft[:, :1], positions[:, -1:] + 1)
    for b, p in enumerate(prompts):
        alone = ModelRunner(model, batch_size=1, max_len=40)
        alone.prefill(p, slot=0)
        rows = [alone.forward(draft[b : b + 1, i : i + 1], positions[b : b + 1, i : i + 1]) for i in range(5)]
        assert torch.equal(torch.cat(rows, dim=1), batch[b : b + 1]), b
        assert torch.equal(alone.forward(draft[b : b + 1, :1], positions[b : b + 1, -1:] + 1), nxt[b : b + 1]), b


@pytest.mark.unit
def test_fused_projections_are_the_separate_ones_and_share_their_storage():
    x = torch.randn(3, 64)
    for weights, kind in (("int8", cpu_kernels.Int8Linear), ("q4", cpu_kernels.Q4Linear)):
        model = cpu_kernels.prepare_for_cpu(_tiny(weights=weights), weights=weights, token_counts=(1, 5))
        mlp, lean = model.model.layers[0].mlp, model._choral_decoder.layers[0]
        assert type(lean.gate_up) is kind
        with torch.no_grad():
            assert torch.equal(lean.gate_up(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))
        start, end = lean.gate_up.qweight.data_ptr(), lean.gate_up.qweight.data_ptr() + lean.gate_up.qweight.nbytes
        assert all(start <= m.qweight.data_ptr() < end for m in (mlp.gate_proj, mlp.up_proj))
    # q4: q and k in 4 bits, v in int8: not fused, called one by one.
    attn = model.model.layers[0].self_attn
    assert (type(attn.q_proj), type(attn.v_proj)) == (cpu_kernels.Q4Linear, cpu_kernels.Int8Linear)
    assert cpu_kernels.fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]) is None
    with torch.no_grad():
        assert torch.equal(lean.qkv(x), torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1))


@pytest.mark.unit
def test_models_the_lean_forward_does_not_cover_keep_the_hugging_face_forward():
    assert LeanDecoder.build(_tiny(hidden_act="gelu"), cpu_kernels._rowdot_ext(), cpu_kernels.fuse_linears, 16) is None
    scaled = _tiny(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert LeanDecoder.build(scaled, cpu_kernels._rowdot_ext(), cpu_kernels.fuse_linears, 16) is None
    model = cpu_kernels.prepare_for_cpu(_tiny(), weights="int8", lean=False)
    assert getattr(model, "_choral_decoder", None) is None


@pytest.mark.unit
def test_the_rope_write_kernel_refuses_a_position_outside_the_cache():
    ext = cpu_kernels._rowdot_ext()
    cache = StaticKVCache(1, 1, 2, 8, 16, torch.float32, "cpu")
    qkv, cos = torch.randn(1, 1, (4 + 4) * 16), torch.ones(1, 1, 16)
    with pytest.raises(RuntimeError, match="position 8 outside the cache"):
        ext.rowdot_rope_write(qkv, cos, cos, torch.tensor([[8]]), cache.keys[0], cache.values[0], 4, 2)


@pytest.mark.unit
@pytest.mark.parametrize("inter", [37, 128])
def test_silu_times_up_is_torchs_to_rounding_and_each_row_its_own(inter):
    """``rowdot_silu_mul``: SiLU(gate) * up as torch computes it, to float rounding (large
    negative and positive gates included), and each row's result the same alone or among 17 rows
    (torch's own SiLU changes an element's last bit with where its thread's block ends)."""
    ext = cpu_kernels._rowdot_ext()
    gu = torch.randn(17, 2 * inter) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    got = ext.rowdot_silu_mul(gu, inter)  # [17, I]
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
    assert all(torch.equal(ext.rowdot_silu_mul(gu[i : i + 1], inter), got[i : i + 1]) for i in range(17))

"""serving.engine.cpu_kernels on a tiny random Qwen2: same numbers as eager, and batch-invariant.

The "rowdot" kernel is compiled on first use (~30 s once, then cached by torch); its tests
are skipped where it cannot be built (no C++ compiler).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import cpu_kernels
from serving.engine.cpu_kernels import InvariantLinear, prepare_for_cpu, set_enabled

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, StaticCache  # noqa: E402


def _cpu_vendor() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# MKL's packed sgemm gave batch-invariant rows on the Intel development VM; on an AMD EPYC it does
# not for some shapes (MKL picks other code paths on non-Intel CPUs), and prepare_for_cpu's check
# then keeps F.linear for those shapes. The fallback's invariance is only asserted on Intel.
VENDOR = _cpu_vendor()
MKL_INVARIANT = VENDOR == "GenuineIntel"
NOT_INTEL = f"MKL packed sgemm is batch-invariant on Intel CPUs only; this one is {VENDOR!r}"


def _kernels():
    out = [pytest.param("mkl", marks=pytest.mark.skipif(not torch._C.has_mkl, reason="no MKL"))]
    out.append(pytest.param("rowdot", marks=pytest.mark.skipif(
        cpu_kernels._rowdot_ext() is None, reason="rowdot kernel cannot be built here")))
    return out


KERNELS = _kernels()


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).eval()


def _ids(n, seed=1):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.integration
@pytest.mark.parametrize("kernel", KERNELS)
def test_prepared_matches_original(kernel):
    ref_model = _tiny()
    model = _tiny()
    prepare_for_cpu(model, kernel=kernel)
    if kernel == "rowdot" or MKL_INVARIANT:
        assert sum(isinstance(m, InvariantLinear) for m in model.modules()) == 2 * 7 + 1  # lm_head too
    ids = _ids(12)
    with torch.no_grad():
        ref = ref_model(ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # Also with autograd on (nothing requires grad after prepare, so the fast path still runs).
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_a_query_row_attends_like_sdpa_and_a_masked_out_row_stays_finite():
    """``_gqa_row`` (one query row, heads grouped onto their key/value head) is SDPA's attention
    to float rounding, with and without a mask; a padding row with every key masked gives finite
    numbers, not NaN."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 12, 1, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    mask = torch.rand(3, 1, 1, 9) > 0.3
    mask[:, :, :, 0], mask[2] = True, False  # row 2: a padding row, nothing visible
    for m in (None, mask[:2]):
        rows = 3 if m is None else 2
        ref = F.scaled_dot_product_attention(q[:rows], k[:rows], v[:rows], attn_mask=m, scale=0.25, enable_gqa=True)
        got = cpu_kernels._gqa_row(q[:rows], k[:rows], v[:rows], m, 0.25)  # [B, 1, H, D]
        torch.testing.assert_close(got, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(cpu_kernels._gqa_row(q, k, v, mask, 0.25)).all()


@pytest.mark.integration
def test_a_prefill_into_a_large_static_cache_attends_to_its_prompt_only():
    """The row-wise attention leaves out the cache slots past the prompt on a prefill (masked
    anyway): the logits are the stock model's over the full cache, then decoding goes on alike."""
    from serving.engine.runner import ModelRunner

    stock, prepared = ModelRunner(_tiny(), batch_size=1, max_len=256), ModelRunner(
        prepare_for_cpu(_tiny(), token_counts=(1, 5)), batch_size=1, max_len=256)
    prompt = _ids(40)  # past max_rows: the prefill path
    with torch.no_grad():
        first = [r.prefill(prompt, 0) for r in (stock, prepared)]
        nxt = [r.forward(_ids(1, seed=3), torch.tensor([[40]])) for r in (stock, prepared)]
    torch.testing.assert_close(first[1], first[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nxt[1], nxt[0], rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cache_cls", ["dynamic", "static"])
def test_one_n_token_step_equals_n_one_token_steps(kernel, cache_cls):
    if kernel == "mkl" and not MKL_INVARIANT:
        pytest.skip(NOT_INTEL)
    model = prepare_for_cpu(_tiny(), kernel=kernel, token_counts=(1, 5))
    prompt, draft = _ids(20), _ids(5, seed=2)  # 20 > max_rows: the prefill takes the library path

    def cache():
        if cache_cls == "static":
            return StaticCache(config=model.config, max_cache_len=64)
        return DynamicCache(config=model.config)

    with torch.no_grad():
        a, b = cache(), cache()
        model(prompt, past_key_values=a, use_cache=True)
        model(prompt, past_key_values=b, use_cache=True)
        one_by_one = torch.cat([model(draft[:, i : i + 1], past_key_values=a, use_cache=True).logits
                                for i in range(5)], dim=1)
        together = model(draft, past_key_values=b, use_cache=True).logits
        # And the step after: the KV written by the 5-token step is the same as by 1-token steps.
        nxt = _ids(1, seed=3)
        after_a = model(nxt, past_key_values=a, use_cache=True).logits
        after_b = model(nxt, past_key_values=b, use_cache=True).logits
    assert torch.equal(one_by_one, together)
    assert torch.equal(after_a, after_b)


@pytest.mark.unit
def test_eager_is_not_batch_invariant_but_prepared_is():
    """Documents why this module exists: stock kernels round a 1-row step differently."""
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(0))
    lin = nn.Linear(1536, 4096).requires_grad_(False)
    eager_rows = torch.cat([F.linear(x[i : i + 1], lin.weight, lin.bias) for i in range(5)])
    kernel = "rowdot" if cpu_kernels.rowdot_available() else "mkl"  # what prepare_for_cpu's "auto" picks
    if kernel == "mkl" and not MKL_INVARIANT:
        pytest.skip(NOT_INTEL + ", and the rowdot kernel cannot be built")
    prepared = InvariantLinear(lin, kernel, max_rows=16, pack_rows=5)
    rows = torch.cat([prepared(x[i : i + 1]) for i in range(5)])
    assert torch.equal(rows, prepared(x))
    assert (eager_rows - F.linear(x, lin.weight, lin.bias)).abs().max() < 1e-4  # close, maybe not equal


@pytest.mark.unit
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(37, 19), (8, 16), (1, 5), (130, 70)])
def test_linear_rows_invariant_odd_shapes(kernel, shape):
    out_f, in_f = shape
    if kernel == "mkl" and out_f == 1:
        pytest.skip("MKL rounds a 1-output layer per row count; prepare_for_cpu's check catches it")
    if kernel == "mkl" and not MKL_INVARIANT:
        pytest.skip(NOT_INTEL)
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f).requires_grad_(False)
    mod = InvariantLinear(lin, kernel, max_rows=16, pack_rows=9)
    x = torch.randn(11, in_f)
    full = mod(x)
    for n in range(1, 12):
        for i in range(0, 12 - n):
            assert torch.equal(mod(x[i : i + n]), full[i : i + n]), (n, i)
    torch.testing.assert_close(full, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    # 3-D input, and more rows than max_rows falls back to F.linear exactly.
    assert torch.equal(mod(x.view(1, 11, in_f))[0], full)
    big = torch.randn(17, in_f)
    assert torch.equal(mod(big), F.linear(big, lin.weight, lin.bias))


@pytest.mark.integration
def test_weights_state_dict_and_toggle():
    ref_model = _tiny()
    model = _tiny()
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    lm_head = model.lm_head.weight
    prepare_for_cpu(model)
    after = model.state_dict()
    assert {k: v.data_ptr() for k, v in after.items()} == before  # same tensors, no copies
    assert model.lm_head.weight is lm_head
    assert model.config._attn_implementation == cpu_kernels.ATTN_NAME
    ids = _ids(9)
    with torch.no_grad():
        set_enabled(model, False)
        assert model.config._attn_implementation == "sdpa"
        assert torch.equal(model(ids).logits, ref_model(ids).logits)  # stock path, bit for bit
        set_enabled(model, True)
        assert model.config._attn_implementation == cpu_kernels.ATTN_NAME


@pytest.mark.integration
def test_layers_failing_the_check_stay_stock(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_check_invariance", lambda mod, counts: mod.out_features != 128)
    model = prepare_for_cpu(_tiny(), kernel="mkl")
    kinds = {name: type(m) for name, m in model.named_modules() if name.endswith(("gate_proj", "q_proj"))}
    assert kinds["model.layers.0.mlp.gate_proj"] is nn.Linear  # 64 -> 128 "failed"
    assert kinds["model.layers.0.self_attn.q_proj"] is InvariantLinear
    assert "not batch-invariant" in caplog.text


@pytest.mark.unit
def test_grad_enabled_input_falls_back():
    lin = nn.Linear(16, 8)
    mod = InvariantLinear(lin, "mkl", max_rows=16, pack_rows=5)
    x = torch.randn(3, 16, requires_grad=True)
    mod(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.integration
def test_bad_arguments():
    with pytest.raises(ValueError):
        prepare_for_cpu(_tiny(), kernel="int8")
    # k_buckets=[16] asks for a 17-token verify: the error names the largest K that fits and the fix.
    with pytest.raises(ValueError, match=r"\[1, 17\] exceed max_rows=16.*K can be at most 15.*k_buckets"):
        prepare_for_cpu(_tiny(), token_counts=(1, 17), max_rows=16)


# ---- int8 drafts (W8A8) ------------------------------------------------------------------------

needs_rowdot = pytest.mark.skipif(cpu_kernels._rowdot_ext() is None, reason="rowdot kernel cannot be built here")


@pytest.mark.unit
@needs_rowdot
# Query heads per KV head 3, 5, 4, 7 (the kernel weighs values three heads per pass on AVX-512: 3,
# 3 + 2, 3 + 1, 3 + 3 + 1) and head sizes off the vector width and above 128.
@pytest.mark.parametrize("H, Hkv, d", [(6, 2, 16), (6, 2, 20), (10, 2, 136), (8, 2, 24), (7, 1, 8)])
def test_the_attention_kernel_gives_each_row_exactly_its_own_keys_whatever_shares_the_batch(H, Hkv, d):
    """``rowdot_attention``: every (sequence, query row) attends over the slots its mask row allows,
    as SDPA does to float rounding; computed alone, over just those slots of a shorter cache, it is
    the same bit for bit (the batch's longest extent must not change a row: on AVX-512 SDPA's and
    softmax's reductions split a short row differently from a long one). A row that sees nothing
    gives zeros."""
    torch.manual_seed(0)
    B, T, S = 3, 4, 40
    q, k, v = torch.randn(B, T, H, d), torch.randn(B, Hkv, S, d), torch.randn(B, Hkv, S, d)
    pos = torch.tensor([[3, 4, 5, 6], [30, 31, 32, 33], [9, 10, 11, -1]])  # row 2, query 3: padding
    mask = torch.arange(S).view(1, 1, S) <= pos.unsqueeze(-1)  # [B, T, S]
    ext = cpu_kernels._rowdot_ext()
    got = ext.rowdot_attention(q, k, v, mask, 0.25)  # [B, T, H, D]
    assert torch.equal(got[2, 3], torch.zeros(H, d))
    for b in range(B):
        for t in range(T):
            n = int(pos[b, t]) + 1
            if n == 0:
                continue
            ref = F.scaled_dot_product_attention(q[b : b + 1, t : t + 1].transpose(1, 2), k[b : b + 1, :, :n],
                                                 v[b : b + 1, :, :n], scale=0.25, enable_gqa=True)
            torch.testing.assert_close(got[b, t], ref[0, :, 0], rtol=1e-5, atol=1e-6)
            alone = ext.rowdot_attention(q[b : b + 1, t : t + 1], k[b : b + 1, :, :n].contiguous(),
                                         v[b : b + 1, :, :n].contiguous(), torch.ones(1, 1, n, dtype=torch.bool), 0.25)
            assert torch.equal(alone[0, 0], got[b, t]), (b, t)


def _w8a8_reference(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """The kernel's arithmetic in plain PyTorch: per-row symmetric int8 for weights and inputs,
    exact integer dot products, then the two scales."""
    w = lin.weight.detach()
    ws = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
    wq = torch.round(w / ws[:, None]).clamp(-127, 127).to(torch.int64)  # [N, K]
    xs = x.abs().amax(dim=1) / 127.0  # [M]
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    xq = torch.round(x / xs[:, None]).clamp(-127, 127).to(torch.int64)  # [M, K]
    dot = xq @ wq.T  # [M, N] exact
    y = dot.float() * xs[:, None] * ws[None, :]
    return y if lin.bias is None else y + lin.bias.detach()


@pytest.mark.unit
@needs_rowdot
# 4200 inputs: three column blocks of the kernel (2048 bytes each), the last one short.
@pytest.mark.parametrize("in_f,out_f,bias", [(64, 40, False), (72, 19, True), (200, 8, False), (4200, 11, False)])
def test_int8_linear_is_the_w8a8_arithmetic(in_f, out_f, bias):
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias)
    mod = cpu_kernels.Int8Linear(lin)
    x = torch.randn(7, in_f)
    with torch.no_grad():
        got = mod(x)
        ref = _w8a8_reference(x, lin)
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
        # Each row is quantized alone and integer sums are exact: batch-invariant bit for bit.
        assert all(torch.equal(mod(x[i : i + 1]), got[i : i + 1]) for i in range(7))
        assert torch.equal(mod(x.view(1, 7, in_f))[0], got)
        # Close to the float layer (what a draft needs), but not equal to it.
        exact = lin(x)
        assert (got - exact).norm() / exact.norm() < 0.03
        assert not torch.equal(got, exact)
        # Long inputs (a prefill) run the same kernel: each row as it would alone.
        big = torch.randn(40, in_f)
        assert torch.allclose(mod(big), _w8a8_reference(big, lin), rtol=1e-6, atol=1e-6)
        assert torch.equal(mod(big)[3:4], mod(big[3:4]))
        # Every row count splits the rows into other chunks (at most 8 a chunk): rows stay the same.
        alone = torch.cat([mod(big[i : i + 1]) for i in range(17)])
        assert all(torch.equal(mod(big[:m]), alone[:m]) for m in range(2, 18))
        # A reduced vocabulary keeps the same rows.
        ids = torch.tensor([0, out_f - 1, out_f // 2])
        assert torch.equal(mod.select_rows(ids)(x), got[:, ids])
    assert mod.qweight.dtype == torch.int8 and mod.qweight.shape[1] % 64 == 0


@pytest.mark.unit
@needs_rowdot
@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_rows_on_amx_are_the_vector_rows_bit_for_bit(weights):
    """Where the CPU has AMX, int8 calls of two rows or more and q4 calls of 32 or more run on its
    tiles (rowdot_amx(0) sends them to the vector units, where shorter calls always run). Integer
    dots are exact on either unit and the float work after them is the same expression, so every
    row matches the vector path and its own one-row call bit for bit. int8: panels of 32 weight rows
    with a leftover on VNNI, one to three chunks of 16 input rows (the last padded), an input width
    over several K steps and one that is a single step. q4: panels of 16 outputs with a padded last
    one, chunks of 11 to 16 rows, an odd number of groups."""
    ext = cpu_kernels._rowdot_ext()
    if not ext.rowdot_amx(1):  # on, as by default (whatever an earlier test left), and whether it can be
        pytest.skip("no AMX on this CPU (or the kernel refused the tile state): the integer kernels have no AMX path here")
    torch.manual_seed(0)
    if weights == "int8":
        shapes, counts = ((64, 40), (1536, 96), (4200, 75), (8960, 33)), (1, 2, 5, 16, 17, 40)
    else:
        shapes, counts = ((64, 40), (1568, 96), (4160, 75), (8960, 33)), (1, 31, 32, 33, 47, 70)  # 1568: 49 groups
    try:
        for in_f, out_f in shapes:
            if weights == "int8":
                mod = cpu_kernels.Int8Linear(nn.Linear(in_f, out_f))
            else:
                lin = _on_q4_lattice(nn.Linear(in_f, out_f))
                mod = cpu_kernels.Q4Linear(lin, cpu_kernels.q4_lattice(lin.weight))
            for rows in counts:
                x = torch.randn(rows, in_f)
                x[0, :5] = 0.0
                assert ext.rowdot_amx(1)
                with torch.no_grad():
                    on_amx = mod(x)
                    assert not ext.rowdot_amx(0)
                    on_vector = mod(x)
                    alone = torch.cat([mod(x[i : i + 1]) for i in range(rows)])
                assert torch.equal(on_amx, on_vector), (in_f, out_f, rows)
                assert torch.equal(on_amx, alone), (in_f, out_f, rows)
    finally:
        ext.rowdot_amx(1)


@pytest.mark.slow  # builds the AMX kernel
@pytest.mark.integration
def test_the_amx_path_compiles_on_any_machine():
    """The kernel's AMX code is compiled only where -march=native has AMX: this checks it (syntax and
    types, no code generated) for a Sapphire Rapids target on whatever machine runs the tests."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    probe = subprocess.run(["c++", "-march=sapphirerapids", "-x", "c++", "-fsyntax-only", "-"], input="int main() {}",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the C++ compiler does not take -march=sapphirerapids: {probe.stderr.strip()[:200]}")
    includes = [f"-I{d}" for d in (*include_paths(), sysconfig.get_paths()["include"])]
    done = subprocess.run(["c++", "-fsyntax-only", "-std=c++17", "-march=sapphirerapids", "-fopenmp",
                           "-DTORCH_EXTENSION_NAME=choral_syntax", *includes, str(cpu_kernels.ROWDOT_SOURCE)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    source = cpu_kernels.ROWDOT_SOURCE.read_text()
    assert "_tile_dpbsud" in source and "#define CHORAL_AMX 1" in source


@pytest.mark.integration
@needs_rowdot
def test_int8_draft_keeps_speculative_output_exact():
    """An int8 draft changes what is proposed, never what is produced: greedy speculative output
    equals the fp32 target's own, and a draft that is an int8 copy of the target still agrees
    with it most of the time."""
    from serving.engine.core import SpeculativeEngine
    from serving.engine.cpu_kernels import use_cpu_kernels
    from serving.engine.engine_settings import EngineConfig
    from serving.engine.request import Request
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    target, draft = _tiny(0), _tiny(0)
    config = EngineConfig(k=4, k_buckets=(4,), max_len=64)
    assert use_cpu_kernels([target], drafts=[draft], draft_weights="int8", device="cpu", dtype="float32",
                           widths=config.step_widths)
    assert sum(isinstance(m, cpu_kernels.Int8Linear) for m in draft.modules()) == 2 * 7 + 1
    assert not any(isinstance(m, cpu_kernels.Int8Linear) for m in target.modules())
    prompts = [[t % 300 for t in _ids(n, seed=n)[0].tolist()] for n in (5, 9, 13)]
    alone = SpeculativeEngine(target, tok, None, EngineConfig(k=0, max_len=64))
    spec = SpeculativeEngine(target, tok, draft, config)
    ref = alone.generate([Request(p, max_new_tokens=24) for p in prompts])
    out = spec.generate([Request(p, max_new_tokens=24) for p in prompts])
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    accepted = sum(o.stats["accepted"] for o in out) / sum(o.stats["drafted"] for o in out)
    assert accepted > 0.5


@pytest.mark.integration
@needs_rowdot
def test_an_int8_target_gives_its_own_greedy_output_in_any_batch():
    """target_weights=int8: the speculative output (batch of 3, ragged prompts, an int8 draft) is
    token-identical to the int8 target decoding each prompt alone, one token a step."""
    from serving.engine.core import SpeculativeEngine
    from serving.engine.cpu_kernels import use_cpu_kernels
    from serving.engine.engine_settings import EngineConfig
    from serving.engine.request import Request
    from serving.engine.engine_settings import EngineSettings
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    target, draft = _tiny(0), _tiny(1)
    config = EngineConfig(k=4, k_buckets=(2, 4), max_len=64, max_batch_size=3)
    assert use_cpu_kernels([target], drafts=[draft], draft_weights="int8", target_weights="int8", device="cpu",
                           dtype="float32", widths=config.step_widths)  # fmt: skip
    assert sum(isinstance(m, cpu_kernels.Int8Linear) for m in target.modules()) == 2 * 7 + 1
    prompts = [[t % 300 for t in _ids(n, seed=n)[0].tolist()] for n in (5, 9, 13)]
    alone = SpeculativeEngine(target, tok, None, EngineConfig(k=0, max_len=64))
    ref = [alone.generate([Request(p, max_new_tokens=24)])[0].token_ids for p in prompts]
    out = SpeculativeEngine(target, tok, draft, config).generate([Request(p, max_new_tokens=24) for p in prompts])
    assert [o.token_ids for o in out] == ref
    with pytest.raises(ValueError, match="target_weights=int8 runs on Choral's CPU kernels"):
        EngineSettings(target_weights="int8", cpu_kernels=False)
    with pytest.raises(ValueError, match="target_weights='int8' needs the CPU kernels"):
        use_cpu_kernels([_tiny()], device="cpu", dtype="bfloat16", widths=(1, 5), target_weights="int8")


@pytest.mark.integration
def test_int8_drafts_need_the_cpu_kernels():
    from serving.engine.cpu_kernels import use_cpu_kernels

    with pytest.raises(ValueError, match="draft_weights='int8' needs the CPU kernels"):
        use_cpu_kernels([_tiny()], drafts=[_tiny()], draft_weights="int8", device="cpu", dtype="bfloat16", widths=(1, 5))
    with pytest.raises(ValueError, match="must be one of"):
        use_cpu_kernels([_tiny()], drafts=[_tiny()], draft_weights="int4", device="cpu", dtype="float32", widths=(1, 5))
    with pytest.raises(ValueError, match="weights must be one of"):
        prepare_for_cpu(_tiny(), weights="int4")


@pytest.mark.integration
def test_auto_draft_weights_follow_the_kernels():
    from serving.engine.cpu_kernels import use_cpu_kernels

    draft = _tiny()
    assert not use_cpu_kernels([_tiny()], drafts=[draft], draft_weights="auto", device="cpu", dtype="bfloat16", widths=(1, 5))
    assert not any(isinstance(m, cpu_kernels.Int8Linear) for m in draft.modules())  # no error, left alone
    if cpu_kernels.rowdot_available():
        assert use_cpu_kernels([_tiny()], drafts=[draft], draft_weights="auto", device="cpu", dtype="float32", widths=(1, 5))
        assert isinstance(draft.lm_head, cpu_kernels.Int8Linear)


@pytest.mark.integration
@pytest.mark.skipif(cpu_kernels._rowdot_ext() is None, reason="rowdot kernel cannot be built here")
def test_a_full_batch_of_verify_rows_stays_on_the_kernels():
    """A batch of 4 rows verifying 5 tokens each runs 20 rows through every Linear: the engine's
    kernels must take them all (not fall back to stock kernels past 16 rows), so each sequence's
    logits equal those of the sequence run alone."""
    from serving.engine.cpu_kernels import use_cpu_kernels

    model = _tiny()
    assert use_cpu_kernels([model], device="cpu", dtype="float32", widths=(1, 5))
    linears = [m for m in model.modules() if isinstance(m, InvariantLinear)]
    assert linears and all(m._fast_ok(torch.zeros(4, 5, m.in_features)) for m in linears)  # 20 rows on the kernels
    ids = torch.cat([_ids(5, seed=s) for s in range(4)])  # [4, 5]
    with torch.no_grad():
        together = model(ids).logits  # [4, 5, V]
        alone = torch.cat([model(ids[i : i + 1]).logits for i in range(4)])
    assert torch.equal(together, alone)


# ---- 4-bit target weights (W4A8 on a GGUF's Q4_K groups) ----------------------------------------


def _on_q4_lattice(model: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """Round every Linear's weights onto 4-bit groups of 32 (step and minimum per group), as a
    GGUF Q4_K tensor dequantized to fp32 is; Linears named in ``skip`` stay float (like Q6_K)."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and not any(s in name for s in skip):
                m.weight.copy_(cpu_kernels.snap_to_q4_lattice(m.weight))
    return model


@pytest.mark.unit
@needs_rowdot
# Outputs padded to panels of 16 (40, 19, 11); 4160 inputs: 130 groups.
@pytest.mark.parametrize("in_f,out_f,bias", [(64, 40, False), (96, 19, True), (320, 8, False), (4160, 11, False)])
def test_q4_linear_recovers_the_groups_and_is_the_w4a8_arithmetic(in_f, out_f, bias):
    torch.manual_seed(0)
    lin = _on_q4_lattice(nn.Linear(in_f, out_f, bias=bias))
    lattice = cpu_kernels.q4_lattice(lin.weight)
    assert lattice is not None
    mod = cpu_kernels.Q4Linear(lin, lattice)
    # The groups are recovered, not requantized: the 4-bit weights are the layer's weights, up to
    # the fp16 rounding of each group's step and minimum (2^-11 of each, at most 15 steps + 1 minimum).
    w = lin.weight.detach()
    assert torch.allclose(mod.dequantized(), w, rtol=0, atol=3 * 2**-11 * float(w.abs().max()))
    assert mod.step.dtype == mod.minimum.dtype == torch.float16
    assert mod.qweight.dtype == torch.uint8 and mod.qweight.shape[0] == -(-out_f // cpu_kernels.Q4_PANEL)
    x = torch.randn(40, in_f)  # 40 rows: a prefill on AMX where the CPU has it
    with torch.no_grad():
        got = mod(x)
        xs = x.abs().amax(dim=1) / 127.0  # [M]
        xq = torch.round(x / xs[:, None]).clamp(-127, 127)  # [M, K]
        ref = (xq.double() @ mod.dequantized().double().T * xs[:, None].double()).float()
        ref = ref if lin.bias is None else ref + lin.bias
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
        # Batch-invariant bit for bit, a 40-row prefill included.
        assert all(torch.equal(mod(x[i : i + 1]), got[i : i + 1]) for i in range(40))
        assert all(torch.equal(mod(x[:n]), got[:n]) for n in (2, 5, 9, 33))
        exact = lin(x)
        assert (got - exact).norm() / exact.norm() < 0.03
    # A float layer is not on a 4-bit lattice: it is not taken for one.
    assert cpu_kernels.q4_lattice(nn.Linear(in_f, out_f).weight) is None


@pytest.mark.slow  # builds the kernel twice more (about two minutes)
@pytest.mark.integration
@needs_rowdot
def test_q4_kernel_paths_agree_bit_for_bit():
    """The W4A8 kernel's AVX-512 VNNI, AVX2 and scalar paths do the same float operations in the
    same order, so 4-bit layers give the same bits on every x86 CPU kind: the AVX2 path (built for
    Haswell, no AVX-512) and the scalar path (forced with CHORAL_Q4_PATH=0) match this machine's
    build, at one row, a verify and a prefill, with padded and unpadded widths. On a machine without
    AVX-512 VNNI this machine's build is the AVX2 path, so only the scalar one is built."""
    import hashlib
    import subprocess

    from torch.utils.cpp_extension import load_inline

    probe = subprocess.run(["c++", "-march=haswell", "-x", "c++", "-fsyntax-only", "-"], input="int main() {}",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the C++ compiler does not take -march=haswell: {probe.stderr.strip()[:200]}")
    from concurrent.futures import ThreadPoolExecutor

    from serving.engine.devices import cpu_flags

    source = cpu_kernels.ROWDOT_SOURCE.read_text()
    tag = hashlib.sha256((source + torch.__version__).encode()).hexdigest()[:12]
    variants = {"avx2": ["-march=haswell"], "scalar": ["-march=haswell", "-DCHORAL_Q4_PATH=0"]}
    if not {"avx512_vnni", "avx512bw"} <= cpu_flags():
        del variants["avx2"]  # this machine's own (-march=native) build already is the AVX2 path

    def build(name: str):
        # A build error fails the test: nothing else compiles these paths on a VNNI machine. Both are
        # built for Haswell, so a build cached in a shared home never runs on a CPU it was not made for.
        return load_inline(name=f"choral_rowdot_q4_{name}_{tag}", cpp_sources=source, functions=["rowdot_linear_w4a8"],
                           verbose=False, extra_cflags=["-O3", "-fno-fast-math", "-fopenmp", *variants[name]],
                           extra_ldflags=["-fopenmp"])  # fmt: skip

    with ThreadPoolExecutor(len(variants)) as pool:  # one compiler each, side by side
        builds = dict(zip(variants, pool.map(build, variants)))
    torch.manual_seed(0)
    for in_f, out_f in ((64, 40), (4160, 11), (1568, 70)):  # 1568: an odd number of groups (49)
        lin = _on_q4_lattice(nn.Linear(in_f, out_f))
        mod = cpu_kernels.Q4Linear(lin, cpu_kernels.q4_lattice(lin.weight))
        for rows in (1, 5, 23, 40):  # 40: on AMX in this machine's build, where it has AMX
            x = torch.randn(rows, in_f)
            x[0, :7] = 0.0  # zero inputs and a row's zero padding: +0 contributions, no -0 or NaN
            native = cpu_kernels._rowdot_ext().rowdot_linear_w4a8(x, mod.qweight, mod.step, mod.minimum, out_f, None)
            for name, ext in builds.items():
                got = ext.rowdot_linear_w4a8(x, mod.qweight, mod.step, mod.minimum, out_f, None)
                assert torch.equal(got, native), (name, in_f, rows)


@pytest.mark.unit
def test_q4_lattice_finds_groups_that_skip_levels():
    """Q4_K groups need not use q = 0 or 15, nor neighbouring levels: a group on levels {2, 5, 9}
    has no smallest gap equal to its step. The search still recovers every weight."""
    torch.manual_seed(0)
    d = torch.rand(6, 2, 1) + 0.1  # [N, G, 1] steps
    m = torch.randn(6, 2, 1)
    levels = torch.tensor([2, 5, 9, 13, 15])
    q = levels[torch.randint(0, len(levels), (6, 2, 32))]
    q[:, :, :3] = torch.tensor([2, 5, 9])  # every group holds gaps of 3 and 4 steps, never 1
    w = (q * d + m).reshape(6, 64)
    lattice = cpu_kernels.q4_lattice(w)
    assert lattice is not None
    qq, dd, mm = lattice
    rebuilt = qq.reshape(6, 2, 32).float() * dd[..., None] + mm[..., None]
    assert torch.allclose(rebuilt.reshape(6, 64), w, rtol=0, atol=1e-5)
    # Off the lattice by a third of a step in one group: not a 4-bit tensor.
    w[0, 0] += d[0, 0, 0] / 3
    assert cpu_kernels.q4_lattice(w) is None


@pytest.mark.unit
def test_q4_requantize_rounds_each_group_to_its_nearest_level():
    """A draft's requantized group: its minimum and (max - min) / 15 as stored (fp16), every
    weight on the nearest of the 16 levels, so off by at most half a step (plus the fp16 rounding
    of the minimum and step); a constant group is its minimum exactly. Weights already on a lattice
    come back as they were."""
    torch.manual_seed(0)
    w = torch.randn(5, 96)
    w[1, 32:64] = 0.25  # a constant group
    q, d, m = cpu_kernels.q4_requantize(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (5, 3)
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())
    rebuilt = (q.reshape(5, 3, 32).float() * d[..., None] + m[..., None]).reshape(5, 96)
    err = (rebuilt - w).abs().reshape(5, 3, 32)
    span = w.reshape(5, 3, 32).amax(-1) - w.reshape(5, 3, 32).amin(-1)
    assert (err <= (d / 2 + 2e-3 * span + 1e-6)[..., None]).all()
    assert torch.equal(rebuilt[1, 32:64], torch.full((32,), 0.25))
    on = cpu_kernels.snap_to_q4_lattice(torch.randn(4, 64)).half().float()  # levels an fp16 step and minimum hold
    q2, d2, m2 = cpu_kernels.q4_requantize(on)
    assert torch.allclose((q2.reshape(4, 2, 32).float() * d2[..., None] + m2[..., None]).reshape(4, 64), on, atol=2e-3)
    assert cpu_kernels.q4_requantize(torch.randn(3, 40)) is None  # not whole groups of 32


@pytest.mark.unit
@needs_rowdot
def test_a_q4_head_keeps_its_rows_for_a_reduced_vocabulary():
    """A requantized draft head (Q4Linear) cut to a draft vocabulary (``ModelRunner`` with
    ``config.draft_vocab`` calls ``select_rows``): the kept outputs are the full layer's, bit for
    bit, and its groups come back as stored."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 50, bias=True)
    mod = cpu_kernels.Q4Linear(lin, cpu_kernels.q4_requantize(lin.weight))
    q, d, m = mod.lattice()
    assert q.shape == (50, 96) and d.shape == m.shape == (50, 3)
    assert torch.equal((q.reshape(50, 3, 32).float() * d[..., None] + m[..., None]).reshape(50, 96), mod.dequantized())
    ids = torch.tensor([0, 49, 17, 16, 33])  # across panels of 16, out of order
    x = torch.randn(5, 96)
    with torch.no_grad():
        assert torch.equal(mod.select_rows(ids)(x), mod(x)[:, ids])


@pytest.mark.integration
@needs_rowdot
def test_a_q4_target_gives_its_own_greedy_output_in_any_batch():
    """target_weights=q4: 4-bit tensors run as Q4Linear, the others (here the MLP's down
    projections and the head, as a Q4_K_M file's Q6_K tensors) as int8; speculative output (batch
    of 3, ragged prompts, a q4 draft: draft_weights=q4) equals the q4 target decoding each prompt
    alone. The draft's weights lie on no lattice: draft_weights=q4 rounds every one of its Linears
    into 4-bit groups (q4_requantize), the head included."""
    from serving.engine.core import SpeculativeEngine
    from serving.engine.cpu_kernels import use_cpu_kernels
    from serving.engine.engine_settings import EngineConfig
    from serving.engine.request import Request
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    target, draft = _on_q4_lattice(_tiny(0), skip=("down_proj", "lm_head")), _tiny(1)
    config = EngineConfig(k=4, k_buckets=(2, 4), max_len=64, max_batch_size=3)
    assert use_cpu_kernels([target], drafts=[draft], draft_weights="q4", target_weights="q4", device="cpu",
                           dtype="float32", widths=config.step_widths)  # fmt: skip
    kinds = [type(m).__name__ for m in target.modules() if type(m).__name__ in ("Q4Linear", "Int8Linear")]
    assert kinds.count("Q4Linear") == 2 * 6 and kinds.count("Int8Linear") == 2 + 1
    draft_kinds = [type(m).__name__ for m in draft.modules() if type(m).__name__ in ("Q4Linear", "Int8Linear")]
    assert draft_kinds.count("Q4Linear") == 2 * 7 + 1 and draft_kinds.count("Int8Linear") == 0
    prompts = [[t % 300 for t in _ids(n, seed=n)[0].tolist()] for n in (5, 9, 23)]  # 23: a prefill past max_rows
    alone = SpeculativeEngine(target, tok, None, EngineConfig(k=0, max_len=64))
    ref = [alone.generate([Request(p, max_new_tokens=24)])[0].token_ids for p in prompts]
    out = SpeculativeEngine(target, tok, draft, config).generate([Request(p, max_new_tokens=24) for p in prompts])
    assert [o.token_ids for o in out] == ref


@pytest.mark.integration
@needs_rowdot
@pytest.mark.parametrize("weights", ["q4", "int8"])
def test_a_converted_model_is_cached_once_and_loads_bitwise_the_same(weights, tmp_path, monkeypatch, caplog):
    """int8/q4 conversion is stored (serving.engine.weights_cache) and loaded next time instead of
    converting again, to the same bits. The entry is found by the weights' content, so a model
    changed since it was loaded misses, however it was changed; a damaged entry, or a disk that
    cannot take one, costs only a conversion."""
    from serving.engine import weights_cache
    from serving.engine.models import load_model

    cache_dir = tmp_path / "prepared"
    monkeypatch.setenv("CHORAL_PREPARED_DIR", str(cache_dir))
    folder = tmp_path / "model"
    _on_q4_lattice(_tiny(0), skip=("down_proj", "lm_head")).save_pretrained(folder)
    x = _ids(7)

    def prepared(model=None):
        model = load_model(folder) if model is None else model
        return prepare_for_cpu(model, token_counts=(1, 5), weights=weights)

    def logits(model):
        with torch.no_grad():
            return model(x).logits

    def entries():
        return sorted(cache_dir.glob(f"*-{weights}-*.safetensors"))

    first = prepared()
    assert len(entries()) == 1
    ref = logits(first)

    def refuse(*a, **k):
        raise AssertionError("converted although cached")

    int8_init = cpu_kernels.Int8Linear.__init__

    def int8_from_buffers_only(self, linear):
        if linear is not None:
            refuse()
        int8_init(self, None)

    with monkeypatch.context() as m:  # the second load converts nothing
        m.setattr(cpu_kernels, "q4_lattice", refuse)
        m.setattr(cpu_kernels.Int8Linear, "__init__", int8_from_buffers_only)
        second = prepared()
        # A cache this process may read but not touch (read-only, another user's): still used.
        m.setattr(weights_cache.os, "utime", lambda *a, **k: (_ for _ in ()).throw(PermissionError("read-only")))
        read_only = prepared()
    kinds = lambda mdl: [type(mod).__name__ for mod in mdl.modules()]  # noqa: E731
    assert kinds(second) == kinds(first) and (weights == "int8" or "Q4Linear" in kinds(second))
    assert torch.equal(logits(second), ref) and torch.equal(logits(read_only), ref)

    # Changed after loading, visibly (an in-place op, as an optimizer step): not cached at all.
    changed = load_model(folder)
    with torch.no_grad():
        changed.model.layers[0].mlp.up_proj.weight.mul_(2)
    assert not torch.equal(logits(prepared(changed)), ref) and len(entries()) == 1
    # Changed behind the version counter (through .data, as an in-place peft merge or a fused
    # optimizer does): the content differs, so the entry misses and the model is converted from
    # its own weights (and that conversion becomes an entry of its own).
    sneaky = load_model(folder)
    sneaky.model.layers[0].mlp.up_proj.weight.data.mul_(2)
    assert torch.equal(logits(prepared(sneaky)), logits(changed)) and len(entries()) == 2

    # A damaged entry: a warning, converted again, the same bits, and a sound entry written back.
    original = weights_cache.entry(load_model(folder), weights, [
        (n, mod) for n, mod in load_model(folder).named_modules() if type(mod) is nn.Linear])
    assert original is not None and original.exists()
    original.write_bytes(original.read_bytes()[:100])
    third = prepared()
    assert "could not be read" in caplog.text
    assert torch.equal(logits(third), ref)
    assert weights_cache.load(original, cpu_kernels.stored_layer) is not None
    # A disk that cannot take an entry: a warning, and the model still runs.
    for e in entries():
        e.unlink()
    monkeypatch.setenv("CHORAL_PREPARED_DIR", str(folder / "config.json" / "sub"))  # under a file
    assert torch.equal(logits(prepared()), ref) and "could not write" in caplog.text
    monkeypatch.setenv("CHORAL_PREPARED_DIR", str(cache_dir))
    # Another kind of weights is its own entry; the fp32 kernels store nothing.
    prepared()
    prepare_for_cpu(load_model(folder), token_counts=(1, 5), weights="int8" if weights == "q4" else "q4")
    prepare_for_cpu(load_model(folder), token_counts=(1, 5), weights="fp32")
    assert len(list(cache_dir.glob("*.safetensors"))) == 2


@pytest.mark.integration
@needs_rowdot
def test_the_hugging_face_mlp_path_is_batch_invariant_on_many_threads():
    """A model run through the Hugging Face forward (``lean=False``: what a model the lean forward
    does not cover gets) keeps a 5-token step equal to five 1-token steps with a wide MLP on 16
    threads, where torch's own SiLU rounds an element by where its thread's block ends."""
    torch.set_num_threads(16)  # restored by the _threads fixture
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=18944, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    model = prepare_for_cpu(Qwen2ForCausalLM(cfg).eval(), token_counts=(1, 5), lean=False)
    assert any(isinstance(m, cpu_kernels.RowSiLU) for m in model.modules())
    for seed in range(6):
        prompt, draft = _ids(20, seed=10 + seed), _ids(5, seed=20 + seed)
        with torch.no_grad():
            a, b = DynamicCache(config=model.config), DynamicCache(config=model.config)
            model(prompt, past_key_values=a, use_cache=True)
            model(prompt, past_key_values=b, use_cache=True)
            one_by_one = torch.cat([model(draft[:, i : i + 1], past_key_values=a, use_cache=True).logits
                                    for i in range(5)], dim=1)
            together = model(draft, past_key_values=b, use_cache=True).logits
        assert torch.equal(one_by_one, together), f"seed {seed}"
    act = next(m for m in model.modules() if isinstance(m, cpu_kernels.RowSiLU))
    g = torch.randn(3, 40) * 4
    torch.testing.assert_close(act(g), F.silu(g), rtol=2e-6, atol=1e-6)
    long = torch.randn(1, 40, 8)  # 40 tokens > max_rows: a prefill keeps torch's SiLU, bit for bit
    assert torch.equal(act(long), F.silu(long))


@pytest.mark.unit
def test_the_attention_fallback_gives_each_row_exactly_its_own_keys(monkeypatch):
    """Without the C++ kernel (no compiler), the row-wise attention still takes each sequence's rows
    over its own keys only: a ragged verify batch gives every row what that sequence's one-token
    step alone gives (over the batch's longest extent, a short row's softmax rounds differently)."""
    monkeypatch.setattr(cpu_kernels, "_rowdot_ext", lambda: None)
    torch.manual_seed(0)
    B, H, HKV, T, S, D = 3, 4, 2, 5, 48, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, HKV, S, D), torch.randn(B, HKV, S, D)
    start = [3, 9, 30]  # tokens already in each sequence's cache: 4..8 keys for the first one's rows
    mask = torch.zeros(B, 1, T, S, dtype=torch.bool)
    for b, p in enumerate(start):
        for i in range(T):
            mask[b, 0, i, : p + i + 1] = True
    with torch.no_grad():
        together, _ = cpu_kernels._rowwise_sdpa(None, q, k, v, mask, scaling=0.25)  # [B, T, H, D]
        for b, p in enumerate(start):
            for i in range(T):
                alone, _ = cpu_kernels._rowwise_sdpa(None, q[b : b + 1, :, i : i + 1], k[b : b + 1], v[b : b + 1],
                                                     mask[b : b + 1, :, i : i + 1].clone(), scaling=0.25)  # fmt: skip
                assert torch.equal(together[b : b + 1, i : i + 1], alone), (b, i)
        # A mask broadcast over the batch gives every sequence its rows (the same keys for all).
        shared, _ = cpu_kernels._rowwise_sdpa(None, q, k, v, mask[2:3], scaling=0.25)
        assert shared.shape == together.shape
        for b in range(B):
            own, _ = cpu_kernels._rowwise_sdpa(None, q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[2:3].clone(), scaling=0.25)
            assert torch.equal(shared[b : b + 1], own)


def _kernel_machine() -> str | None:
    """Why this machine cannot build the kernels (None: it can: x86-64 Linux, AVX2 or AVX-512, a C++ compiler)."""
    import platform
    import shutil

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are built for x86-64 Linux; this is {platform.system()} {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the kernels need AVX2 or AVX-512; this CPU is {torch.backends.cpu.get_cpu_capability()}"
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler on PATH"
    return None


@pytest.mark.unit
@pytest.mark.skipif(_kernel_machine() is not None, reason=str(_kernel_machine()))
def test_the_kernels_build_on_every_machine_that_can_build_them():
    """The default precision (q4) runs on these kernels: where they can be built, a build that
    falls back is a broken build, never a reason to skip the tests that need it."""
    assert cpu_kernels.rowdot_available(), "the rowdot kernel failed to build here (see the log's warning)"


@pytest.mark.unit
@pytest.mark.skipif(_kernel_machine() is not None, reason=str(_kernel_machine()))
def test_a_broken_kernel_build_fails_loudly_where_kernels_are_required(tmp_path, monkeypatch):
    """With CHORAL_REQUIRE_KERNELS=1 (CI sets it) a source that does not compile raises with the
    compiler's error instead of falling back (and the tests gated on the kernels then fail to
    collect rather than skip)."""
    broken = tmp_path / "rowdot.cpp"
    broken.write_text(cpu_kernels.ROWDOT_SOURCE.read_text() + "\nthis is not C++;\n")
    monkeypatch.setattr(cpu_kernels, "ROWDOT_SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(cpu_kernels.REQUIRE_KERNELS, "1")
    cpu_kernels._rowdot_ext.cache_clear()
    try:
        with pytest.raises(cpu_kernels.KernelBuildError, match=r"rowdot.cpp\) failed and CHORAL_REQUIRE_KERNELS=1: .*Error building"):
            cpu_kernels._rowdot_ext()
        monkeypatch.delenv(cpu_kernels.REQUIRE_KERNELS)
        assert cpu_kernels._rowdot_ext.__wrapped__() is None  # without it: the fallback, with a warning
    finally:
        cpu_kernels._rowdot_ext.cache_clear()


@pytest.mark.unit
def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """A process killed while building leaves torch's lock file, on which every later build waited
    forever: one older than STALE_LOCK_S is removed, a fresh one (a build under way) is not."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    assert not cpu_kernels.clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - cpu_kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert cpu_kernels.clear_stale_lock(tmp_path) and not lock.exists()
    assert not cpu_kernels.clear_stale_lock(tmp_path)  # no lock: nothing to do

"""Deriving layer-subset students from a tiny Qwen2: exact copies, layer choice, saving, errors."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from training.students import count_parameters, derive_student, describe_student, frequent_tokens, reduce_vocab


def tiny(seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    kwargs.update(overrides)
    return Qwen2ForCausalLM(Qwen2Config(**kwargs)).eval()


@pytest.fixture(scope="module")
def source() -> Qwen2ForCausalLM:
    return tiny()


def ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.integration
def test_all_layers_reproduce_the_logits_exactly(source):
    student = derive_student(source, [0, 1, 2, 3])
    assert not student.training
    with torch.no_grad():
        assert torch.equal(student(ids()).logits, source(ids()).logits)


@pytest.mark.integration
def test_subset_copies_the_chosen_layers_in_order(source):
    student = derive_student(source, [2, 0, -1])
    assert student.config.num_hidden_layers == 3 and len(student.model.layers) == 3
    assert len(student.config.layer_types) == 3
    for dst, src in enumerate([2, 0, 3]):
        got, want = student.model.layers[dst].state_dict(), source.model.layers[src].state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(student.get_parameter(name), source.get_parameter(name))
    # A copy, not a view: training the student leaves the source alone.
    with torch.no_grad():
        student.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert not torch.equal(student.model.layers[0].mlp.up_proj.weight, source.model.layers[2].mlp.up_proj.weight)
    assert student.model.embed_tokens.weight.data_ptr() != source.model.embed_tokens.weight.data_ptr()
    assert all(p.requires_grad for p in student.parameters())


@pytest.mark.integration
def test_tied_embeddings_stay_tied():
    source = tiny(seed=1, tie_word_embeddings=True)
    student = derive_student(source, [0, -1])
    assert student.lm_head.weight is student.model.embed_tokens.weight
    assert torch.equal(student.lm_head.weight, source.lm_head.weight)
    assert count_parameters(student) < count_parameters(derive_student(tiny(seed=1), [0, -1]))


@pytest.mark.integration
def test_sliding_window_layer_types_follow_their_layers():
    source = tiny(use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert source.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    student = derive_student(source, [0, 3])
    assert student.config.layer_types == ["full_attention", "sliding_attention"]
    assert student.config.max_window_layers == 1


@pytest.mark.integration
def test_dtype_is_kept():
    student = derive_student(tiny().to(torch.bfloat16), [1])
    assert student.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in student.parameters())


@pytest.mark.integration
def test_saves_and_reloads_with_auto_class(source, tmp_path):
    student = derive_student(source, [0, -1])
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is Qwen2ForCausalLM
    assert reloaded.config.num_hidden_layers == 2
    with torch.no_grad():
        assert torch.equal(reloaded(ids()).logits, student(ids()).logits)


@pytest.mark.integration
def test_describe_and_count(source):
    student = derive_student(source, [0])
    info = describe_student(student)
    assert info["layers"] == 1 and info["hidden_size"] == 64 and info["vocab_size"] == 384
    assert info["params"] == count_parameters(student) == sum(p.numel() for p in student.parameters())
    per_layer = sum(p.numel() for p in source.model.layers[0].parameters())
    assert count_parameters(source) - info["params"] == 3 * per_layer


@pytest.mark.integration
@pytest.mark.parametrize("layers, message", [([0, 4], r"layer index 4 .*4-layer.*-4\.\.3"), ([-5], r"layer index -5"), ([], "at least one")])
def test_bad_layer_index(source, layers, message):
    with pytest.raises(ValueError, match=message):
        derive_student(source, layers)


@pytest.mark.unit
def test_frequent_tokens_counts_ignores_padding_and_keeps_always():
    rows = torch.tensor([[5, 5, 5, 7, -100], [7, 9, 5, -100, -100]])
    assert frequent_tokens(rows, 1) == [5]
    assert frequent_tokens(rows, 2) == [5, 7]
    assert frequent_tokens(rows, 2, always=[2]) == [2, 5, 7]


@pytest.mark.integration
def test_reduced_vocab_draft_stays_lossless_and_reloads(tiny_target, tiny_draft, tokenizer, tmp_path):
    from serving.engine import EngineConfig, Request, SpeculativeEngine
    from serving.engine.runner import ModelRunner
    from tests.test_engine_tiny import hf_greedy, ragged_prompts

    draft = reduce_vocab(copy.deepcopy(tiny_draft), list(range(0, 384, 3)))
    draft.save_pretrained(tmp_path)
    reloaded = type(draft).from_pretrained(tmp_path)
    assert reloaded.config.draft_vocab == list(range(0, 384, 3))
    runner = ModelRunner(reloaded, batch_size=1, max_len=16)
    logits = runner.forward(torch.tensor([[4, 5]]), torch.tensor([[0, 1]]))  # [1, 2, V]
    kept = torch.zeros(384, dtype=torch.bool)
    kept[::3] = True
    assert torch.isinf(logits[..., ~kept]).all() and torch.isfinite(logits[..., kept]).all()
    full = ModelRunner(tiny_draft, batch_size=1, max_len=16).forward(torch.tensor([[4, 5]]), torch.tensor([[0, 1]]))
    torch.testing.assert_close(logits[..., kept], full[..., kept])  # the kept rows are the same head rows
    # With Choral's CPU kernels the reduced head is batch-invariant like every other layer.
    from serving.engine.cpu_kernels import InvariantLinear, prepare_for_cpu

    fast = ModelRunner(prepare_for_cpu(copy.deepcopy(reloaded), token_counts=(1, 2)), batch_size=2, max_len=16)
    assert isinstance(fast.kept_head, InvariantLinear)
    both = fast.forward(torch.tensor([[4, 5], [6, 7]]), torch.tensor([[0, 1], [0, 1]]))  # [2, 2, V]
    fast_one = ModelRunner(fast.model, batch_size=1, max_len=16).forward(torch.tensor([[4, 5]]), torch.tensor([[0, 1]]))
    assert torch.equal(both[:1], fast_one)
    # As an int8 draft the reduced head is an int8 layer too, still -inf outside the kept rows.
    from serving.engine import cpu_kernels

    if cpu_kernels.rowdot_available():
        small = ModelRunner(prepare_for_cpu(copy.deepcopy(reloaded), token_counts=(1, 2), weights="int8"), batch_size=1, max_len=16)
        assert isinstance(small.kept_head, cpu_kernels.Int8Linear) and small.kept_head.out_features == kept.sum()
        q = small.forward(torch.tensor([[4, 5]]), torch.tensor([[0, 1]]))
        assert torch.isinf(q[..., ~kept]).all() and torch.isfinite(q[..., kept]).all()
        torch.testing.assert_close(q[..., kept], logits[..., kept], atol=0.05, rtol=0.05)

    prompts = ragged_prompts(4, seed=5)
    engine = SpeculativeEngine(tiny_target, tokenizer, reloaded, EngineConfig(max_batch_size=2, max_len=96, k=4))
    outs = engine.generate([Request(p, max_new_tokens=16) for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 16)
    assert outs[0].stats["drafted"] > 0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        reduce_vocab(copy.deepcopy(tiny_draft), [0, 384])


@pytest.mark.integration
def test_kept_head_evaluates_as_a_compact_head_with_the_trained_rows(tiny_draft):
    """train-draft evaluates a KeptHead student through ``eval_model``: its compact head (the
    kept rows only, shared with training, no copy) must give the logits the saved, merged draft
    gives, so evaluation measures the draft that is saved."""
    from serving.engine.runner import ModelRunner
    from training.students import eval_model, keep_head_rows, plain_model

    student = reduce_vocab(copy.deepcopy(tiny_draft), list(range(1, 384, 5)))
    head = keep_head_rows(student)
    with torch.no_grad():
        head.weight.add_(0.25)  # "trained": the kept rows now differ from the full head's
    compact = eval_model(student)
    assert compact.get_output_embeddings().weight is head.weight  # shared, not copied
    assert student.get_output_embeddings() is head  # the trained model keeps its KeptHead
    tokens, positions = torch.tensor([[4, 5, 6]]), torch.tensor([[0, 1, 2]])
    got = ModelRunner(compact, batch_size=1, max_len=16, vocab_size=384).forward(tokens, positions)  # [1, 3, V]
    want = ModelRunner(plain_model(student), batch_size=1, max_len=16, vocab_size=384).forward(tokens, positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(got[..., 1::5]).all() and torch.isinf(got[..., 0::5]).all()

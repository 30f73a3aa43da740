"""Tier 3: tiny random Qwen2 target and draft end to end against transformers' own greedy generate."""

import pytest
import torch

from serving.engine import EngineConfig, Request, SpeculativeEngine
from serving.engine.models import check_same_tokenizer
from serving.engine.sampling import SamplingParams
from tests.conftest import make_tokenizer, perturbed

pytestmark = pytest.mark.integration

EOS = 2


def hf_greedy(model, prompt, max_new):
    out = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def ragged_prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g).tolist()
    return [torch.randint(3, 384, (length,), generator=g).tolist() for length in lengths]


@pytest.mark.parametrize("k", [1, 2, 4, 7, "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identical_to_transformers_generate(tiny_target, tiny_draft, tokenizer, k, batch):
    prompts = ragged_prompts(5, seed=batch * 10 + (k if k != "auto" else 0))
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=batch, max_len=96, k=k))
    outs = engine.generate([Request(p, max_new_tokens=24) for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 24)
    stats = outs[0].stats
    assert stats["drafted"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    assert stats["target_calls"] < stats["new_tokens"]  # the draft did save target calls


def test_draft_confidence_stop_keeps_greedy_identical(tiny_target, tiny_draft, tokenizer):
    # The random tiny draft is never 30% sure of anything: every step drafts one token only.
    prompts = ragged_prompts(4, seed=21)
    config = EngineConfig(max_batch_size=2, max_len=96, k=6, draft_confidence=0.3)
    outs = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, config).generate([Request(p, max_new_tokens=20) for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 20)
    assert all(o.stats["mean_k"] == 1.0 for o in outs)


def test_eos_inside_accepted_block(tiny_target, tokenizer):
    # A draft identical to the target accepts everything, so EOS arrives mid-block. Make EOS the
    # token the target itself emits 5th, then the row must stop right there.
    prompt = [5, 17, 33]
    free = hf_greedy(tiny_target, prompt, 12)
    eos = free[4]
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_target, EngineConfig(max_len=64, k=8))
    engine.state.eos_ids = torch.tensor([eos])
    engine._eos = {eos}
    [out] = engine.generate([Request(prompt, max_new_tokens=12)])
    assert out.token_ids == free[: free.index(eos) + 1] and out.finish_reason == "stop"
    assert out.stats["target_calls"] == 1  # one verification produced all of it


def test_target_only_path_matches(tiny_target, tokenizer):
    engine = SpeculativeEngine(tiny_target, tokenizer, None, EngineConfig(max_batch_size=2, max_len=64))
    prompts = ragged_prompts(3, seed=5)
    outs = engine.generate([Request(p, max_new_tokens=16) for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 16)
        assert out.stats["target_calls"] == len(out.token_ids) - 1 and out.stats["drafted"] == 0


def test_batch_rows_equal_their_batch_of_one_runs_when_sampling(tiny_target, tiny_draft, tokenizer):
    # Each request draws from its own seeded generator, so batching does not change sampled output.
    prompts = ragged_prompts(4, seed=9)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
    reqs = [Request(p, params=s, max_new_tokens=16) for p, s in zip(prompts, params)]
    batched = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=4, max_len=64, k=3))
    single = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=1, max_len=64, k=3))
    assert [o.token_ids for o in batched.generate(reqs)] == [o.token_ids for o in single.generate(reqs)]


def test_stop_string_cuts_text(tiny_target, tokenizer):
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_target, EngineConfig(max_len=64, k=4))
    prompt = tokenizer.encode("def add(a, b):")
    [free] = engine.generate([Request(prompt, max_new_tokens=20)])
    stop = free.text[5:8]
    assert stop, "the tiny model produced too little text for this test"
    [out] = engine.generate([Request(prompt, max_new_tokens=20, stop=(stop,))])
    assert out.finish_reason == "stop" and stop not in out.text and free.text.startswith(out.text)
    assert len(out.token_ids) <= len(free.token_ids)


def test_prompt_longer_than_context_is_a_clear_error(tiny_target, tokenizer):
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_target, EngineConfig(max_len=32, k=4))
    with pytest.raises(ValueError, match=r"prompt of 30 tokens.*exceeds the context max_len=32"):
        engine.generate([Request(list(range(3, 33)), max_new_tokens=4)])


def test_draft_with_padded_vocabulary_works(tiny_target, tokenizer):
    # Qwen sizes pad their embedding matrices differently; only the tokenizer has to agree.
    from tests.conftest import tiny_qwen2

    draft = tiny_qwen2(3, layers=1, vocab_size=448)
    engine = SpeculativeEngine(tiny_target, tokenizer, draft, EngineConfig(max_len=64, k=3))
    prompt = [4, 9, 16]
    [out] = engine.generate([Request(prompt, max_new_tokens=10)])
    assert out.token_ids == hf_greedy(tiny_target, prompt, 10)


def test_draft_with_a_different_tokenizer_is_refused(tokenizer):
    other = make_tokenizer(vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        check_same_tokenizer(tokenizer, other, draft_name="my-draft")
    check_same_tokenizer(tokenizer, make_tokenizer())  # an identical one passes


def test_incremental_api_streams_the_same_tokens_and_abort_frees_the_slot(tiny_target, tiny_draft, tokenizer):
    prompts = ragged_prompts(4, seed=77)
    config = EngineConfig(max_batch_size=2, max_len=96, k=3)
    expected = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, config).generate(
        [Request(p, max_new_tokens=20) for p in prompts]
    )
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=2, max_len=96, k=3))
    ids = [engine.add_request(Request(p, max_new_tokens=20)) for p in prompts]
    doomed = engine.add_request(Request(prompts[0], max_new_tokens=20))
    streamed = {i: [] for i in ids}
    finished = {}
    first = engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 3
    assert engine.abort_request(ids[1]) and not engine.abort_request(ids[1])  # frees slot 1 for the next
    del streamed[ids[1]]
    assert engine.abort_request(doomed)
    for out in first + [o for _ in range(200) if engine.has_unfinished_requests() for o in engine.step()]:
        if out.request_id in streamed:
            streamed[out.request_id] += out.new_token_ids
        if out.finished is not None:
            finished[out.request_id] = out.finished
    assert not engine.has_unfinished_requests() and engine.num_running == 0
    assert set(finished) == {ids[0], ids[2], ids[3]}
    for i, exp in zip(ids, expected):
        if i in finished:
            assert streamed[i] == finished[i].token_ids == exp.token_ids


def stream(engine, request):
    """The request's tokens as ``step`` hands them out (what a server streams), and its Completion."""
    rid, streamed, done = engine.add_request(request), [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                streamed += out.new_token_ids
                done = out.finished or done
    return streamed, done


def first_completing_stop(tokenizer, tokens, j):
    """A stop string that first appears in the text once token j-1 (0-based) is decoded, or None."""
    before, text = tokenizer.decode(tokens[: j - 1]), tokenizer.decode(tokens[:j])
    for m in range(1, len(text) + 1):
        if text[-m:] not in before and text.startswith(before):
            return text[-m:]
    return None


@pytest.mark.parametrize("extra", [0, 2, 20], ids=["limit-at-stop", "limit-in-same-step", "limit-far"])
def test_stop_string_at_every_position_of_an_accepted_block(tiny_target, tokenizer, extra):
    """The draft is the target, so whole K+1 blocks commit in one step; a stop string completed by
    any token of a block, whatever max_new_tokens is beyond it, gives the tokens up to and
    including that token, the text before the stop, finish_reason "stop", streamed and not."""
    config = EngineConfig(max_len=96, k=4)
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_target, config)
    prompt = tokenizer.encode("def add(a, b):")
    [free] = engine.generate([Request(prompt, max_new_tokens=16)])
    assert free.stats["mean_accepted_length"] > 3, "the blocks must be long for this test to mean anything"
    checked = 0
    for j in range(1, len(free.token_ids)):
        stop = first_completing_stop(tokenizer, free.token_ids, j)
        if stop is None or free.token_ids[j - 1] == EOS:
            continue
        request = Request(prompt, max_new_tokens=j + extra, stop=(stop,))
        [out] = engine.generate([request])
        streamed, done = stream(engine, request)
        expected_text = tokenizer.decode(free.token_ids[:j])
        for tokens, completion in ((out.token_ids, out), (streamed, done)):
            assert tokens == free.token_ids[:j], f"stop {stop!r} completed by token {j}, max_new_tokens={j + extra}"
            assert completion.finish_reason == "stop" and completion.text == expected_text[: expected_text.find(stop)]
        checked += 1
    assert checked >= 8


def test_seeded_sampling_does_not_depend_on_the_batch_with_k_auto(tiny_target, tiny_draft, tokenizer):
    """Each request moves its own K, and draws its uniforms by its own K, so other requests in the
    batch change nothing of a seeded one. The seeded request runs cool (the draft often misses, its
    K falls) beside one so hot that p and q are both near uniform (it accepts almost everything and
    its K climbs to the top bucket): a batch-wide K would hand the seeded row the larger K."""
    config = dict(max_len=96, k="auto", k_buckets=(1, 2, 4, 6))
    hot = Request([12], SamplingParams(temperature=8.0, seed=99), max_new_tokens=40)
    others = [Request([7, 8, 9, 10, 11], max_new_tokens=20), Request([40, 41, 42], SamplingParams(temperature=0.6, top_k=5),
              max_new_tokens=12)]  # fmt: skip
    alone_engine = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=1, **config))
    batch_engine = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=4, **config))
    for seed in range(10):
        mine = Request([5, 6, 7], SamplingParams(temperature=0.5, seed=seed), max_new_tokens=16)
        [alone] = alone_engine.generate([mine])
        together = batch_engine.generate([hot, mine, *others[: seed % 3]])
        assert together[1].token_ids == alone.token_ids, f"seed {seed}"
        assert together[0].stats["mean_k"] > alone.stats["mean_k"], "the hot row must run a larger K than the seeded one"


def test_threshold_rows_change_only_themselves_and_exact_rows_stay_the_targets(tiny_target, tiny_draft, tokenizer):
    """Threshold verification (opt-in, lossy) beside exact rows: every exact row, even one that
    carries a threshold value, is still token for token the target's greedy output; the threshold
    rows accept more and say they are not exact. A random tiny target spreads its probability over
    the vocabulary, so a threshold of 0.001 accepts drafts its argmax would not."""
    prompts = ragged_prompts(4, seed=5)
    exact = SamplingParams(verification_threshold=0.001)  # exact: the threshold value is unused
    lossy = SamplingParams(verification="threshold", verification_threshold=0.001)
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=4, max_len=96, k=4))
    outs = engine.generate([Request(p, params, max_new_tokens=20) for p, params in zip(prompts, [exact, lossy] * 2)])
    for prompt, out in zip(prompts[::2], outs[::2]):
        assert out.token_ids == hf_greedy(tiny_target, prompt, 20)
        assert out.stats["exact"] and out.stats["verification"] == "exact"
    for prompt, out in zip(prompts[1::2], outs[1::2]):
        assert not out.stats["exact"] and out.stats["verification"] == "threshold"
    assert any(out.token_ids != hf_greedy(tiny_target, p, 20) for p, out in zip(prompts[1::2], outs[1::2]))
    assert sum(o.stats["accepted"] for o in outs[1::2]) > sum(o.stats["accepted"] for o in outs[::2])


def test_token_origins_follow_each_step(tiny_target, tiny_draft, tokenizer):
    """Every generated token has an origin: the first is the target's, accepted drafts name the
    drafter, each step ends with a correction or a bonus; the stream's origins are the final ones."""
    engine = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=1, max_len=96, k=3))
    rid = engine.add_request(Request(ragged_prompts(1, seed=9)[0], max_new_tokens=24))
    streamed, origins, done = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_token_ids
            origins += out.new_token_origins
            done = out.finished or done
    assert rid == 0 and streamed == done.token_ids and origins == done.origins
    kinds = [o.origin for o in origins]
    assert kinds[0] == "target" and len(origins) == len(done.token_ids)
    assert {o.drafter for o in origins if o.origin == "draft"} == {"draft"}
    assert kinds.count("draft") == done.stats["accepted"]
    assert kinds.count("correction") + kinds.count("bonus") >= done.stats["target_calls"] - 1  # the last may be cut
    assert "draft" in kinds and "correction" in kinds

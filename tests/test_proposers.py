"""Tier 1: the model-free draft proposers (prompt lookup, suffix decoding) on hand-made token lists."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from serving.engine.drafters.ngram import NgramIndex, propose_ngram
from serving.engine.drafters.suffix import SuffixCache

pytestmark = pytest.mark.unit


# -- prompt lookup ---------------------------------------------------------------------------------------


def test_ngram_copies_the_continuation_of_a_repeated_span():
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert propose_ngram(ctx, 3) == [8, 9, 1]
    assert propose_ngram(np.array(ctx), 3) == [8, 9, 1]  # numpy input, same answer


def test_ngram_prefers_the_longest_matching_n():
    # Last token 3 first occurs at index 0 (then 9); the 3-gram 1 2 3 occurs at 3..5 (then 7).
    ctx = [3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3]
    assert propose_ngram(ctx, 2, max_n=3) == [7, 7]
    assert propose_ngram(ctx, 2, max_n=1) == [9, 9]


def test_ngram_earliest_occurrence_by_default_latest_on_request():
    ctx = [1, 2, 8, 1, 2, 9, 1, 2]
    assert propose_ngram(ctx, 1) == [8]  # vLLM's choice
    assert propose_ngram(ctx, 1, match="latest") == [9]


def test_ngram_returns_empty_without_a_match():
    assert propose_ngram([1, 2, 3, 4], 5) == []
    assert propose_ngram([], 5) == []
    assert propose_ngram([7], 5) == []
    # 2 5 never occurred before, only 5 did: allowed with min_n=1, refused with min_n=2.
    assert propose_ngram([1, 5, 2, 5], 2, min_n=1) == [2, 5]
    assert propose_ngram([1, 5, 2, 5], 2, min_n=2) == []


def test_ngram_respects_k_and_the_context_end():
    ctx = [1, 2, 3, 4, 1]
    assert propose_ngram(ctx, 2) == [2, 3]
    assert propose_ngram(ctx, 10) == [2, 3, 4, 1]
    assert propose_ngram(ctx, 0) == []
    # An occurrence may overlap the trailing pattern; what follows it stops at the context end.
    assert propose_ngram([5, 5, 5], 4, max_n=2) == [5]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"k": -1}, "k=-1"), ({"k": 2, "min_n": 0}, "min_n=0"), ({"k": 2, "min_n": 3, "max_n": 2}, "max_n=2"),
     ({"k": 2, "match": "first"}, "'first'")],
)
def test_ngram_argument_errors_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        propose_ngram([1, 2, 1], **kwargs)


def naive_ngram(ctx, k, min_n, max_n, match):
    """The definition, literally: longest n first, then the first or last earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        starts = [i for i in range(len(ctx) - n) if ctx[i:i + n] == ctx[len(ctx) - n:]]
        if starts:
            i = starts[0] if match == "earliest" else starts[-1]
            return ctx[i + n:i + n + k]
    return []


@pytest.mark.parametrize("match", ["earliest", "latest"])
def test_ngram_agrees_with_the_naive_definition(match):
    rng = random.Random(2)
    for _ in range(300):
        ctx = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        min_n = rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 3)
        k = rng.randrange(0, 6)
        assert propose_ngram(ctx, k, min_n, max_n, match=match) == naive_ngram(ctx, k, min_n, max_n, match), ctx


@pytest.mark.parametrize("match", ["earliest", "latest"])
def test_ngram_index_agrees_with_the_function_at_every_step(match):
    rng = random.Random(0)
    for trial in range(20):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 3)])
        ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(ctx[:1], min_n=min_n, max_n=max_n, match=match)
        for end in range(1, len(ctx) + 1):
            if end > 1:
                index.extend(ctx[end - 1:end])
            k = rng.randrange(0, 6)
            assert index.propose(k) == propose_ngram(ctx[:end], k, min_n, max_n, match=match), (trial, end)


def test_ngram_index_argument_errors():
    with pytest.raises(ValueError, match="max_n=1"):
        NgramIndex(min_n=2, max_n=1)
    with pytest.raises(ValueError, match="k=-3"):
        NgramIndex([1, 2, 1]).propose(-3)


# -- suffix decoding -------------------------------------------------------------------------------------


def trie_counts(trie) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every node's (count, total) by root path, after checking that total is the sum of the children's counts."""
    snap = trie.snapshot()
    children_sum: Counter = Counter()
    for path, (count, _) in snap.items():
        assert count > 0, path  # emptied nodes are removed
        children_sum[path[:-1]] += count
    for path, (_, total) in snap.items():
        assert total == children_sum[path], path
    assert len(trie) == len(snap) + 1  # no leaked nodes (+1: the root)
    if trie.links:  # the sibling lists hold exactly the live children
        by_parent: dict[int, set[int]] = {}
        for key, child in trie.edges.items():
            by_parent.setdefault(key >> 31, set()).add(child)
        for parent in set(by_parent) | {0}:
            listed, child = [], trie.first[parent]
            while child >= 0:
                listed.append(child)
                child = trie.nxt[child]
            assert len(listed) == len(set(listed)) and set(listed) == by_parent.get(parent, set()), parent
    return snap


def brute_counts(seqs, depth) -> dict[tuple[int, ...], tuple[int, int]]:
    """Occurrences of every substring of <= depth tokens, and of those followed by a token within depth."""
    count: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                count[tuple(seq[i:j])] += 1
    total: Counter = Counter()
    for s, c in count.items():
        if len(s) > 1:
            total[s[:-1]] += c
    return {s: (c, total[s]) for s, c in count.items()}


def test_suffix_proposes_the_continuation_of_a_repeated_prompt_span():
    cache = SuffixCache()
    cache.start_request("a", [1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    # Match 1 2 3 (3 tokens), so max_spec_factor=1 allows 3 tokens.
    assert cache.propose("a", 8) == ([4, 5, 9], [1.0, 1.0, 1.0])
    assert cache.propose("a", 2) == ([4, 5], [1.0, 1.0])
    assert cache.propose("a", 0) == ([], [])


def test_suffix_learns_from_generated_tokens():
    cache = SuffixCache()
    cache.start_request("a", [10, 11, 12])
    assert cache.propose("a", 4) == ([], [])
    cache.add_tokens("a", [7, 8, 9, 7, 8])
    assert cache.propose("a", 4) == ([9, 7], [1.0, 1.0])


def test_suffix_global_cache_reuses_a_finished_output():
    cache = SuffixCache()
    cache.start_request("a", [100, 101])
    cache.add_tokens("a", [1, 2, 3, 4, 5, 6])
    cache.start_request("b", [50, 1, 2, 3])
    assert cache.propose("b", 4) == ([], [])  # a is still running: its output is not shared yet
    cache.stop_request("a")
    assert cache.cached_requests == ["a"] and cache.active_requests == ["b"]
    assert cache.propose("b", 4) == ([4, 5, 6], [1.0, 1.0, 1.0])


def test_suffix_private_request_neither_reads_nor_feeds_the_global_cache():
    cache = SuffixCache()
    _finish(cache, "a", [1, 2, 3, 4])
    cache.start_request("p", [50, 1, 2], private=True)
    assert cache.propose("p", 2) == ([], [])  # a's output would give [3, 4]
    cache.add_tokens("p", [5, 6, 7])
    cache.stop_request("p")
    assert cache.cached_requests == ["a"]
    cache.start_request("q", [9, 5, 6])
    assert cache.propose("q", 2) == ([], [])  # p's output would give [7]


def test_suffix_global_cache_excludes_the_prompt_and_can_be_disabled():
    for max_cached, expect in ((1, []), (0, [])):
        cache = SuffixCache(max_cached_requests=max_cached)
        cache.start_request("a", [1, 2, 3, 4])  # prompt only: nothing generated
        cache.stop_request("a")
        cache.start_request("b", [9, 1, 2])
        assert cache.propose("b", 4)[0] == expect
    cache = SuffixCache(max_cached_requests=0)
    cache.start_request("a", [0])
    cache.add_tokens("a", [1, 2, 3, 4])
    cache.stop_request("a")
    cache.start_request("b", [9, 1, 2])
    assert cache.propose("b", 4) == ([], []) and cache.cached_requests == []


def _finish(cache, req_id, output):
    cache.start_request(req_id, [1000])
    cache.add_tokens(req_id, output)
    cache.stop_request(req_id)


@pytest.mark.parametrize(("max_cached", "expect"), [(2, [3, 4]), (1, [])])
def test_suffix_eviction_removes_the_oldest_output(max_cached, expect):
    cache = SuffixCache(max_cached_requests=max_cached)
    _finish(cache, "a", [1, 2, 3, 4, 5])
    _finish(cache, "b", [30, 31, 32])
    cache.start_request("c", [0, 1, 2])
    assert cache.propose("c", 4)[0] == expect
    assert cache.cached_requests == ["a", "b"][-max_cached:]


def test_suffix_eviction_decrements_shared_counts():
    # a and b share 1 2 3; evicting a must leave b's 9 as the only continuation, with probability 1.
    kept = SuffixCache(max_cached_requests=2)
    evicted = SuffixCache(max_cached_requests=1)
    for cache in (kept, evicted):
        _finish(cache, "a", [1, 2, 3, 4])
        _finish(cache, "b", [1, 2, 3, 9])
        cache.start_request("c", [7, 1, 2, 3])
    assert kept.propose("c", 1) == ([9], [0.5])  # 4 and 9 once each: the most recent (9) wins the tie
    assert evicted.propose("c", 1) == ([9], [1.0])
    assert trie_counts(evicted._global) == brute_counts([[1, 2, 3, 9]], evicted.max_depth)


def test_suffix_eviction_can_change_the_most_frequent_continuation():
    # With a and b cached, 1 2 -> 3 three times, 4 twice; evicting a leaves 3 once, 4 twice.
    cache = SuffixCache(max_cached_requests=2)
    _finish(cache, "a", [1, 2, 3, 8, 1, 2, 3])
    _finish(cache, "b", [1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 3])
    cache.start_request("q", [7, 1, 2])
    assert cache.propose("q", 1) == ([3], [pytest.approx(3 / 5)])
    _finish(cache, "c", [50, 51])  # evicts a
    assert cache.propose("q", 1) == ([4], [pytest.approx(2 / 3)])


def test_suffix_tie_break_after_eviction_is_the_most_recent():
    # After a is evicted, 3 and 4 follow 1 2 twice each; 3 was seen last (4 was created last).
    cache = SuffixCache(max_cached_requests=2)
    _finish(cache, "a", [1, 2, 5, 1, 2, 5, 1, 2, 5])
    _finish(cache, "b", [1, 2, 3, 8, 1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 3])
    _finish(cache, "c", [50])
    cache.start_request("q", [7, 1, 2])
    assert cache.propose("q", 1) == ([3], [0.5])


def test_suffix_picks_the_higher_scoring_source_own_on_ties():
    cache = SuffixCache()
    _finish(cache, "g", [1, 2, 9])
    cache.start_request("ambiguous", [1, 2, 3, 7, 1, 2, 4, 8, 1, 2])  # own: 4 at 1/2; global: 9 at 1
    assert cache.propose("ambiguous", 1) == ([9], [1.0])
    cache.start_request("sure", [1, 2, 3, 8, 1, 2])  # own: 3 at 1, global: 9 at 1: the tie goes to own
    assert cache.propose("sure", 1) == ([3], [1.0])


def test_suffix_tries_match_brute_force_counts_through_evictions():
    rng = random.Random(1)
    depth = 5
    cache = SuffixCache(max_depth=depth, max_cached_requests=3)
    outputs = []
    for r in range(12):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 15))]
        cache.start_request(r, prompt)
        out = []
        for _ in range(rng.randrange(0, 4)):
            step = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            cache.add_tokens(r, step)
            out += step
        assert trie_counts(cache._requests[r].trie) == brute_counts([prompt + out], depth)
        cache.propose(r, 3)  # resolves stale best-child pointers along the way
        cache.stop_request(r)
        if out:
            outputs.append(out)
        assert trie_counts(cache._global) == brute_counts(outputs[-3:], depth)


def test_suffix_min_token_prob_stops_at_an_ambiguous_branch():
    # 5 7 8 9 is followed by 1, 2 and 3 once each: the 4th token has probability 1/3.
    prompt = [5, 7, 8, 9, 1, 5, 7, 8, 9, 2, 5, 7, 8, 9, 3, 5, 7]
    strict = SuffixCache(min_token_prob=0.5, max_spec_factor=4.0)
    loose = SuffixCache(min_token_prob=0.3, max_spec_factor=4.0)
    for cache in (strict, loose):
        cache.start_request("a", prompt)
    assert strict.propose("a", 8) == ([8, 9], [1.0, 1.0])
    tokens, conf = loose.propose("a", 8)
    assert tokens == [8, 9, 3, 5, 7]
    assert conf == pytest.approx([1.0, 1.0, 1 / 3, 1 / 3, 1 / 3])


def test_suffix_confidences_are_empirical_frequencies():
    # After 1 2: 3 twice, 4 once (the trailing 1 2 has no continuation yet and is not counted).
    cache = SuffixCache()
    cache.start_request("a", [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    tokens, conf = cache.propose("a", 2)
    assert tokens == [3, 1]
    assert conf == pytest.approx([2 / 3, 2 / 3])  # 1 2 3 is always followed by 1: the product stays 2/3


def test_suffix_max_spec_factor_bounds_by_match_length():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert SuffixCache(max_spec_factor=1.0)._budget(2, 8) == 2
    for factor, n in ((1.0, 2), (2.0, 4), (0.5, 1)):
        cache = SuffixCache(max_spec_factor=factor)
        cache.start_request("a", prompt)
        assert cache.propose("a", 8)[0] == [3, 4, 5, 6][:n]


def test_suffix_tie_break_is_the_most_recent_and_deterministic():
    for prompt, first in (([1, 2, 3, 7, 1, 2, 4, 8, 1, 2], 4), ([1, 2, 4, 7, 1, 2, 3, 8, 1, 2], 3)):
        results = set()
        for _ in range(3):
            cache = SuffixCache()
            cache.start_request("a", prompt)
            tokens, conf = cache.propose("a", 1)
            results.add((tuple(tokens), tuple(conf)))
        assert results == {((first,), (0.5,))}


def test_suffix_prefers_the_longest_match():
    # 2 3 is mostly followed by 7, but the longer 9 1 2 3 was followed by 5 6: the specific context wins.
    cache = SuffixCache()
    cache.start_request("a", [2, 3, 7, 2, 3, 7, 9, 1, 2, 3, 5, 6, 0, 9, 1, 2, 3])
    assert cache.propose("a", 2) == ([5, 6], [1.0, 1.0])


def test_suffix_depth_limits_match_plus_proposal():
    # A 6-token match in a depth-8 trie would leave room for 2 tokens; the match is shortened to 4 so the
    # factor-1 proposal gets 4.
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6]
    cache = SuffixCache(max_depth=8)
    cache.start_request("a", prompt)
    assert cache.propose("a", 8)[0] == [7, 8, 9, 10]


def test_suffix_errors_name_the_value():
    for kwargs, needle in (({"max_depth": 1}, "max_depth=1"), ({"max_cached_requests": -1}, "max_cached_requests=-1"),
                           ({"min_token_prob": 1.5}, "min_token_prob=1.5"), ({"max_spec_factor": -1}, "max_spec_factor=-1")):
        with pytest.raises(ValueError, match=needle):
            SuffixCache(**kwargs)
    cache = SuffixCache()
    with pytest.raises(ValueError, match="start_request"):
        cache.propose("x", 2)
    cache.start_request("x", [1])
    with pytest.raises(ValueError, match="already active"):
        cache.start_request("x", [1])
    with pytest.raises(ValueError, match="k=-1"):
        cache.propose("x", -1)
    cache.stop_request("x")
    with pytest.raises(ValueError, match="not active"):
        cache.add_tokens("x", [2])


# ---- prediction (OpenAI's Predicted Outputs) --------------------------------------------------


def _prediction_row(prediction: list[int], **kwargs):
    from serving.engine.drafters.base import RowContext
    from serving.engine.drafters.prediction import PredictionDrafter

    drafter = PredictionDrafter(**kwargs)
    prompt = [1, 2, 3]
    drafter.start(0, RowContext(0, prompt, prediction, False))
    return drafter, prompt


def test_prediction_proposes_k_once_the_answer_copies_it():
    pred = list(range(10, 40))
    drafter, prompt = _prediction_row(pred, k=6)
    assert drafter.propose(0, prompt, 6) == pred[:6]  # nothing answered yet: the prediction's head
    assert drafter.propose(0, prompt + [10], 6) == pred[1:7]  # the answer so far is the head: sure
    assert drafter.propose(0, prompt + [99, 20, 21, 22, 23], 6) == pred[14:20]  # a 4-token tail: sure


@pytest.mark.parametrize(("answer", "expect"), [([99, 17], [18, 19]), ([99, 16, 17], [18, 19, 20]),
                                                ([99, 15, 16, 17], [18, 19, 20, 21])])  # fmt: skip
def test_prediction_proposes_n_plus_1_after_a_short_alignment(answer, expect):
    """A tail of n < confident_n tokens found in the prediction may be a coincidence: n + 1 tokens."""
    pred = list(range(10, 40))
    drafter, prompt = _prediction_row(pred, k=8)
    assert drafter.propose(0, prompt + answer, 8) == expect


def test_prediction_confident_n_1_always_proposes_k():
    pred = list(range(10, 40))
    drafter, prompt = _prediction_row(pred, k=8, confident_n=1)
    assert drafter.propose(0, prompt + [99, 17], 8) == pred[8:16]


def test_prediction_proposes_nothing_off_the_prediction_and_errors_name_the_value():
    drafter, prompt = _prediction_row(list(range(10, 40)), k=8)
    assert drafter.propose(0, prompt + [99, 98], 8) == []
    from serving.engine.drafters.prediction import PredictionDrafter

    with pytest.raises(ValueError, match=r"confident_n=0 must be in 1..max_n=8"):
        PredictionDrafter(confident_n=0)
    with pytest.raises(ValueError, match=r"confident_n=9 must be in 1..max_n=8"):
        PredictionDrafter(confident_n=9)
    from serving.engine.engine_settings import PredictionSettings

    with pytest.raises(ValueError, match=r"prediction.confident_n=5 must be in 1..max_n=4"):
        PredictionSettings(max_n=4, confident_n=5)

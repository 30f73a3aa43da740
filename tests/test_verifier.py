"""The engine's target side is a ``Verifier``: the in-process ``LocalVerifier`` is what a target
model gets wrapped in, and a verifier that fails rows fails only their requests (the engine's
half of distributed mode's failure semantics, here without gRPC)."""

import pytest
import torch

from serving.engine import EngineConfig, Request, SpeculativeEngine
from serving.engine.verifier import LocalVerifier, Verdict, Verifier, VerifierError
from tests.test_engine_tiny import ragged_prompts

pytestmark = pytest.mark.integration


class Flaky(Verifier):
    """A ``LocalVerifier`` that fails chosen rows (``lose``) or whole calls (``down``) on its Nth verify."""

    def __init__(self, target, tokenizer, lose=(), down=False, at_call=2):
        self.local = LocalVerifier(target, tokenizer)
        self.lose, self.down, self.at_call, self.calls = list(lose), down, at_call, 0
        self.released: list[int] = []

    def bind(self, config):
        self.local.bind(config)
        self.vocab_size, self.eos_ids, self.max_len, self.device = (
            self.local.vocab_size, self.local.eos_ids, self.local.max_len, self.local.device)

    def prefill(self, row, prompt, params, u, *, max_new_tokens, k_max):
        return self.local.prefill(row, prompt, params, u, max_new_tokens=max_new_tokens, k_max=k_max)

    def verify(self, batch):
        self.calls += 1
        verdict = self.local.verify(batch)
        if self.calls != self.at_call:
            return verdict
        if self.down:
            raise VerifierError("the target went away")
        return Verdict(verdict.n_accepted, verdict.next_token, VerifierError("rows lost", rows=self.lose))

    def release(self, row):
        self.released.append(row)


def test_a_target_model_and_its_local_verifier_are_the_same_engine(tiny_target, tiny_draft, tokenizer):
    requests = [Request(p, max_new_tokens=16) for p in ragged_prompts(4, seed=21)]
    config = lambda: EngineConfig(max_batch_size=2, max_len=96, k=3)  # noqa: E731
    by_model = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, config()).generate(requests)
    verifier = LocalVerifier(tiny_target, tokenizer)
    engine = SpeculativeEngine(verifier, tokenizer, tiny_draft, config())
    assert engine.verifier is verifier and isinstance(SpeculativeEngine(tiny_target, tokenizer).verifier, LocalVerifier)
    assert [o.token_ids for o in engine.generate(requests)] == [o.token_ids for o in by_model]


def test_a_lost_row_fails_its_request_alone(tiny_target, tiny_draft, tokenizer):
    requests = [Request(p, max_new_tokens=16) for p in ragged_prompts(3, seed=22)]
    expected = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=3, max_len=96, k=3)).generate(requests)
    flaky = Flaky(tiny_target, tokenizer, lose=[1])
    engine = SpeculativeEngine(flaky, tokenizer, tiny_draft, EngineConfig(max_batch_size=3, max_len=96, k=3))
    ids = [engine.add_request(r) for r in requests]
    tokens = {i: [] for i in ids}
    finished = {}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished is not None:
                finished[out.request_id] = out.finished

    step()  # admission + the first verify
    with pytest.raises(VerifierError, match="rows lost") as e:
        step()
    assert e.value.request_ids == [ids[1]] and flaky.released == [1] and engine.num_running == 2
    while engine.has_unfinished_requests():  # the others' tokens of the failed step come with the next
        step()
    assert sorted(finished) == [ids[0], ids[2]]
    for i in (0, 2):
        assert finished[ids[i]].token_ids == tokens[ids[i]] == expected[i].token_ids
    assert sorted(flaky.released) == [0, 1, 2]  # every row released once


def test_a_target_gone_fails_every_running_request_and_the_waiting_ones_go_on(tiny_target, tiny_draft, tokenizer):
    requests = [Request(p, max_new_tokens=12) for p in ragged_prompts(3, seed=23)]
    expected = SpeculativeEngine(tiny_target, tokenizer, tiny_draft, EngineConfig(max_batch_size=2, max_len=96, k=2)).generate(requests)
    flaky = Flaky(tiny_target, tokenizer, down=True)
    engine = SpeculativeEngine(flaky, tokenizer, tiny_draft, EngineConfig(max_batch_size=2, max_len=96, k=2))
    ids = [engine.add_request(r) for r in requests]
    engine.step()
    with pytest.raises(VerifierError, match="went away") as e:
        engine.step()
    assert sorted(e.value.request_ids) == ids[:2] and engine.num_running == 0 and engine.num_waiting == 1
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o.finished for o in engine.step() if o.finished is not None}
    assert list(outs) == [ids[2]] and outs[ids[2]].token_ids == expected[2].token_ids


def test_close_aborts_everything_and_releases_the_rows(tiny_target, tokenizer):
    flaky = Flaky(tiny_target, tokenizer, at_call=-1)
    engine = SpeculativeEngine(flaky, tokenizer, config=EngineConfig(max_batch_size=2, max_len=96, k=0))
    for p in ragged_prompts(3, seed=24):
        engine.add_request(Request(p, max_new_tokens=30))
    engine.step()
    engine.close()
    assert not engine.has_unfinished_requests() and sorted(flaky.released) == [0, 1]
    assert torch.all(engine.state.done)


def test_a_reused_prefill_changes_no_output_and_is_charged_its_measured_time(tiny_target, tiny_draft, tokenizer):
    """``reuse_prefill``: a prompt prefilled again into the row that holds it takes the row's KV and
    first logits. Every drafter's output, greedy and seeded, is the same as when each request
    prefills (rows finish at different steps and keep decoding frozen beside the others, so any
    write below a prompt's end would show), the reusing requests are marked and charged, and a
    warm-up (which writes every row) forgets what the rows held."""
    from serving.engine.sampling import SamplingParams

    prompts = ragged_prompts(3, seed=31)
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=7), SamplingParams()]
    order = ["none", "draft", "none", "draft"]

    charges = []  # the seconds each reusing admission was charged

    def run(reuse):
        engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=96, k=3,
                                   reuse_prefill=reuse), drafters={"draft": tiny_draft, "none": None})  # fmt: skip
        calls = []
        prefill = engine.verifier.runner.prefill
        engine.verifier.runner.prefill = lambda *a, **k: calls.append(1) or prefill(*a, **k)
        admit = engine.verifier.prefill

        def charged(*a, **k):
            first = admit(*a, **k)
            if engine.verifier.reused_prefill_s is not None:
                charges.append(engine.verifier.reused_prefill_s)
            return first

        engine.verifier.prefill = charged
        outs = [engine.generate([Request(p, params=s, max_new_tokens=12 + 5 * i, drafter=name)
                                 for i, (p, s) in enumerate(zip(prompts, params))]) for name in order]  # fmt: skip
        return engine, outs, len(calls)

    _, fresh, fresh_calls = run(False)
    engine, reused, reused_calls = run(True)
    assert [[o.token_ids for o in out] for out in reused] == [[o.token_ids for o in out] for out in fresh]
    assert fresh_calls == 12 and reused_calls < fresh_calls
    stats = [o.stats for out in reused for o in out]
    assert sum(s["prefill_reused"] for s in stats) == fresh_calls - reused_calls
    assert not any(o.stats["prefill_reused"] for o in reused[0])  # nothing kept before the first prefills
    hits = sorted(s["prefill_time_s"] for s in stats if s["prefill_reused"])
    assert len(hits) == len(charges) and all(t >= c > 0 for t, c in zip(hits, sorted(charges)))
    assert all(s["total_time_s"] >= s["prefill_time_s"] for s in stats)
    # A prefill that fails midway may have written part of the row: the row is forgotten, not kept.
    row = next(iter(engine.verifier._kept))

    def half_done(*a, **k):
        raise RuntimeError("out of memory in layer 1")

    engine.verifier.runner.prefill = half_done
    with pytest.raises(RuntimeError):
        engine.verifier.prefill(row, torch.tensor([[5, 6, 7]]), SamplingParams(), torch.rand(1), max_new_tokens=4, k_max=3)
    assert row not in engine.verifier._kept
    engine.verifier.warmup((1,), rows=2)
    assert not engine.verifier._kept


def test_a_row_whose_admission_failed_after_its_prefill_is_not_reused(tiny_target, tiny_draft, tokenizer):
    """The failed request never reached the decode state, so its row keeps the previous
    occupant's length and the neighbours' steps write the row there, inside the new prompt. The
    row must not be offered for reuse: the same prompt later prefills again, to the same cache."""
    from tests.test_engine_drafters import _Poisoned, _run

    def engine():
        return SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=128, k=3,
                                 reuse_prefill=True), drafters={"poison": _Poisoned("start"), "none": None})  # fmt: skip

    g = torch.Generator().manual_seed(5)
    short, long_, body = (torch.randint(3, 376, (n,), generator=g).tolist() for n in (3, 12, 40))
    poisoned = [_Poisoned.POISON, *body]
    e = engine()
    ids, done, failed = _run(e, [Request(short, max_new_tokens=10, drafter="none"),
                                 Request(long_, max_new_tokens=40, drafter="none"),
                                 Request(poisoned, max_new_tokens=8, drafter="poison")])  # fmt: skip
    assert set(failed) == {ids[2]} and set(done) == {ids[0], ids[1]}
    row = 0  # where the short request ran and the poisoned one was admitted
    assert row not in e.verifier._kept
    again = e.generate([Request(poisoned, max_new_tokens=8, drafter="none")])[0]
    assert not again.stats["prefill_reused"]
    fresh = engine()
    assert again.token_ids == fresh.generate([Request(poisoned, max_new_tokens=8, drafter="none")])[0].token_ids
    L = len(poisoned)
    for mine, theirs in zip(e.verifier.runner.cache.keys, fresh.verifier.runner.cache.keys):
        assert torch.equal(mine[row, :, :L], theirs[row, :, :L])

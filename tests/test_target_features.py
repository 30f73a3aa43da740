"""The target's features for EAGLE-3 heads (issue 60): ``ModelRunner.capture_layers`` returns the
residual stream entering the chosen layers, vLLM's ``eagle_aux_hidden_state_layer_ids`` convention
(id i: what layer i reads; 0 the token embeddings), on the Hugging Face forward and on the lean
forward of Choral's CPU kernels, at prefill and in a step."""

from __future__ import annotations

import pytest
import torch

from serving.engine import cpu_kernels
from serving.engine.drafters.base import HostDrafter
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.runner import ModelRunner
from tests.test_decoder import _ids, _tiny



def _reference(model, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """What Hugging Face's own forward reads into each layer ([1, L, n * H])."""
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in layers], dim=-1)


@pytest.mark.unit
def test_the_hugging_face_forward_captures_what_each_layer_reads():
    model = _tiny(seed=3)
    runner = ModelRunner(model, batch_size=2, max_len=64)
    runner.capture_layers((1, 0))  # sorted: the features come in layer order
    ids = _ids(12, seed=4)
    runner.prefill(ids[:, :8], slot=1)
    torch.testing.assert_close(runner.prefill_features, _reference(model, ids[:, :8], (0, 1)))
    # A 4-token step after the prompt: its features are those positions' (the cache holds the rest).
    tokens = torch.cat([ids[:, 8:], ids[:, 8:]])  # [2, 4]: row 0 is an empty slot, any tokens
    positions = torch.arange(8, 12).repeat(2, 1)  # [2, 4]
    logits = runner.forward(tokens, positions)
    feats = runner.last_features
    assert logits.shape[:2] == (2, 4) and feats.shape == (2, 4, 2 * model.config.hidden_size)
    torch.testing.assert_close(feats[1:], _reference(model, ids, (0, 1))[:, 8:])
    # The embeddings are layer 0's input, exactly.
    torch.testing.assert_close(feats[1:, :, : model.config.hidden_size], model.model.embed_tokens(ids[:, 8:]), rtol=0, atol=0)


@pytest.mark.unit
@pytest.mark.skipif(cpu_kernels._rowdot_ext() is None, reason="rowdot kernel cannot be built here")
def test_the_lean_forward_captures_the_same_features_to_rounding():
    model = cpu_kernels.prepare_for_cpu(_tiny(seed=5), weights="fp32", token_counts=(1, 5))
    ids = _ids(16, seed=6)

    def features(lean: bool) -> torch.Tensor:
        model._choral_decoder.enabled = lean
        runner = ModelRunner(model, batch_size=1, max_len=64)
        runner.capture_layers((0, 1))
        runner.prefill(ids[:, :11], slot=0)
        runner.forward(ids[:, 11:], torch.arange(11, 16)[None])
        step = runner.last_features
        return torch.cat([runner.prefill_features, step], dim=1)  # [1, 16, 2H]

    torch.testing.assert_close(features(True), features(False), rtol=1e-4, atol=1e-4)


@pytest.mark.unit
def test_a_layer_the_model_lacks_is_refused_by_name():
    runner = ModelRunner(_tiny(), batch_size=1, max_len=32)
    with pytest.raises(ValueError, match=r"capture layers \[2\].*0\.\.1"):
        runner.capture_layers((0, 2))


class _FeatureRecorder(HostDrafter):
    """A host drafter that reads the target's features (as an EAGLE-3 head would) and records
    them per row: proposes by prompt lookup, so steps accept several tokens."""

    target_layers = (0, 1)

    def __init__(self) -> None:
        self.inner = NgramDrafter()
        self.seen: dict[int, list[torch.Tensor]] = {}
        self.tokens: dict[int, list[int]] = {}

    def start(self, row, ctx):
        self.inner.start(row, ctx)
        self.seen[row], self.tokens[row] = [ctx.hidden], list(ctx.prompt)

    def observe(self, row, new_tokens, hidden=None):
        self.inner.observe(row, new_tokens)
        assert hidden is not None and hidden.shape[0] == (len(new_tokens) if len(self.tokens[row]) > len(self.seen[row][0]) else 0)
        self.seen[row].append(hidden)
        self.tokens[row] += list(new_tokens)

    def propose(self, row, tokens, k):
        return self.inner.propose(row, tokens, k)

    def stop(self, row, finished):
        self.inner.stop(row, finished)


@pytest.mark.integration
def test_a_feature_drafter_gets_each_committed_positions_features_in_a_mixed_batch():
    """Every row's features, gathered from start and each observe, are the target's own at every
    position but the last committed one (its feature comes with the next token), whatever shares
    the batch."""
    from serving.engine.core import SpeculativeEngine
    from serving.engine.engine_settings import EngineConfig
    from serving.engine.request import Request
    from tests.conftest import make_tokenizer

    model, tok = _tiny(seed=7), make_tokenizer(512)
    recorder = _FeatureRecorder()
    engine = SpeculativeEngine(model, tok, config=EngineConfig(max_batch_size=4, max_len=96, k=4),
                               drafters={"feat": recorder, "ngram": NgramDrafter()})  # fmt: skip
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12], [20, 21, 22, 23, 24, 25]]
    names = ["feat", "ngram", "feat", "none"]
    outs = engine.generate([Request(p, max_new_tokens=20, drafter=n) for p, n in zip(prompts, names)])
    rows = [b for b, n in enumerate(names) if n == "feat"]
    assert any(outs[b].stats["accepted"] > 0 for b in rows)  # steps that committed several tokens
    for b in rows:
        ids = torch.tensor([prompts[b] + outs[b].token_ids])  # [1, L + T]
        got = torch.cat(recorder.seen[b], dim=0)  # [L + T - 1, 2H]
        assert got.shape[0] == ids.shape[1] - 1
        torch.testing.assert_close(got, _reference(model, ids, (0, 1))[0, :-1], rtol=1e-4, atol=1e-4)


@pytest.mark.unit
def test_a_remote_target_refuses_a_feature_drafter_by_name():
    """A draft node's verifier is a target service that hands out no features: the engine refuses
    the drafter when it is built, with the fix in the message."""
    from serving.distributed.remote import RemoteVerifier

    with pytest.raises(ValueError, match=r"hidden states \(layers \[2, 5\]\).*not on a draft node"):
        RemoteVerifier("127.0.0.1:9", timeout_s=0.1).capture((2, 5))

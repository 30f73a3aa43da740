"""The drafter protocol (``serving.engine.drafters.base``): a new drafter kind is a class and a
registration, and the engine runs it beside the others without a change of its own; what the
protocol asks of a drafter the engine cannot serve yet is refused by name."""

import pytest

from serving.engine.drafters import registry
from serving.engine.drafters.base import DraftBatch, HostDrafter, RowContext
from serving.engine.drafters.model import ModelDrafter
from serving.engine.engine_settings import EngineSettings, is_model_ref
from serving.engine.loader import build_engine
from serving.engine.request import Request
from tests.test_engine_tiny import hf_greedy, ragged_prompts

pytestmark = pytest.mark.integration


class RepeatLast(HostDrafter):
    """A drafter kind the engine has never seen: it proposes the row's last token k times, and
    keeps a log of the life-cycle calls it gets."""

    kind = "repeat"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, row, ctx):
        self.calls.append(("start", row, len(ctx.prompt)))

    def propose(self, row, tokens, k):
        return [tokens[-1]] * k

    def observe(self, row, new_tokens, hidden=None):
        self.calls.append(("observe", row, len(new_tokens)))

    def stop(self, row, finished):
        self.calls.append(("stop", row, finished))


def test_a_new_drafter_kind_is_a_class_and_a_registration(tiny_target, tokenizer, monkeypatch):
    made = []
    monkeypatch.setitem(registry.BUILT_IN, "repeat", lambda settings: made.append(RepeatLast()) or made[-1])
    assert not is_model_ref("repeat")
    settings = EngineSettings(device="cpu", max_batch_size=2, max_len=96, k=3)
    engine = build_engine(settings, tokenizer, tiny_target, {"repeat": "repeat", "ngram": "ngram"})
    prompts = [[7, 7, 7, 7, 7, 7, 9], *ragged_prompts(1, seed=5)]
    outs = engine.generate([Request(p, max_new_tokens=12, drafter=d) for p, d in zip(prompts, ["repeat", "ngram"])])
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_target, p, 12) for p in prompts]
    assert outs[0].stats["drafter"] == "repeat" and outs[0].stats["drafted"] > 0
    [drafter] = made
    kinds = [c[0] for c in drafter.calls]
    assert kinds[0] == "start" and kinds[-1] == "stop" and drafter.calls[-1] == ("stop", 0, True)
    # told every committed token (the first one at admission), on steps it proposed or not
    assert sum(c[2] for c in drafter.calls if c[0] == "observe") == len(outs[0].token_ids)


def test_a_drafter_that_reads_the_targets_features_gets_them_from_layers_the_target_has(tiny_target, tokenizer):
    """The local target captures the layers a drafter names (tests/test_target_features.py checks
    what it hands over); a layer the target lacks is refused by name."""
    class Eagle(RepeatLast):
        target_layers = (0, 1)

    class Beyond(RepeatLast):
        target_layers = (1, 2)

    settings = EngineSettings(device="cpu", max_len=64, k=2)
    engine = build_engine(settings, tokenizer, tiny_target, {"eagle": Eagle()})
    assert engine.verifier.runner.capture == (0, 1)
    with pytest.raises(ValueError, match=r"capture layers \[2\] are not layers of this 2-layer model"):
        build_engine(settings, tokenizer, tiny_target, {"beyond": Beyond()})


def test_a_model_reference_must_be_loaded_before_build_engine(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="'some/model' is a model reference; load it first"):
        build_engine(EngineSettings(device="cpu", max_len=64, k=2), tokenizer, tiny_target, {"d": "some/model"})


def test_the_model_drafter_takes_the_lowest_free_cache_row_and_frees_it(tiny_draft):
    """Its cache row r serves engine slot owner[r]; a stopped row's cache row is free again."""
    drafter = ModelDrafter(tiny_draft)
    drafter.bind(batch_size=4, max_len=64, vocab_size=tiny_draft.config.vocab_size)
    for slot in (3, 1):
        drafter.start(slot, RowContext(slot, [5, 6, 7], None, False))
    assert drafter.owner == [3, 1, None, None]
    drafter.stop(3, finished=True)
    drafter.start(2, RowContext(9, [5, 6], None, False))
    assert drafter.owner == [2, 1, None, None]
    assert drafter.propose_rows(DraftBatch([0] * 4, None, None, None, 0, (1, 2, 4))) is None  # no budget: no forward

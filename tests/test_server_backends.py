"""The scheduler's one check of a drafter name. No model is loaded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serving.server.openai_api import APIError
from serving.server.scheduler import Scheduler

pytestmark = pytest.mark.unit


def test_a_drafter_name_is_valid_when_the_engine_has_it():
    """The scheduler takes the one engine; its drafter names are the valid ones, and a name a
    request forces is refused in one place, naming the bad value and the valid names."""
    engine = SimpleNamespace(drafter_names=["code", "ngram", "none"])
    scheduler = Scheduler(engine)
    assert scheduler.drafter_names == ("code", "ngram", "none")
    assert scheduler.check_draft("ngram") == "ngram" and scheduler.check_draft(None) is None
    with pytest.raises(APIError) as info:
        scheduler.check_draft("eagle")
    error = info.value
    assert (error.status, error.param, error.code) == (400, "draft", "unknown_draft")
    assert error.message == "unknown draft 'eagle'; choose one of code, ngram, none"
    # The router's names are checked once, when the scheduler is made: admission never meets a stranger.
    router = SimpleNamespace(draft_names=["code", "math", "none"])
    with pytest.raises(ValueError, match=r"router chooses drafters \['math'\] that the engine does not have \(it has "
                                         r"code, ngram, none\)"):  # fmt: skip
        Scheduler(engine, router)

"""The app's ``Backend`` protocol, as both backends implement it (the Choral engine's
``EngineServer`` and the vLLM fleet front's ``FleetServer``), and the scheduler's one check of a
drafter name. No model is loaded."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import yaml

from serving.config import load_config
from serving.server.app import Backend, create_app
from serving.server.openai_api import APIError
from serving.server.scheduler import Scheduler
from serving.server.serve_config import ServeConfig
from serving.server.server import EngineServer

pytestmark = pytest.mark.unit


def engine_backend(tmp_path) -> tuple[EngineServer, ServeConfig]:
    cfg = ServeConfig()
    return EngineServer(cfg), cfg


def fleet_backend(tmp_path):
    from serving.server.vllm_backend import FleetServer  # httpx: the [vllm] extra

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"model": "m", "pools": [{"name": "plain", "replicas": ["http://127.0.0.1:1"]}]}))
    cfg = load_config(ServeConfig, None, ["backend=vllm", f"fleet={fleet}"])
    return FleetServer(cfg), cfg


@pytest.mark.parametrize("make", [engine_backend, fleet_backend], ids=["engine", "fleet"])
def test_both_backends_implement_the_protocol(make, tmp_path):
    """Every member ``Backend`` writes down is there, and each method has its parameters and is
    async exactly when the protocol's is: what create_app calls works on either backend."""
    backend, cfg = make(tmp_path)
    members = {name: value for name, value in vars(Backend).items() if not name.startswith("_")}
    assert set(Backend.__annotations__) == {"metrics", "started"}
    assert {"ready", "error", "model_name", "model_info", "start", "stop", "unavailable", "generate"} <= set(members)
    for name in [*Backend.__annotations__, *(n for n, v in members.items() if isinstance(v, property))]:
        inspect.getattr_static(backend, name)  # an attribute or a property: AttributeError if missing
    for name, method in members.items():
        if isinstance(method, property) or not callable(method):
            continue
        implemented = getattr(type(backend), name)
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(method), name
        assert list(inspect.signature(implemented).parameters) == list(inspect.signature(method).parameters), name
    app = create_app(backend, cfg)
    assert app.state.backend is backend
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= {r.path for r in app.routes}


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
    router = SimpleNamespace(draft_names=["code", "math", "none"], collected_k=4, choose_batch=None, rate_at=None)
    with pytest.raises(ValueError, match=r"router chooses drafters \['math'\] that the engine does not have \(it has "
                                         r"code, ngram, none\)"):  # fmt: skip
        Scheduler(engine, router)


def test_the_router_the_scheduler_routes_with_is_a_protocol_a_real_router_satisfies():
    """The scheduler reads the router and its choices through ``scheduler.Router`` and
    ``scheduler.RouteChoice``, never through attribute lookups with defaults: routing's own Router
    and Choice have every member (a rename there fails here), and a router lacking one is refused
    by name when the scheduler is made, instead of silently routing without its K or fallback."""
    import torch

    from routing.router import Router as RoutingRouter
    from serving.server.scheduler import RouteChoice, Router, missing_members

    router = RoutingRouter.create({"a": "draft-a", "none": None}, "target", objective="speedup",
                                  costs={"a": {"draft_cost": 0.05, "verify_cost": 1.5}})  # fmt: skip
    router.info |= {"collected_k": 4}
    [choice] = router.decide(torch.tensor([[0.9]]), 1)
    assert missing_members(router, Router) == [] and isinstance(router, Router)
    assert missing_members(choice, RouteChoice) == [] and isinstance(choice, RouteChoice)
    assert missing_members(object(), Router) == ["choose_batch", "collected_k", "draft_names", "rate_at"]
    engine = SimpleNamespace(drafter_names=["a", "none"])
    lacking = SimpleNamespace(draft_names=["a", "none"], choose_batch=router.choose_batch, rate_at=router.rate_at)
    with pytest.raises(TypeError, match=r"the router lacks collected_k, which the scheduler routes with"):
        Scheduler(engine, lacking)
    assert Scheduler(engine, router).router is router

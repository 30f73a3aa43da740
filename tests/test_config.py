"""YAML -> typed dataclass configs: overrides, type checks, and errors that name the bad key."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from serving.config import ConfigError, describe, load_config, to_dict

pytestmark = pytest.mark.unit


@dataclass
class Optim:
    lr: float = field(default=3e-4, metadata={"doc": "peak learning rate"})
    schedule: Literal["cosine", "constant"] = "cosine"

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")


@dataclass
class Cfg:
    model: str = "m"
    steps: int = 10
    k: int | str = 4
    layers: list[int] = field(default_factory=lambda: [0, 1])
    extra: dict[str, float] = field(default_factory=dict)
    eval_every: int | None = None
    optim: Optim = field(default_factory=Optim)


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_file_then_dotted_overrides(tmp_path):
    p = write(tmp_path, "# train-draft --config c.yaml\nsteps: 5\noptim:\n  lr: 0.001\n")
    cfg = load_config(Cfg, p, ["optim.schedule=constant", "k=auto", "layers=[2, 3]", "extra.a=1", "eval_every=null"])
    assert cfg.steps == 5 and cfg.optim.lr == 0.001 and cfg.optim.schedule == "constant"
    assert cfg.k == "auto" and cfg.layers == [2, 3] and cfg.extra == {"a": 1.0} and cfg.eval_every is None
    assert to_dict(cfg)["optim"]["lr"] == 0.001
    # YAML 1.1 reads 5e-4 (no dot) as a string; a float field still takes it.
    assert load_config(Cfg, p, ["optim.lr=5e-4"]).optim.lr == 5e-4


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("stepz: 3\n", [], r"unknown key 'stepz'.*valid keys under the top level: .*steps"),
        ("optim:\n  lrr: 1\n", [], r"unknown key optim.'lrr'; valid keys under optim: lr, schedule"),
        ("", ["steps=many"], r"steps='many' must be int"),
        ("", ["optim.schedule=linear"], r"optim.schedule='linear' must be one of 'cosine', 'constant'"),
        ("", ["optim.lr=-1"], r"optim.lr=-1.0 must be > 0"),
        ("", ["optim.lr=fast"], r"optim.lr='fast' must be float"),
        ("", ["layers=3"], r"layers=3 must be a list"),
        ("", ["steps"], r"must look like key=value"),
        ("- a\n", [], r"must hold a mapping"),
        ("steps: true\n", [], r"steps=True must be int"),
    ],
)
def test_errors_name_the_key_and_the_fix(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Cfg, write(tmp_path, text), overrides)


def test_missing_file_and_describe(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, tmp_path / "nope.yaml")
    assert "optim.lr: float = 0.0003  # peak learning rate" in describe(Cfg)

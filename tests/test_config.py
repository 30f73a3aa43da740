"""YAML -> typed dataclass configs: overrides, type checks, and errors that name the bad key."""

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest

from serving.cli import Command, Flag
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


# ---- nested sections, renamed keys, and the command-line helper (serving/cli.py) --------------


@dataclass
class Engine:
    max_batch_size: int = field(default=1, metadata={"doc": "slots"})
    k: int | str = 4
    cpu_kernels: bool = True


@dataclass
class Tool:
    RENAMED: ClassVar[dict[str, str]] = {"batch_size": "engine.max_batch_size", "engine.batch_size": "engine.max_batch_size"}
    prompt: str | None = field(default=None, metadata={"doc": "the prompt text"})
    stop: list[str] = field(default_factory=list)
    domains: list[str] = field(default_factory=lambda: ["code"])
    engine: Engine = field(default_factory=lambda: Engine(max_batch_size=8))


def test_a_nested_section_keeps_its_fields_defaults(tmp_path):
    cfg = load_config(Tool, write(tmp_path, "engine:\n  k: 2\n"))
    assert cfg.engine == Engine(max_batch_size=8, k=2)  # not Engine's own max_batch_size=1
    assert "engine.max_batch_size: int = 8  # slots" in describe(Tool)


@pytest.mark.parametrize("override", ["batch_size=4", "engine.batch_size=4"])
def test_an_old_key_names_its_new_one(override):
    with pytest.raises(ConfigError, match=rf"^{override.split('=')[0]} was renamed to engine.max_batch_size: use that key instead$"):
        load_config(Tool, None, [override])


TOOL = Command("tool", Tool, "tool: a test command.\n\n    tool --prompt TEXT", flags=[
    Flag("--prompt", "prompt"),
    Flag("--stop", "stop", repeat=True),
    Flag("--domains", "domains", sep=","),
    Flag(("--batch-size", "--max-batch-size"), "engine.max_batch_size"),
    Flag("--k", "engine.k"),
    Flag("--no-cpu-kernels", "engine.cpu_kernels", const=False),
])  # fmt: skip


def run_tool(argv):
    seen = []
    return TOOL.main(argv, lambda cfg, args: seen.append(cfg)), (seen[0] if seen else None)


def test_flags_file_and_overrides_are_one_mechanism(tmp_path):
    path = write(tmp_path, "engine:\n  k: 2\n  max_batch_size: 3\n")
    status, cfg = run_tool(["--config", str(path), "--batch-size", "5", "--k", "auto", "--no-cpu-kernels",
                            "--stop", "\n\n", "--stop", "x: 1", "--domains", "code,math", "engine.max_batch_size=6"])  # fmt: skip
    assert status == 0
    # file < flags < overrides; text settings take the flag's value verbatim (YAML would make
    # "x: 1" a mapping and "1e3" a float)
    assert cfg.engine == Engine(max_batch_size=6, k="auto", cpu_kernels=False)
    assert cfg.stop == ["\n\n", "x: 1"] and cfg.domains == ["code", "math"]
    assert run_tool(["--prompt", "1e3", "--max-batch-size", "2"])[1].prompt == "1e3"


def test_describe_and_its_alias_and_one_error_format(capsys):
    for flag in ("--describe", "--show-config"):
        assert run_tool([flag]) == (0, None)
        assert "engine.max_batch_size: int = 8  # slots" in capsys.readouterr().out
    assert run_tool(["--k", "2", "engine.max_batch_size=many"]) == (2, None)
    assert capsys.readouterr().err == "tool: error: engine.max_batch_size='many' must be int\n"
    assert run_tool(["batch_size=2"]) == (2, None)
    assert capsys.readouterr().err == "tool: error: batch_size was renamed to engine.max_batch_size: use that key instead\n"
    assert "--batch-size MAX_BATCH_SIZE, --max-batch-size MAX_BATCH_SIZE" in TOOL.parser.format_help()


def test_engine_settings_name_the_fix():
    from serving.engine.engine_settings import EngineSettings

    for overrides, message in [(["k=9"], r"k=9 is not one of k_buckets \[1, 2, 3, 4, 5, 6, 7, 8\]: add it to k_buckets"),
                               (["k=0"], "k=0 must be a positive integer or 'auto'"),
                               (["draft_weights=int8", "cpu_kernels=false"], "draft_weights=int8 runs on Choral's CPU kernels"),
                               (["max_batch_size=0"], "max_batch_size=0 must be >= 1")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_config(EngineSettings, None, overrides)
    s = load_config(EngineSettings, None, ["k=auto", "k_buckets=[4, 2]", "compile_backend=auto", "device=cpu"])
    config = s.engine_config(draft=True)
    assert config.k == "auto" and config.k_buckets == (2, 4) and config.compile_backend == "inductor"
    assert s.engine_config(draft=False).k == 0 and not s.uses_cpu_kernels  # compiling: no (eager-only) CPU kernels

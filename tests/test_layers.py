"""The package layout's layers hold: imports only go down.

    serving.engine  <-  serving.distributed  <-  serving.server
    serving.engine  <-  serving.tools, training, routing
    serving.server, routing  <-  serving.demo (the top: nothing imports it)
    serving.config, serving.cli, serving.prompts, serving.workload: shared by every layer, importing none of them

Every module is read as source (its AST: imports inside functions and TYPE_CHECKING blocks
included), so a lazy import that breaks a layer, or closes a circle, fails here as well as one at
the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("serving", "training", "routing")
SHARED = ("serving.config", "serving.cli", "serving.files", "serving.prompts", "serving.workload")
ABOVE_ENGINE = ("serving.server", "serving.distributed", "serving.fleet", "serving.tools", "serving.demo", "training", "routing")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(folder: str) -> dict[str, Path]:
    """Every module under ``folder`` of the repository (e.g. serving/engine), by dotted name."""
    found = {module_name(p): p for p in sorted((ROOT / folder).rglob("*.py"))}
    assert found, f"no modules under {folder}"
    return found


def imported(path: Path, root: Path = ROOT, top_level_only: bool = False) -> set[str]:
    """The project modules a file imports (relative imports resolved). ``from a.b import c``
    counts a.b, and a.b.c where c is a module."""
    name, package = module_name(path, root), path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                module = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            # ``from pkg import mod`` imports mod (pkg's __init__ runs, but adds no edge of its own
            # unless a name that is not a module comes from it).
            mods = {f"{module}.{alias.name}" for alias in node.names if is_module(f"{module}.{alias.name}", root)}
            out |= mods | ({module} if len(mods) < len(node.names) else set())
    return {m for m in out if m.split(".")[0] in PROJECT}


def is_module(name: str, root: Path = ROOT) -> bool:
    path = root / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(folder: str, forbidden) -> list[str]:
    return [f"{name} imports {target}" for name, path in modules(folder).items()
            for target in sorted(imported(path)) if under(target, forbidden)]  # fmt: skip


def test_the_walker_sees_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "serving" / "engine"
    pkg.mkdir(parents=True)
    (tmp_path / "serving" / "server").mkdir()
    (tmp_path / "serving" / "server" / "server.py").write_text("")
    (pkg / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import routing.router\n"
        "def f():\n    from serving.server import server\n    from ..tools import bench\n"
    )
    assert imported(pkg / "x.py", tmp_path) == {"routing.router", "serving.server.server", "serving.tools"}
    assert imported(pkg / "x.py", tmp_path, top_level_only=True) == set()


def test_engine_imports_no_layer_above_it():
    assert violations("serving/engine", ABOVE_ENGINE) == []


def test_distributed_imports_only_the_engine_and_shared_helpers():
    assert violations("serving/distributed", ("serving.server", "serving.fleet", "serving.tools", "training", "routing")) == []


def test_shared_helpers_import_no_layer():
    for name in SHARED:
        found = imported(ROOT / (name.replace(".", "/") + ".py"))
        assert {m for m in found if not under(m, SHARED) and m != "serving"} == set(), name


@pytest.mark.parametrize("folder", ["training", "routing"])
def test_training_and_routing_never_import_server_distributed_or_tools(folder):
    assert violations(folder, ("serving.server", "serving.distributed", "serving.tools", "serving.demo")) == []


@pytest.mark.parametrize("folder", ["serving/server", "serving/tools", "serving/fleet"])
def test_the_demo_is_the_top_nothing_imports_it(folder):
    assert violations(folder, ("serving.demo",)) == []


# training and routing sit on the engine and the shared helpers. One import goes elsewhere, and is
# listed here so that it stays visible and no other joins it: `collect-router-data --profile`
# writes a simulator profile of its rows with serving.fleet.profile.from_router_data.
KNOWN_BEYOND_ENGINE = {"routing.cli imports serving.fleet.profile"}


def test_training_and_routing_use_only_the_engine_and_shared_helpers_but_the_known_one():
    allowed = ("serving.engine", *SHARED)
    found = {v for folder in ("training", "routing") for v in violations(folder, ("serving",))
             if not under(v.split(" imports ")[1], allowed) and v.split(" imports ")[1] != "serving"}  # fmt: skip
    assert found == KNOWN_BEYOND_ENGINE


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    mods = {name: path for folder in PROJECT for name, path in modules(folder).items()}
    return {name: {m for m in imported(path, top_level_only=top_level_only) if m in mods and m != name}
            for name, path in mods.items()}  # fmt: skip


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str] | None:
        for nxt in sorted(graph[node]):
            if nxt in trail or nxt == node:
                return trail[trail.index(nxt):] + [node, nxt] if nxt in trail else [node, nxt]
            if nxt not in done and (found := visit(nxt, trail + [node])):
                return found
        done.add(node)
        return None

    for name in sorted(graph):
        if name not in done and (found := visit(name, [])):
            return found
    return None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) in (["a", "b", "c", "a"],)
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module level", "function level too"])
def test_no_import_cycle(top_level_only):
    """Imports between project modules form no cycle, at the top of a module or inside a function
    (a lazy import that points back is a circle all the same: it only hides it)."""
    cycle = find_cycle(import_graph(top_level_only))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_only_the_loader_constructs_the_engine():
    """One way to build an engine: ``serving.engine.loader`` (tests that build engines from stub
    parts on purpose are not looked at)."""
    calls = []
    for folder in (*PROJECT, "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "SpeculativeEngine":
                    calls.append(str(path.relative_to(ROOT)))
    assert set(calls) == {"serving/engine/loader.py"}, sorted(set(calls))


def test_no_function_in_the_packages_is_over_80_lines():
    long = [f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for folder in PROJECT for path in sorted((ROOT / folder).rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]  # fmt: skip
    assert long == []


def test_importing_the_packages_has_no_side_effects():
    """The packages' ``__init__`` import nothing heavy: ``serving.engine`` re-exports its main names
    on first use, so a command can parse its settings (``engine_settings``) before torch loads."""
    code = ("import sys, serving, serving.engine, serving.server, serving.distributed, serving.fleet, serving.tools, "
            "serving.engine.engine_settings; assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)

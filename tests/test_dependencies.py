"""Every third-party module that the packages, the tests or the scripts import is declared in
``pyproject.toml`` (``dependencies`` or an extra). An import that only works because another
package happened to bring it along, or because the machine's own Python has it, fails here rather
than in a user's fresh virtualenv (``cryptography`` once did: the TLS test passed in CI only)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("training", "routing", "serving", "tests", "scripts")
# The packages, and the scripts, which import a sibling script by its file name (it is on their path).
FIRST_PARTY = {"training", "routing", "serving", "tests"} | {p.stem for p in (ROOT / "scripts").rglob("*.py")}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def declared_requirements() -> set[str]:
    """The distribution names ``pyproject.toml`` asks for, in ``dependencies`` and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    names = {normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec).group()) for spec in specs}
    return names - {normalize(project["name"])}  # choral[wandb] inside dev: its own extra, listed too


def imported_modules(paths: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Top-level module -> the files importing it (at any depth: a function-local import counts)."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(root)))
    return found


def undeclared(found: dict[str, set[str]], declared: set[str], providers: dict[str, list[str]]) -> list[str]:
    problems = []
    for module, files in sorted(found.items()):
        if module in sys.stdlib_module_names or module in FIRST_PARTY:
            continue
        dists = {normalize(d) for d in providers.get(module, [])}
        where = ", ".join(sorted(files)[:3]) + (" ..." if len(files) > 3 else "")
        if not dists:
            problems.append(f"{module} (imported by {where}) is provided by no installed distribution: declare it in "
                            "pyproject.toml, or if it is declared, reinstall (pip install -e '.[bundled,dev]')")  # fmt: skip
        elif not dists & declared:
            problems.append(f"{module} (imported by {where}) comes from {sorted(dists)}, which pyproject.toml does not "
                            "declare: add it to dependencies or an extra")  # fmt: skip
    return problems


def test_every_import_is_declared():
    paths = [p for folder in SCANNED for p in sorted((ROOT / folder).rglob("*.py"))]
    problems = undeclared(imported_modules(paths), declared_requirements(), packages_distributions())
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_undeclared_import(tmp_path):
    """The check itself can fail: a module importing something pyproject.toml does not name, or
    something nothing installed provides, is reported with the file and the fix."""
    script = tmp_path / "probe.py"
    script.write_text("import os\nimport yaml\nimport cryptography.x509\nfrom no_such_module_xyz import thing\n")
    found = imported_modules([script], root=tmp_path)
    providers = {"yaml": ["PyYAML"], "cryptography": ["cryptography"]}
    problems = undeclared(found, {"pyyaml"}, providers)
    assert len(problems) == 2
    assert "cryptography (imported by probe.py) comes from ['cryptography']" in problems[0]
    assert "no_such_module_xyz" in problems[1] and "no installed distribution" in problems[1]


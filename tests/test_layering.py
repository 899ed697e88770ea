"""The import rules of the layering (docs/design.md), held in code: every import statement of
the four packages, including those inside functions, is read with ``ast`` and checked.

The folders ``common/ proxy/ actors/ learner/`` install as ``harnessrl.common`` ... (setup.py),
and every import names them so: a bare ``import common`` would load a second copy of a module
under another name, so it is refused everywhere (the packages, tests, benchmarks, deploy).

* ``common`` imports nothing above it (the CLI face resolves commands by name, not by import);
* ``learner`` imports only ``common``;
* ``proxy`` imports neither ``actors`` nor ``learner``;
* ``actors`` and ``learner`` never import each other.

Also: no module of the four packages exceeds ``MAX_LINES`` (generated task suites excepted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "proxy", "actors", "learner")
ALLOWED: dict[str, set[str]] = {
    "common": {"common"},
    "learner": {"common", "learner"},
    "proxy": {"common", "proxy"},
    "actors": {"common", "proxy", "actors"},
}
MAX_LINES = 900
GENERATED = REPO / "common" / "tasks" / "suites"


def sources(pkg: str) -> list[Path]:
    return sorted(p for p in (REPO / pkg).rglob("*.py") if GENERATED not in p.parents)


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """``(line, package)`` of every absolute import in ``path`` (any depth): for ``harnessrl.X``
    the package is ``X``, for anything else its top-level name."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "harnessrl":  # from harnessrl import common
                names = [f"harnessrl.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            top = parts[1] if parts[0] == "harnessrl" and len(parts) > 1 else parts[0]
            out.append((node.lineno, "harnessrl." + top if parts[0] == "harnessrl" else top))
    return out


def _name(f: Path) -> Path:
    return f.relative_to(REPO) if REPO in f.parents else f


def violations(pkg: str, files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        for line, imported in imported_packages(f):
            if imported in PACKAGES:
                bad.append(f"{_name(f)}:{line} imports {imported} bare (harnessrl.{imported})")
            elif imported.startswith("harnessrl."):
                top = imported.removeprefix("harnessrl.")
                if top in PACKAGES and top not in ALLOWED[pkg]:
                    bad.append(f"{_name(f)}:{line} imports {top}")
    return bad


def bare_imports(files: list[Path]) -> list[str]:
    """Imports of ``common``, ``proxy``, ``actors`` or ``learner`` by their bare folder name."""
    return [
        f"{_name(f)}:{line} imports {top} (harnessrl.{top})"
        for f in files
        for line, top in imported_packages(f)
        if top in PACKAGES
    ]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_follow_the_layering(pkg: str):
    """Each package imports only the packages below it (docs/design.md)."""
    assert violations(pkg, sources(pkg)) == []


def test_bare_folder_imports_are_refused(tmp_path: Path):
    """``import common`` or ``from proxy.x import y`` is refused (``from harnessrl import
    actors`` is the installed name): the module would load a second time under a name that is
    not installed."""
    f = tmp_path / "mod.py"
    f.write_text(
        "from harnessrl import actors\nimport common.records\n"
        "def f():\n    from proxy.tito import x\n"
    )
    assert bare_imports([f]) == [
        f"{f}:2 imports common (harnessrl.common)",
        f"{f}:4 imports proxy (harnessrl.proxy)",
    ]
    assert violations("learner", [f]) == [
        f"{f}:1 imports actors",
        f"{f}:2 imports common bare (harnessrl.common)",
        f"{f}:4 imports proxy bare (harnessrl.proxy)",
    ]


def test_nothing_imports_the_folders_by_their_bare_names():
    """Tests, benchmarks and deploy scripts import the installed names, as the packages do."""
    files = [
        p
        for d in (*PACKAGES, "tests", "benchmarks", "deploy")
        for p in sorted((REPO / d).rglob("*.py"))
        if GENERATED not in p.parents and "fixtures" not in p.parts
    ]
    files.append(REPO / "setup.py")
    assert bare_imports(files) == []


def test_the_check_sees_imports_inside_functions(tmp_path: Path):
    """A lazy import inside a function body is caught, as is a top-level one."""
    f = tmp_path / "mod.py"
    f.write_text(
        "import json\nfrom harnessrl.common.records import X\n\n"
        "def f():\n    from harnessrl.actors.rollout import run_rollout\n"
        "    import harnessrl.learner.losses\n"
    )
    assert [t for _, t in imported_packages(f)] == [
        "json",
        "harnessrl.common",
        "harnessrl.actors",
        "harnessrl.learner",
    ]
    assert len(violations("common", [f])) == 2
    assert len(violations("proxy", [f])) == 2
    assert violations("actors", [f]) == [f"{f}:6 imports learner"]
    assert violations("learner", [f]) == [f"{f}:5 imports actors"]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_module_is_too_long(pkg: str):
    """Modules stay readable: none over MAX_LINES lines outside generated task suites."""
    long = {
        str(f.relative_to(REPO)): n
        for f in sources(pkg)
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}

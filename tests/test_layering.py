"""The import rules of DESIGN §2, held in code: every import statement of the four packages,
including those inside functions, is read with ``ast`` and checked against the layering.

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
    """``(line, top-level package)`` of every absolute import in ``path`` (any depth)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def violations(pkg: str, files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        for line, top in imported_packages(f):
            if top in PACKAGES and top not in ALLOWED[pkg]:
                name = f.relative_to(REPO) if REPO in f.parents else f
                bad.append(f"{name}:{line} imports {top}")
    return bad


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_follow_the_layering(pkg: str):
    """Each package imports only the packages below it (DESIGN §2)."""
    assert violations(pkg, sources(pkg)) == []


def test_the_check_sees_imports_inside_functions(tmp_path: Path):
    """A lazy import inside a function body is caught, as is a top-level one."""
    f = tmp_path / "mod.py"
    f.write_text(
        "import json\nfrom common.records import X\n\n"
        "def f():\n    from actors.rollout import run_rollout\n    import learner.losses\n"
    )
    assert [t for _, t in imported_packages(f)] == ["json", "common", "actors", "learner"]
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

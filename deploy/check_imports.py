"""Every import of the repository resolves, as a static type checker sees it (CI runs this).

    python deploy/check_imports.py          # exit 1 and a list when any import does not resolve
    python deploy/check_imports.py --links-only   # only make the .typing links (setup.sh)

The folders ``common/ proxy/ actors/ learner/`` install as ``harnessrl.common`` ... (setup.py),
and setuptools' editable install finds them with an import hook that static tools cannot follow.
``deploy/setup.sh`` therefore also makes ``.typing/harnessrl/<folder>``, a link to each folder
under its installed name; ``[tool.pyright]`` in pyproject.toml puts ``.typing`` on the checker's
path, so editors (Pylance, basedpyright, pyright) resolve ``harnessrl.*`` too. This script makes
the links when they are missing, runs basedpyright over the tree, and fails on what import
resolution reports: a module that does not resolve, a name a module does not define
(``from x import Missing``) or a submodule used without being imported. Type errors are out of
its scope (the code is not typed to a checker's standard).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("common", "proxy", "actors", "learner")
IMPORT_RULES = {"reportMissingImports", "reportMissingModuleSource"}
IMPORT_MESSAGES = ("is unknown import symbol", "is not a known attribute of module")
# protobuf's generated ``*_pb2`` modules define their message classes at import time and ship no
# stubs, so a static checker cannot see ``Summary`` in ``summary_pb2``: not a resolution failure.
GENERATED = "_pb2"


def link_tree(root: Path = REPO) -> Path:
    """``root/.typing/harnessrl/<folder>`` -> ``root/<folder>`` (made or repaired); the path."""
    pkg = root / ".typing" / "harnessrl"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in FOLDERS:
        link, target = pkg / name, Path("..", "..", name)
        if link.is_symlink() and Path(link.readlink()) == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return pkg.parent


def source_line(path: Path, line: int) -> str:
    """Line ``line`` (0-based) of ``path``; empty when it cannot be read."""
    try:
        return path.read_text(errors="replace").splitlines()[line]
    except (OSError, IndexError):
        return ""


def import_problems(diagnostics: list[dict]) -> list[str]:
    """``file:line: message`` of each import-resolution diagnostic in basedpyright's JSON."""
    out = []
    for d in diagnostics:
        msg = d.get("message", "").split("\n")[0]
        if d.get("rule") in IMPORT_RULES or any(m in msg for m in IMPORT_MESSAGES):
            path = Path(d["file"])
            if GENERATED in msg or GENERATED in source_line(path, d["range"]["start"]["line"]):
                continue
            name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            out.append(f"{name}:{d['range']['start']['line'] + 1}: {msg}")
    return sorted(out)


def main(argv: list[str]) -> int:
    link_tree()
    if argv == ["--links-only"]:
        return 0
    if argv:
        print(f"usage: python deploy/check_imports.py [--links-only] (not {' '.join(argv)})")
        return 2
    exe = shutil.which("basedpyright") or str(Path(sys.executable).with_name("basedpyright"))
    if not Path(exe).exists():
        print("check_imports: basedpyright is not installed (pip install basedpyright)")
        return 2
    proc = subprocess.run(
        # -p: this repository's settings, never a pyrightconfig.json found in a folder above
        [exe, "--outputjson", "-p", str(REPO / "pyproject.toml"), "--pythonpath", sys.executable],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        print(f"check_imports: basedpyright failed (exit {proc.returncode}):\n{proc.stderr}")
        return 2
    problems = import_problems(report.get("generalDiagnostics", []))
    files = report.get("summary", {}).get("filesAnalyzed", 0)
    for p in problems:
        print(p)
    print(f"check_imports: {files} files, {len(problems)} unresolved imports")
    if not files:
        print(f"check_imports: basedpyright analysed no file:\n{proc.stderr}")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""benchmarks/gpu_check.py's carried environment (``benchmarks/_gpu_env.py``): installing only
the missing wheels from a local folder, with pip or without it, and harnessrl from the checkout.
The checks themselves run in CI as ``python -m benchmarks.gpu_check --quick`` (the CPU smoke).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import _gpu_env

REPO = Path(__file__).resolve().parents[1]


def _wheel(folder: Path, module: str, dist: str, version: str) -> Path:
    """A minimal pure-Python wheel holding ``module`` (``VALUE = version``)."""
    base = dist.replace("-", "_")
    path = folder / f"{base}-{version}-py3-none-any.whl"
    info = f"{base}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VALUE = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _folder(tmp_path: Path, modules: dict[str, str], pins: dict[str, str]) -> Path:
    folder = tmp_path / "carry"
    (folder / "wheels").mkdir(parents=True)
    manifest = {"modules": modules, "newer": {}, "pins": pins, "wheels": []}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _run(code: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.integration
def test_only_missing_wheels_are_installed_and_imported(tmp_path: Path) -> None:
    """A module the interpreter lacks is installed from the folder (pip --no-index --target)
    and importable at once; one it has (json) is left alone."""
    folder = _folder(
        tmp_path, {"hrl_fake_mod": "hrl-fake", "json": "json-dist"}, {"hrl-fake": "1.2"}
    )
    _wheel(folder / "wheels", "hrl_fake_mod", "hrl-fake", "1.2")
    code = (
        "import sys; sys.path.insert(0, '.')\n"
        "from benchmarks import _gpu_env\n"
        f"done = _gpu_env.ensure({str(folder)!r})\n"
        "import hrl_fake_mod\n"
        "print(done['installed'], done['via'], hrl_fake_mod.VALUE, hrl_fake_mod.__file__)\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert "['hrl-fake'] pip 1.2" in res.stdout
    assert f"{folder}/site-py{sys.version_info.major}{sys.version_info.minor}" in res.stdout
    again = _run(code)  # the second run finds it in the site folder: nothing to install
    assert "[] none 1.2" in again.stdout, again.stderr


@pytest.mark.unit
def test_without_pip_the_matching_wheel_is_unpacked(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {}, {"hrl-fake": "2.0"})
    _wheel(folder / "wheels", "hrl_fake_mod", "hrl-fake", "2.0")
    _wheel(folder / "wheels", "hrl_fake_mod", "hrl-fake", "1.0")  # another version: not taken
    site = tmp_path / "site"
    _gpu_env._unpack(folder / "wheels", ["hrl-fake"], {"hrl-fake": "2.0"}, site)
    assert (site / "hrl_fake_mod" / "__init__.py").read_text() == "VALUE = '2.0'\n"
    with pytest.raises(RuntimeError, match="no wheel of nope==1"):
        _gpu_env._unpack(folder / "wheels", ["nope"], {"nope": "1"}, site)


@pytest.mark.integration
def test_a_wheel_that_is_not_carried_is_a_clear_error(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"hrl_absent_mod": "hrl-absent"}, {"hrl-absent": "1.0"})
    res = _run(
        "import sys; sys.path.insert(0, '.')\n"
        "from benchmarks import _gpu_env\n"
        f"_gpu_env.ensure({str(folder)!r})\n"
    )
    assert res.returncode != 0 and "no wheel of hrl-absent==1.0" in res.stderr


@pytest.mark.integration
def test_harnessrl_from_the_checkout_without_installing_it(tmp_path: Path) -> None:
    """Without site-packages (``-S``: no installed harnessrl), harnessrl.* comes from the
    checkout's folders through a folder of symlinks, removed at exit."""
    res = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            "import sys; sys.path.insert(0, '.')\n"
            "from benchmarks import _gpu_env\n"
            "how = _gpu_env.ensure_harnessrl()\n"
            "import harnessrl.proxy.engine, harnessrl.learner\n"
            "from pathlib import Path\n"
            "print(how.split()[-1], harnessrl.proxy.engine.__file__)\n"
            "print(Path(harnessrl.proxy.engine.__file__).resolve())\n",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    ns, engine_file, resolved = res.stdout.split()
    assert engine_file == f"{ns}/harnessrl/proxy/engine/__init__.py"
    assert Path(resolved) == REPO / "proxy" / "engine" / "__init__.py"
    assert not Path(ns).exists()  # cleaned up at exit
    assert (REPO / "proxy" / "engine" / "__init__.py").exists()  # the targets untouched

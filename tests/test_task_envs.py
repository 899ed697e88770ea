"""Task environments: how tasks and suites declare them, how the sandbox backends build them
(once per content, cached; concurrent first use builds once) and provide them, and a
ClawGym task that needs one.

That task is in ClawGym folder format: its prompt has the agent run ``python -m
pytest`` on tests that import pandas, and its checker runs them again and imports pandas. With
its environment (the built-in ``clawgym``) a correct answer scores 1.0, in the bwrap and the
docker backend; in the base userland (no ``python`` command, no pytest, no pandas) the same
answer cannot even be produced, and verifying it is an ``environment`` failure (tombstoned),
never a score.

Environments are built into the default cache (``$HARNESSRL_CACHE/envs``), so the ``clawgym``
build (~40 s on two busy cores; its first use downloads ~35 MB of wheels) is paid once per
machine, the docker image once per session engine. The docker tests use the session's private
dockerd (tests/conftest.py) and skip where dockerd cannot run, as tests/test_sandbox_docker.py
does.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from harnessrl.actors.sandbox import SandboxError, SandboxSpec
from harnessrl.actors.sandbox.bwrap import BwrapBackend
from harnessrl.actors.sandbox.docker import DockerBackend
from harnessrl.actors.sandbox.envs import ENV_BIN, ENV_INFO, Target, with_env_path
from harnessrl.actors.verifier import CheckerError, run_solution, verify
from harnessrl.common import cli
from harnessrl.common.tasks import CLAWGYM_MOUNT, TaskEnv, TaskError, import_any, load_task_path
from harnessrl.common.tasks.environments import (
    BUILTIN_ENVS,
    CLAWGYM_ENV,
    EnvironmentToml,
    environment_table,
)
from harnessrl.common.tasks.formats import NativeToml
from harnessrl.common.tasks.registry import SuiteToml, list_tasks, load_task
from tests.helpers.sandboxes import bwrap_or_skip
from tests.treefiles import write

REPO = Path(__file__).resolve().parents[1]
M = CLAWGYM_MOUNT


def native(root: Path, env_table: str = "", task_id: str | None = None) -> Path:
    toml = f'id = "{task_id or root.name}"\ninstruction = "Write out.txt."\n{env_table}'
    return write(
        root,
        {
            "task.toml": toml,
            "reward/test.py": 'import json; print(json.dumps({"ok": 1.0}))\n',
        },
    )


# ---------------------------------------------------------------------- declaring


@pytest.mark.unit
def test_task_toml_environment_table(tmp_path: Path):
    """``[environment]`` starts from a built-in, adds and replaces pip packages, overrides the
    python alias; the task hash covers the environment."""
    t = load_task_path(
        native(
            tmp_path / "t",
            '[environment]\nname = "clawgym"\npip = ["openpyxl==3.1.5", "pandas==2.2.3"]\n'
            "python_alias = false\n",
        )
    )
    env = t.environment
    assert env is not None and env.name == "clawgym" and env.python_alias is False
    assert "openpyxl==3.1.5" in env.pip and "pandas==2.2.3" in env.pip
    assert "pandas==2.3.3" not in env.pip and "pytest==8.4.2" in env.pip
    plain = load_task_path(native(tmp_path / "p", task_id="t"))
    assert plain.environment is None
    assert t.summary()["environment"] == "clawgym" and plain.summary()["environment"] == ""
    base = load_task_path(native(tmp_path / "b", '[environment]\nname = "base"\n', "t"))
    assert base.environment == BUILTIN_ENVS["base"] and base.environment.empty
    assert len({t.task_hash, plain.task_hash, base.task_hash}) == 3


@pytest.mark.unit
@pytest.mark.parametrize(
    ("table", "field", "needle"),
    [
        ('name = "conda"', "environment.name", "unknown environment 'conda'"),
        ('pip = ["foo @ https://example.com/foo.whl"]', "environment.pip", "not a pip req"),
        ('pip = ["--index-url=http://mirror"]', "environment.pip", "not a pip requirement"),
        ("pip = [\"pandas; python_version < '3'\"]", "environment.pip", "markers"),
        ('pip = ["pandas==2.2.3", "Pandas>=2"]', "environment.pip", "'pandas' is required twice"),
        ('pip = "pandas"', "environment.pip", "valid list"),
        ("pyhton_alias = true", "environment.pyhton_alias", "unknown field"),
    ],
)
def test_bad_environment_table_names_the_field(tmp_path: Path, table: str, field: str, needle):
    """A bad ``[environment]`` is a TaskError naming the file and the field, never a crash."""
    root = native(tmp_path / "t", f"[environment]\n{table}\n")
    with pytest.raises(TaskError) as e:
        load_task_path(root)
    msg = str(e.value)
    assert f"field '{field}'" in msg and needle in msg and str(root / "task.toml") in msg


@pytest.mark.unit
def test_env_key_is_content():
    """The build key depends on what is installed, not on names or order; the table written
    for an environment resolves back to it."""
    a = TaskEnv(name="a", python_alias=True, pip=["six==1.17.0", "idna==3.20"])
    b = TaskEnv(name="b", python_alias=True, pip=["idna==3.20", "six==1.17.0"])
    assert a.key() == b.key() != TaskEnv(name="a", pip=a.pip).key()
    assert a.key() != TaskEnv(name="a", python_alias=True, pip=["six==1.16.0", "idna==3.20"]).key()
    with pytest.raises(ValueError, match="required twice"):
        TaskEnv(pip=["six==1", "Six==2"])
    for env in (
        CLAWGYM_ENV,
        EnvironmentToml(name="clawgym", pip=["pandas==2.2.3", "x==1"]).resolve(),
        EnvironmentToml(name="base", python_alias=True).resolve(),
    ):
        again = EnvironmentToml.model_validate(environment_table(env)).resolve()
        assert again.key() == env.key() and again.name == env.name
    assert environment_table(CLAWGYM_ENV) == {"name": "clawgym"}


@pytest.mark.unit
def test_clawgym_tasks_get_the_clawgym_environment(tmp_path: Path):
    """A ClawGym folder loads with the ``clawgym`` environment (python alias, pytest, pandas,
    requests); ``tasks import`` of ClawGym folders and JSONL writes native tasks that declare
    it."""
    assert CLAWGYM_ENV.python_alias
    projects = {r.split("==")[0] for r in CLAWGYM_ENV.pip}
    assert {"pytest", "pandas", "requests", "flask", "pyyaml"} <= projects
    assert all("==" in r for r in CLAWGYM_ENV.pip)  # pinned, dependencies included
    folder = acceptance_task(tmp_path / "src" / "pandas_pytest")
    t = load_task_path(folder)
    assert t.format == "clawgym" and t.environment == CLAWGYM_ENV
    rep = import_any(tmp_path / "src", tmp_path / "out")
    (written,) = rep.written
    assert '[environment]\nname = "clawgym"' in (written / "task.toml").read_text()
    assert load_task_path(written).environment == CLAWGYM_ENV
    record = {
        "prompt": "Run python make.py.",
        "input_files": [{"file_path": "reward/test.py", "content": "print('{}')\n"}],
    }
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(record) + "\n")
    (jl,) = import_any(src, tmp_path / "out-jsonl").written
    assert load_task_path(jl).environment == CLAWGYM_ENV


@pytest.mark.unit
def test_suite_toml_environment(tmp_path: Path):
    """``suite.toml``'s environment applies to the suite's tasks that declare none, whichever
    way they are loaded (with the same hash) and to what ``tasks import`` makes of them; a
    task's own declaration wins; a bad suite.toml names its field."""
    suite = tmp_path / "suite"
    native(suite / "plain")
    native(suite / "own", '[environment]\nname = "clawgym"\n')
    write(suite, {"suite.toml": '[environment]\nname = "base"\npython_alias = true\n'})
    by_id = {t.id: t for t in list_tasks(str(suite))}
    assert by_id["plain"].environment == TaskEnv(name="base", python_alias=True)
    assert by_id["own"].environment == CLAWGYM_ENV
    for tid, t in by_id.items():
        for other in (load_task(str(suite), tid), load_task_path(suite / tid)):
            assert (other.environment, other.task_hash) == (t.environment, t.task_hash)
    assert by_id["plain"].task_hash != load_task_path(native(tmp_path / "plain")).task_hash
    (out,) = [p for p in import_any(suite, tmp_path / "out").written if p.name == "plain"]
    assert load_task_path(out).environment == TaskEnv(name="base", python_alias=True)
    write(suite, {"suite.toml": '[environment]\npip = ["a b"]\n'})
    with pytest.raises(TaskError, match=r"suite\.toml: field 'environment\.pip'"):
        list_tasks(str(suite))
    with pytest.raises(TaskError, match=r"suite\.toml: field 'environment\.pip'"):
        import_any(suite, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


@pytest.mark.unit
def test_tasks_show_prints_the_environment(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "tasks", cli.Command("tasks", "harnessrl.actors.tasks_cmd"))
    assert cli.main(["tasks", "show", str(acceptance_task(tmp_path / "t"))]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("environment"))
    assert "clawgym (python alias, 24 pip packages: pytest==8.4.2" in line


@pytest.mark.unit
def test_pip_flags_follow_the_target():
    """Wheels are chosen for the sandbox's interpreter (version, ABI, libc), not the host's."""
    t = Target("3.11", "cpython", "glibc", "2.36", "x86_64")
    flags = t.pip_flags()
    assert flags[:3] == ["--only-binary=:all:", "--python-version", "3.11"]
    plats = [flags[i + 1] for i, f in enumerate(flags) if f == "--platform"]
    assert {"manylinux_2_36_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(plats)
    assert "manylinux_2_37_x86_64" not in plats and "cp311" in flags
    with pytest.raises(SandboxError, match="CPython"):
        Target("3.10", "pypy", "glibc", "2.36", "x86_64").pip_flags()
    with pytest.raises(SandboxError, match="probe"):
        Target.parse("garbage")
    assert with_env_path("/usr/bin:/opt/hrl/env/bin:/bin") == f"{ENV_BIN}:/usr/bin:/bin"


# ---------------------------------------------------------------------- building (bwrap)

ALIAS_ONLY = TaskEnv(name="alias-only", python_alias=True)
"""An environment that needs no download: a venv with a ``python`` command."""


@pytest.mark.integration
async def test_environment_in_bwrap(tmp_path: Path):
    """With an environment, every command has ``python``, its venv first on PATH (also when
    the caller sets PATH), read-only; without one there is no ``python``."""
    be = await bwrap_or_skip(tmp_path / "sb", env_cache_dir=tmp_path / "envs")
    async with be:
        async with await be.create(SandboxSpec(environment=ALIAS_ONLY)) as sb:
            r = await sb.run(["python", "-c", "import sys; print(sys.prefix)"], timeout=30)
            assert r.ok and r.stdout == b"/opt/hrl/env\n", r
            r = await sb.run(
                ["sh", "-c", "command -v python3; touch /opt/hrl/env/x"],
                env={"PATH": "/usr/bin:/bin"},
                timeout=30,
            )
            assert r.stdout == b"/opt/hrl/env/bin/python3\n" and r.returncode != 0
            assert b"Read-only file system" in r.stderr
            info = json.loads((await sb.run(["cat", f"/opt/hrl/env/{ENV_INFO}"])).stdout)
            assert info["name"] == "alias-only" and info["python_alias"] is True
        async with await be.create(SandboxSpec()) as sb:
            r = await sb.run(["sh", "-c", "command -v python || echo none"], timeout=30)
            assert r.stdout == b"none\n"
        async with await be.create(SandboxSpec(environment=BUILTIN_ENVS["base"])) as sb:
            assert sb.env_dir is None  # an empty environment is no build and no mount
        assert be.env_builds == 1
        async with await be.create(SandboxSpec(environment=ALIAS_ONLY)) as sb:
            built = sb.env_dir
        shutil.rmtree(built.parent)  # the cache cleaned under a running backend: rebuilt
        async with await be.create(SandboxSpec(environment=ALIAS_ONLY)) as sb:
            assert (await sb.run(["python", "-c", "pass"], timeout=30)).ok
        assert be.env_builds == 2 and sb.env_dir == built


@pytest.mark.integration
async def test_concurrent_first_use_builds_once(tmp_path: Path):
    """Two backends and another process asking for the same new environment at once: one
    build (file lock), everyone gets the same folder, nothing half-built is left."""
    cache = tmp_path / "envs"
    a = await bwrap_or_skip(tmp_path / "a", env_cache_dir=cache)
    b = BwrapBackend(tmp_path / "b", env_cache_dir=cache)
    env = TaskEnv(name="race", python_alias=True)
    code = (
        "import asyncio, sys\n"
        "from harnessrl.actors.sandbox.bwrap import BwrapBackend\n"
        "from harnessrl.common.tasks.model import TaskEnv\n"
        "async def main():\n"
        "    be = BwrapBackend(sys.argv[1], env_cache_dir=sys.argv[2])\n"
        "    d = await be.environment(TaskEnv(name='race', python_alias=True))\n"
        "    print(be.env_builds, d)\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        str(tmp_path / "c"),
        str(cache),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    dirs = await asyncio.gather(a.environment(env), b.environment(env), a.environment(env))
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    builds, other = out.decode().split()
    assert len({*dirs, Path(other)}) == 1
    assert a.env_builds + b.env_builds + int(builds) == 1
    made = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    assert len(made) == 1 and made[0].startswith("bwrap-race-")


@pytest.mark.integration
async def test_unbuildable_environment_fails_create(tmp_path: Path, monkeypatch):
    """A package that cannot be had fails sandbox creation with a SandboxError naming the
    environment and pip's reason; the failure is remembered (the next create fails at once,
    without another download) and leaves nothing in the cache."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    env = TaskEnv(name="broken", pip=["no-such-project-hrl==0.0.1"])
    be = await bwrap_or_skip(tmp_path / "sb", env_cache_dir=tmp_path / "envs")
    async with be:
        with pytest.raises(SandboxError) as e:
            await be.create(SandboxSpec(environment=env))
        assert "environment 'broken'" in str(e.value) and "pip download" in str(e.value)
        assert "no-such-project-hrl" in str(e.value)
        t0 = time.monotonic()
        with pytest.raises(SandboxError, match="broken"):
            await be.create(SandboxSpec(environment=env))
        assert time.monotonic() - t0 < 1.0
        assert not be._live
    left = [p.name for p in (tmp_path / "envs").iterdir() if not p.name.endswith(".lock")]
    assert left == []


@pytest.mark.unit
def test_rollout_settings_reach_the_backend(tmp_path: Path):
    """``env_cache_dir`` reaches the backend; the new config and schema fields are documented."""
    from harnessrl.actors.config import RolloutSettings
    from harnessrl.actors.rollout import make_sandbox_backend
    from harnessrl.common.config import undocumented_fields

    be = make_sandbox_backend(RolloutSettings(env_cache_dir=tmp_path / "e"))
    assert be.env_cache_dir == tmp_path / "e"
    assert RolloutSettings().task_environments is True
    for model in (RolloutSettings, TaskEnv, EnvironmentToml, SuiteToml, NativeToml):
        assert undocumented_fields(model) == [], model


# ---------------------------------------------------------------------- the acceptance task

QUERY = """\
`sales.csv` lists orders (region, amount). Write `report.py` with a function `totals(path)`
that reads the CSV with pandas and returns a dict mapping each region to its total amount;
running `python report.py` must write those totals to `totals.json`. The tests in
`tests/test_report.py` must pass: run `python -m pytest -q tests` before you finish.
"""
SALES = "region,amount\neast,10\nwest,5.5\neast,20\n"
TESTS = """\
import pandas as pd

from report import totals


def test_totals():
    assert totals("sales.csv") == {"east": 30.0, "west": 5.5}


def test_agrees_with_pandas():
    df = pd.read_csv("sales.csv")
    assert totals("sales.csv") == df.groupby("region")["amount"].sum().to_dict()
"""
REWARD_SH = f"""\
#!/usr/bin/env bash
set -o pipefail
python3 {M}/reward/check.py {M} | python3 -c 'import json, sys; d = json.load(sys.stdin); print(sum(d.values()) / len(d))'
"""
CHECK_PY = """\
import json, os, subprocess, sys

import pandas as pd

ws = sys.argv[1]
run = subprocess.run(
    ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
    cwd=ws, capture_output=True, text=True,
)
expected = pd.read_csv(os.path.join(ws, "sales.csv")).groupby("region")["amount"].sum()
try:
    with open(os.path.join(ws, "totals.json")) as f:
        got = json.load(f)
except Exception:
    got = None
print(json.dumps({
    "tests_pass": float(run.returncode == 0),
    "totals_right": float(got == expected.to_dict()),
}))
"""
REPORT_PY = """\
import json

import pandas as pd


def totals(path):
    df = pd.read_csv(path)
    return {k: float(v) for k, v in df.groupby("region")["amount"].sum().items()}


if __name__ == "__main__":
    with open("totals.json", "w") as f:
        json.dump(totals("sales.csv"), f)
"""
SOLVE_SH = f"""\
set -e
cat > report.py <<'EOF'
{REPORT_PY}EOF
python report.py
python -m pytest -q -p no:cacheprovider tests
"""


def acceptance_task(root: Path) -> Path:
    """The ClawGym-format folder: prompt with ``python -m pytest``, pandas in tests and
    checker, ``reward.sh`` + ``check.py``, and a reference solution that does what an agent
    would (writes report.py, runs it and the tests with ``python``)."""
    entry = {"task_id": root.name, "user_query": QUERY, "input_mount_dir": M}
    return write(
        root,
        {
            "data_entry.json": json.dumps(entry),
            "input_files/sales.csv": SALES,
            "input_files/tests/test_report.py": TESTS,
            "reward/reward.sh": REWARD_SH,
            "reward/check.py": CHECK_PY,
            "solution/solve.sh": SOLVE_SH,
        },
    )


@pytest.fixture(params=["bwrap", "docker"])
def backend_kind(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """``(kind, docker engine URL)``; the docker engine is the session's (skips without)."""
    if request.param == "docker":
        return "docker", request.getfixturevalue("docker_engine")
    return "bwrap", None


@pytest.fixture
async def env_backend(backend_kind, tmp_path: Path):
    """A started backend of each kind over the default environment cache."""
    kind, url = backend_kind
    if kind == "bwrap":
        be = await bwrap_or_skip(tmp_path / "sandboxes")
    else:
        be = DockerBackend(tmp_path / "sandboxes", docker_url=url)
    async with be:
        yield be


def spec_for(task, environment) -> SandboxSpec:
    return SandboxSpec(
        workspace_src=task.workspace_dir, workdir=task.mount, environment=environment
    )


@pytest.mark.integration
async def test_pytest_pandas_task_scores_1_with_its_environment(
    env_backend, tmp_path: Path, record_property
):
    """Acceptance: the ClawGym task that runs ``python -m pytest`` and imports pandas scores
    1.0 for a correct answer in its environment (in bwrap and in docker); pytest is a command
    too. The first use builds the environment (timed)."""
    task = load_task_path(acceptance_task(tmp_path / "pandas_pytest"))
    assert task.environment == CLAWGYM_ENV
    t0 = time.monotonic()
    async with await env_backend.create(spec_for(task, task.environment)) as sb:
        took = time.monotonic() - t0
        record_property("env_create_s", round(took, 1))
        print(
            f"\n{env_backend.name}: clawgym sandbox created in {took:.1f} s "
            f"({env_backend.env_builds} build)"
        )
        r = await sb.run(["pytest", "--version"], timeout=120)
        assert r.ok and b"pytest 8.4.2" in r.stdout + r.stderr, r
        untouched = await verify(task, sb)
        assert untouched.status == "ok" and untouched.reward == 0.0, untouched
        await run_solution(task, sb, timeout=300)
        res = await verify(task, sb)
    assert res.status == "ok", res
    assert res.reward == 1.0 and res.metrics == {"tests_pass": 1.0, "totals_right": 1.0}, res


@pytest.mark.integration
async def test_pytest_pandas_task_fails_in_the_base_environment(env_backend, tmp_path: Path):
    """Negative control: in the base userland the agent's ``python`` does not exist (the
    reference solution exits 127), and a correct answer put in by hand is an environment
    failure of the verifier (a tombstone: the checker cannot import pandas), not a score."""
    task = load_task_path(acceptance_task(tmp_path / "pandas_pytest"))
    async with await env_backend.create(spec_for(task, None)) as sb:
        with pytest.raises(CheckerError, match=r"status 127[\s\S]*python: (command )?not found"):
            await run_solution(task, sb, timeout=300)
        await sb.write_file("report.py", REPORT_PY.encode())
        await sb.write_file("totals.json", json.dumps({"east": 30.0, "west": 5.5}).encode())
        res = await verify(task, sb)
    assert res.status == "verifier_error" and res.reason == "environment", res
    assert "'pandas'" in res.error


@pytest.mark.unit
def test_install_script_runs_offline_from_the_wheelhouse():
    """The install step never reaches an index: ``--no-index`` from the mounted wheelhouse,
    with pip's configuration off."""
    from harnessrl.actors.sandbox.envs import BUILD_ENV, install_script

    script = install_script(CLAWGYM_ENV, "k")
    assert "--no-index --find-links /opt/hrl/wheels" in script
    assert "python3 -m venv --without-pip /opt/hrl/env" in script
    assert BUILD_ENV["PIP_CONFIG_FILE"] == "/dev/null"
    assert "--no-index" not in install_script(ALIAS_ONLY, "k")  # nothing to install


@pytest.mark.integration
async def test_rollout_gives_the_task_its_environment(nats_url, run_name, bwrap, tmp_path):
    """Through the rollout pipeline (command harness running the reference solution, as an
    agent would): scored 1.0 with the task's environment; with ``task_environments`` off the
    agent's ``python`` is missing, so nothing is scored as the model's."""
    from harnessrl.actors.rollout import run_rollout
    from tests.helpers.rollout import request, rollout_env

    folder = acceptance_task(tmp_path / "pandas_pytest")
    req = request(cmd='bash "$HRL_SOLUTION"', suite="", task_id=str(folder))
    async with rollout_env(nats_url, run_name, bwrap, expose_solution=True) as (deps, _, _):
        res = await run_rollout(req, 1, deps)
    assert (res.status, res.reward, res.error) == ("ok", 1.0, ""), res
    assert res.metrics == {"tests_pass": 1.0, "totals_right": 1.0}
    off = {"expose_solution": True, "task_environments": False}
    async with rollout_env(nats_url, run_name, bwrap, **off) as (deps, _, _):
        res = await run_rollout(req, 2, deps)
    assert (res.status, res.reason) == ("harness_error", "harness_exit"), res

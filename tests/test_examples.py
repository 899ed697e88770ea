"""``examples/``: each example is what its README says it is.

The examples' command blocks (lint the suite and run rollouts on it, run the ``llm`` agent as a
``command`` harness) run in ``tests/test_docs_commands.py``; here, the checks that need no
running service: the suite's checkers separate a solved workspace from an untouched one, and
the run files and snippets load and point where they say.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harnessrl.common import cli
from harnessrl.common.run.plan import Paths, Plan, resolve
from harnessrl.common.tasks.registry import list_tasks

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _validate(section: str, table: dict) -> object:
    """A run-file table validated by the config model of the process that reads it."""
    module = importlib.import_module(cli.COMMANDS[section.replace("_", "-")].module)
    return module.CONFIG.model_validate(table)


# ---------------------------------------------------------------------------------------------
# task-suite
# ---------------------------------------------------------------------------------------------


def _score(task, workspace: Path) -> dict[str, float]:
    import json

    out = subprocess.run(
        [sys.executable, str(task.reward_dir / task.checker_entry), str(workspace)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.parametrize("task_id", ["customer_totals", "release_notes"])
def test_suite_checker_scores_the_solution_1_and_the_untouched_workspace_0(
    tmp_path: Path, task_id: str
) -> None:
    """The example task's checker gives every metric 1.0 on the workspace its reference
    solution leaves and 0 on the starting workspace, and keeps its files out of the workspace."""
    tasks = {t.id: t for t in list_tasks(str(EXAMPLES / "task-suite"))}
    assert set(tasks) == {"customer_totals", "release_notes"}
    task = tasks[task_id]
    assert task.format == "native" and task.solution is not None
    assert not any(p.name in ("test.py", "expected.json") for p in task.workspace_dir.rglob("*"))

    untouched = tmp_path / "untouched"
    shutil.copytree(task.workspace_dir, untouched)
    assert set(_score(task, untouched).values()) == {0.0}

    solved = tmp_path / "solved"
    shutil.copytree(task.workspace_dir, solved)
    runner = "sh" if task.solution.suffix == ".sh" else sys.executable
    subprocess.run([runner, str(task.solution)], cwd=solved, check=True, timeout=60)
    assert set(_score(task, solved).values()) == {1.0}


# ---------------------------------------------------------------------------------------------
# command-harness
# ---------------------------------------------------------------------------------------------

HARNESS = EXAMPLES / "command-harness"


def _toml_blocks(text: str) -> list[dict]:
    return [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", text, re.DOTALL)]


@pytest.mark.unit
def test_command_harness_run_snippet_binds_what_install_makes() -> None:
    """The README's run-file snippet validates as actor and feeder config, binds the folder the
    README installs into, and its harness command runs the wrapper inside that bind; the
    wrapper runs the venv and tools that ``install.sh`` puts beside it."""
    readme = (HARNESS / "README.md").read_text()
    (snippet,) = _toml_blocks(readme)
    actor = _validate("actor", snippet["actor"])
    learner = _validate("learner", {"feeder": snippet["learner"]["feeder"]})
    ((host, inside),) = actor.harness_options["command"]["ro_binds"]
    assert learner.feeder.harnesses == ["command"]
    script = shlex.split(learner.feeder.harness_cmd)[-1]
    assert script == f"{inside}/agent.sh"
    install = re.search(r"sh examples/command-harness/install\.sh (\S+)", readme)
    assert install is not None and install.group(1) == host
    assert f'"ro_binds": [["{host}", "{inside}"]]' in readme  # the rollout's --harness-options

    agent = (HARNESS / "agent.sh").read_text()
    assert '"$HERE/venv/bin/python" -m llm' in agent and '"$HERE/tools.py"' in agent
    installer = (HARNESS / "install.sh").read_text()
    assert "/usr/bin/python3 -m venv" in installer and '"llm==' in installer
    assert 'cp "$HERE/agent.sh" "$HERE/tools.py" "$DIR/"' in installer


@pytest.mark.unit
def test_command_harness_tools_are_the_reference_agent_tool_names() -> None:
    """The agent's tools have the names and parameters of the reference harness's (what the
    scripted teacher engine calls), each with a docstring llm gives the model."""
    import ast

    from harnessrl.common.tasks.teacher import TOOLS

    tree = ast.parse((HARNESS / "tools.py").read_text())
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    for tool in TOOLS:
        fn = tool["function"]
        assert fn["name"] in funcs, fn["name"]
        params = [a.arg for a in funcs[fn["name"]].args.args]
        assert params == list(fn["parameters"]["properties"]), fn["name"]
        assert ast.get_docstring(funcs[fn["name"]])


# ---------------------------------------------------------------------------------------------
# external-engine
# ---------------------------------------------------------------------------------------------

ENGINE = EXAMPLES / "external-engine"


@pytest.mark.integration
def test_external_engine_run_file_points_where_it_says(tmp_path: Path) -> None:
    """``run.toml`` validates table by table; the actors and the learner use the model folder
    the README's SGLang command serves; the broadcast goes to the engines [run] lists, with the
    key SGLang is started with; and the plan starts no engine and no updater, while every actor
    is given every engine."""
    run_file = ENGINE / "run.toml"
    cfg, sections = resolve(argparse.Namespace(run_file=str(run_file), config=None))
    for section, table in sections.items():
        _validate(section, table)
    readme = (ENGINE / "README.md").read_text()

    model = sections["actor"]["model"]
    assert sections["learner"]["model"] == model and model.startswith("/")
    served = re.search(r"sglang\.launch_server --model-path (\S+)", readme)
    assert served is not None and served.group(1) == model
    assert f"--local-dir {model}" in readme

    bcast = sections["learner"]["broadcast"]
    assert bcast["transport"] == "distributed" and bcast["backend"] == "nccl"
    assert bcast["engines"] == cfg.engines and cfg.engines
    assert not cfg.weights_sync
    assert bcast["engine_api_key_file"] == cfg.engine_api_key_file
    assert f'--api-key "$(cat {cfg.engine_api_key_file})"' in readme
    port = cfg.engines[0].rsplit(":", 1)[1]
    assert f"--port {port}" in readme

    plan = Plan(cfg.model_copy(update={"out": tmp_path / "run"}), sections, Paths(tmp_path))
    roles = {spec.role for phase in plan.specs().values() for spec in phase}
    assert "engine" not in roles and "weights_sync" not in roles
    argv = plan.actor_argv(0)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--engine"] == cfg.engines

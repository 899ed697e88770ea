"""What each harness receives when a rollout launches it: its argv, environment, working folder,
stdin and the config files in its home, as recorded by the harness program itself.

Each npm/pip harness is installed (faked) as a program that records what it was started with
into the workspace; the rollout around it is real (``run_rollout``: the adapter, a bubblewrap
sandbox, the launch files, the proxy) and keeps the workspace, where the record is read. The
task's instruction starts with ``--`` and carries quotes and ``$HOME``, so it must reach each
harness as its task, never as a flag nor expanded by a shell."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

from harnessrl.actors.harnesses._platform import rust_triple
from harnessrl.actors.rollout import run_rollout
from harnessrl.common.tasks import load_task
from tests.helpers.harnesses import ARCH, fake_installs
from tests.helpers.rollout import request, rollout_env

pytestmark = pytest.mark.integration

INSTRUCTION = "-- Fix the bug in main.py: don't \"quote\" $HOME or 'this'."
PROXY = "http://127.0.0.1:18080"
MODEL = "harnessrl"  # the model name the proxy serves (RolloutSettings.model_name)
MOUNT = "/opt/hrl/harnesses"
RECORD = "launch-record.json"

RECORDER = f"""#!/usr/bin/python3
import json, os, sys
home, files = os.environ.get("HOME", "/"), {{}}
for root, _dirs, names in os.walk(home):
    for name in names:
        path = os.path.join(root, name)
        with open(path, errors="replace") as f:
            files[path] = f.read()
record = {{"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
          "stdin": sys.stdin.read(), "files": files}}
with open("/workspace/{RECORD}", "w") as f:
    json.dump(record, f)
"""


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    """The toy copy task with the instruction above."""
    src = load_task("toy", "copy_01").workspace_dir.parent
    dst = tmp_path / "task"
    shutil.copytree(src, dst)
    toml = (dst / "task.toml").read_text().splitlines()
    toml = [
        f"instruction = {json.dumps(INSTRUCTION)}" if ln.startswith("instruction") else ln
        for ln in toml
    ]
    (dst / "task.toml").write_text("\n".join(toml) + "\n")
    return dst


async def launch(
    harness: str,
    nats_url: str,
    run_name: str,
    backend,
    task_dir: Path,
    tmp_path: Path,
    options: dict | None = None,
    cmd: str = "",
) -> dict[str, Any]:
    """One rollout of the task through ``harness`` (recording, installed in a fresh cache); what
    the harness program recorded."""
    cache = fake_installs(tmp_path / "cache", RECORDER)
    settings = dict(
        harness_cache_dir=cache,
        context_window=32768,
        max_turns=7,
        harness_options={harness: options or {}},
    )
    kept = tmp_path / "kept"
    req = request(harness, cmd, suite="", task_id=str(task_dir))
    async with rollout_env(nats_url, run_name, backend, **settings) as (deps, _eng, _bus):
        res = await run_rollout(req, 1, deps, keep_workspace=kept)
    assert (kept / RECORD).exists(), res
    return json.loads((kept / RECORD).read_text())


def value(argv: list[str], flag: str, nth: int = 0) -> str:
    """The argument after the ``nth`` occurrence of ``flag``."""
    at = [i for i, a in enumerate(argv) if a == flag][nth]
    return argv[at + 1]


def token_of(rec: dict, key: str) -> str:
    """The rollout's proxy token, found under env ``key``; never on the command line."""
    token = rec["env"][key]
    assert token.startswith("hrl-") and len(token) > 20, token
    assert not any(token in a for a in rec["argv"])
    return token


def common_checks(rec: dict) -> None:
    assert rec["cwd"] == "/workspace"
    assert rec["env"]["HOME"] == "/home/hrl"
    assert rec["env"]["HRL_CONTEXT_WINDOW"] == "32768"


async def test_claude_code(nats_url, run_name, backend, task_dir, tmp_path):
    """Claude Code: print mode with the task on stdin, permissions skipped, the model, turns and
    the context window; the Anthropic endpoint and key of the proxy, telemetry off."""
    rec = await launch("claude-code", nats_url, run_name, backend, task_dir, tmp_path)
    argv, env = rec["argv"], rec["env"]
    assert (
        argv[0] == f"{MOUNT}/claude-code/node_modules/@anthropic-ai/claude-code-linux-{ARCH}/claude"
    )
    assert {"-p", "--dangerously-skip-permissions", "--bare"} <= set(argv)
    assert (value(argv, "--model"), value(argv, "--max-turns")) == (MODEL, "7")
    assert value(argv, "--output-format") == "json"
    assert rec["stdin"] == INSTRUCTION and INSTRUCTION not in argv
    assert env["ANTHROPIC_BASE_URL"] == PROXY
    token_of(rec, "ANTHROPIC_API_KEY")
    for k in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_TELEMETRY", "IS_SANDBOX"):
        assert env[k] == "1", k
    assert env["DISABLE_AUTOUPDATER"] == env["DISABLE_ERROR_REPORTING"] == "1"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    common_checks(rec)


async def test_codex(nats_url, run_name, backend, task_dir, tmp_path):
    """Codex: ``exec`` in the workspace with the task on stdin, no approvals; a config.toml in
    its home naming a Responses provider at the proxy, the key in the environment only."""
    rec = await launch("codex", nats_url, run_name, backend, task_dir, tmp_path)
    argv, env = rec["argv"], rec["env"]
    vendor = f"{MOUNT}/codex/node_modules/@openai/codex-linux-{ARCH}/vendor/{rust_triple()}"
    assert argv[0] == f"{vendor}/bin/codex" and argv[1] == "exec"
    assert {"--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"} <= set(argv)
    assert value(argv, "-C") == "/workspace" and argv[-1] == "-"
    assert rec["stdin"] == INSTRUCTION
    token = token_of(rec, "HRL_API_KEY")
    assert env["CODEX_HOME"] == "/home/hrl/.codex"
    assert env["PATH"].startswith(f"{vendor}/codex-path:")
    text = rec["files"]["/home/hrl/.codex/config.toml"]
    cfg = tomllib.loads(text)
    assert (cfg["model"], cfg["model_provider"]) == (MODEL, "hrl")
    assert (cfg["approval_policy"], cfg["sandbox_mode"]) == ("never", "danger-full-access")
    assert cfg["model_context_window"] == 32768
    assert cfg["model_auto_compact_token_limit"] == 32768 - 32768 // 4
    assert cfg["analytics"] == {"enabled": False}
    assert cfg["model_providers"]["hrl"] == {
        "name": "harnessrl",
        "base_url": f"{PROXY}/v1",
        "env_key": "HRL_API_KEY",
        "wire_api": "responses",
    }
    assert token not in text
    common_checks(rec)


async def test_mini_swe_agent(nats_url, run_name, backend, task_dir, tmp_path):
    """mini-swe-agent: its venv's python runs the CLI with the task as ``-t``; its config file
    names the proxy's endpoint and key, the step limit and the command timeout."""
    opts = {"command_timeout": 30}
    rec = await launch("mini-swe-agent", nats_url, run_name, backend, task_dir, tmp_path, opts)
    argv, env = rec["argv"], rec["env"]
    assert argv[:3] == [f"{MOUNT}/mini-swe-agent/venv/bin/python", "-m", "minisweagent.run.mini"]
    assert value(argv, "-m", 1) == f"openai/{MODEL}"
    assert value(argv, "-t") == INSTRUCTION
    path = "/home/hrl/.config/mini-swe-agent/hrl.yaml"
    assert (value(argv, "-c"), value(argv, "-c", 1)) == ("mini.yaml", path)
    cfg = json.loads(rec["files"][path])
    assert cfg["model"]["model_kwargs"]["api_base"] == f"{PROXY}/v1"
    assert cfg["model"]["model_kwargs"]["api_key"].startswith("hrl-")
    assert cfg["agent"] == {"cost_limit": 0, "step_limit": 7}
    assert cfg["environment"] == {"cwd": "/workspace", "timeout": 30}
    assert env["MSWEA_CONFIGURED"] == "true" and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert rec["stdin"] == ""
    common_checks(rec)


async def test_opencode(nats_url, run_name, backend, task_dir, tmp_path):
    """opencode: ``run`` with the model of an openai-compatible provider at the proxy (from the
    config file its environment names) and the task after ``--``."""
    rec = await launch("opencode", nats_url, run_name, backend, task_dir, tmp_path)
    argv, env = rec["argv"], rec["env"]
    assert argv[0] == f"{MOUNT}/opencode/node_modules/opencode-linux-{ARCH}/bin/opencode"
    assert argv[1] == "run" and value(argv, "-m") == f"hrl/{MODEL}"
    assert argv[-2:] == ["--", INSTRUCTION]
    assert env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    cfg = json.loads(rec["files"][env["OPENCODE_CONFIG"]])
    prov = cfg["provider"]["hrl"]
    assert prov["npm"] == "@ai-sdk/openai-compatible"
    assert prov["options"]["baseURL"] == f"{PROXY}/v1"
    assert prov["options"]["apiKey"].startswith("hrl-")
    assert prov["models"][MODEL]["limit"]["context"] == 32768
    assert cfg["model"] == f"hrl/{MODEL}"
    common_checks(rec)


async def test_openclaw(nats_url, run_name, backend, task_dir, tmp_path):
    """OpenClaw: its own Node runs ``openclaw.mjs agent exec`` with the task on stdin and the
    rollout's timeout; its JSON5 config names the proxy's chat endpoint and denies the session
    tools."""
    rec = await launch("openclaw", nats_url, run_name, backend, task_dir, tmp_path)
    argv = rec["argv"]
    node = f"{MOUNT}/openclaw/node_modules"
    assert argv[:4] == [f"{node}/node-linux-{ARCH}/bin/node", f"{node}/openclaw/openclaw.mjs"] + [
        "agent",
        "exec",
    ]
    assert argv[-2:] == ["--message-file", "-"] and rec["stdin"] == INSTRUCTION
    assert value(argv, "--timeout") == "300"
    cfg = json.loads(rec["files"]["/home/hrl/.openclaw/hrl.json5"])
    prov = cfg["models"]["providers"]["hrl"]
    assert (prov["api"], prov["baseUrl"]) == ("openai-completions", f"{PROXY}/v1")
    assert prov["apiKey"].startswith("hrl-")
    assert prov["models"][0]["id"] == MODEL
    assert cfg["agents"]["defaults"]["model"]["primary"] == f"hrl/{MODEL}"
    assert cfg["tools"]["deny"] == ["process", "sessions_spawn", "sessions_yield"]
    common_checks(rec)


async def test_command(nats_url, run_name, backend, task_dir, tmp_path):
    """command: the user's command line through ``sh -c`` (its quoting honoured), the proxy's
    URLs and the token in the usual variables, the task in the environment and a file."""
    rec_dir = tmp_path / "rec"
    rec_dir.mkdir()
    (rec_dir / "record").write_text(RECORDER)
    (rec_dir / "record").chmod(0o755)
    opts = {"ro_binds": [[str(rec_dir), "/opt/rec"]]}
    rec = await launch(
        "command", nats_url, run_name, backend, task_dir, tmp_path, opts,
        cmd="/opt/rec/record one 'two words' \"$HRL_CONTEXT_WINDOW\"",
    )  # fmt: skip
    env = rec["env"]
    assert rec["argv"] == ["/opt/rec/record", "one", "two words", "32768"]
    assert env["OPENAI_BASE_URL"] == f"{PROXY}/v1" and env["ANTHROPIC_BASE_URL"] == PROXY
    assert token_of(rec, "OPENAI_API_KEY") == env["ANTHROPIC_API_KEY"]
    assert env["HRL_INSTRUCTION"] == INSTRUCTION
    assert rec["files"][env["HRL_INSTRUCTION_FILE"]] == INSTRUCTION
    common_checks(rec)

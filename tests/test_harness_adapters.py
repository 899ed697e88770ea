"""Harness adapters without running the harnesses: launch specs, installs, the registry, CLI.

Installed harnesses are faked by a manifest plus empty files at the paths each adapter looks
for; the real installs are exercised in ``test_harness_real.py``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from harnessrl.actors.harnesses import (
    ADAPTERS,
    HarnessContext,
    HarnessNotInstalled,
    LaunchSpec,
    get_adapter,
    list_adapters,
)
from harnessrl.actors.harnesses._platform import npm_arch, rust_triple
from harnessrl.actors.harnesses.base import MANIFEST, locked_install, read_manifest

TOKEN = "tok-SECRET-rollout"
ARCH = npm_arch()
FAKE_FILES = {
    "claude-code": [f"node_modules/@anthropic-ai/claude-code-linux-{ARCH}/claude"],
    "codex": [f"node_modules/@openai/codex-linux-{ARCH}/vendor/{rust_triple()}/bin/codex"],
    "mini-swe-agent": ["venv/bin/python"],
    "opencode": [f"node_modules/opencode-linux-{ARCH}/bin/opencode"],
    "openclaw": [
        f"node_modules/node-linux-{ARCH}/bin/node",
        "node_modules/openclaw/openclaw.mjs",
    ],
}


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache dir where every npm/pip harness looks installed."""
    for name, files in FAKE_FILES.items():
        root = tmp_path / name
        for rel in files:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).touch()
        (root / MANIFEST).write_text(json.dumps({"name": name, "version": "9.9.9"}))
    return tmp_path


def ctx_for(cache: Path, **kw) -> HarnessContext:
    base = dict(
        instruction="-- Fix the bug in main.py",
        token=TOKEN,
        model="qwen-tiny",
        proxy_url="http://127.0.0.1:18080",
        workspace="/workspace",
        home="/home/hrl",
        max_turns=7,
        timeout_s=123.0,
        cache_dir=cache,
    )
    return HarnessContext(**(base | kw))


def prepare(name: str, cache: Path, **kw) -> LaunchSpec:
    return get_adapter(name).prepare(ctx_for(cache, **kw))


def test_registry_lists_every_builtin():
    """The registry knows the seven built-in harnesses; an unknown name says which exist."""
    assert (
        [a.name for a in list_adapters()]
        == list(ADAPTERS)
        == [
            "reference",
            "claude-code",
            "codex",
            "mini-swe-agent",
            "opencode",
            "openclaw",
            "command",
        ]
    )
    assert {a.name: a.api for a in list_adapters()} == {
        "reference": "chat",
        "claude-code": "messages",
        "codex": "responses",
        "mini-swe-agent": "chat",
        "opencode": "chat",
        "openclaw": "chat",
        "command": "any",
    }
    with pytest.raises(KeyError, match="known: reference"):
        get_adapter("cursor")


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_spec_invariants(name: str, cache: Path):
    """Token only in env/files, cwd/timeout from the context, files inside home, ctx.env last."""
    opts = {"command": "python3 solve.py"} if name == "command" else {}
    spec = prepare(name, cache, options=opts, env={"EXTRA": "1", "HOME": "/home/hrl"})
    assert TOKEN not in " ".join(spec.argv)
    assert TOKEN in json.dumps(spec.env) + json.dumps(spec.files)
    assert spec.cwd == "/workspace" and spec.timeout_s == 123.0
    assert spec.env["EXTRA"] == "1" and spec.env["HOME"] == "/home/hrl"
    assert all(p.startswith("/home/hrl/") for p in spec.files)
    for host, inside in spec.ro_binds:
        assert Path(host).exists() and inside.startswith("/")
    assert "***" in json.dumps(spec.redacted(TOKEN)) and TOKEN not in json.dumps(
        spec.redacted(TOKEN)
    )


@pytest.mark.parametrize("name", list(FAKE_FILES))
def test_not_installed_is_a_clear_error(name: str, tmp_path: Path):
    """prepare() on an empty cache says how to install."""
    adapter = get_adapter(name)
    assert not adapter.is_installed(tmp_path)
    with pytest.raises(HarnessNotInstalled, match=f"harnessrl harness install {name}"):
        adapter.prepare(ctx_for(tmp_path))


def test_claude_code_spec(cache: Path):
    """Claude Code: native binary, -p with the task on stdin, the documented environment."""
    spec = prepare("claude-code", cache, context_window=32768)
    mount = "/opt/hrl/harnesses/claude-code"
    assert spec.argv == [
        f"{mount}/node_modules/@anthropic-ai/claude-code-linux-{ARCH}/claude",
        "-p",
        "--dangerously-skip-permissions",
        "--model",
        "qwen-tiny",
        "--output-format",
        "json",
        "--bare",
        "--max-turns",
        "7",
    ]
    assert spec.stdin == b"-- Fix the bug in main.py"
    assert spec.api == "messages"
    assert spec.ro_binds == [(cache / "claude-code", mount)]
    env = spec.env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:18080"
    assert env["ANTHROPIC_API_KEY"] == TOKEN
    for k in (
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "DISABLE_TELEMETRY",
        "DISABLE_AUTOUPDATER",
        "DISABLE_ERROR_REPORTING",
        "IS_SANDBOX",
    ):
        assert env[k] == "1"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert env["HOME"] == "/home/hrl"


def test_claude_code_options(cache: Path):
    """bare off, stream-json (+ --verbose), retries and extra args."""
    spec = prepare(
        "claude-code",
        cache,
        max_turns=None,
        options={
            "bare": False,
            "output_format": "stream-json",
            "max_retries": 3,
            "extra_args": ["--foo"],
        },
    )
    assert "--bare" not in spec.argv and "--max-turns" not in spec.argv
    assert spec.argv[-3:] == ["stream-json", "--verbose", "--foo"]
    assert spec.env["CLAUDE_CODE_MAX_RETRIES"] == "3"


def test_codex_spec(cache: Path):
    """Codex: config.toml with a Responses provider at the proxy; key from env; task on stdin."""
    spec = prepare("codex", cache, context_window=40000)
    mount = "/opt/hrl/harnesses/codex"
    vendor = f"{mount}/node_modules/@openai/codex-linux-{ARCH}/vendor/{rust_triple()}"
    assert spec.argv[0] == f"{vendor}/bin/codex"
    assert spec.argv[1:5] == [
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--color",
    ]
    assert spec.argv[-3:] == ["-C", "/workspace", "-"]
    assert spec.stdin == b"-- Fix the bug in main.py"
    assert spec.env["HRL_API_KEY"] == TOKEN
    assert spec.env["CODEX_HOME"] == "/home/hrl/.codex"
    assert spec.env["PATH"].startswith(f"{vendor}/codex-path:")
    cfg = tomllib.loads(spec.files["/home/hrl/.codex/config.toml"])
    assert cfg["model"] == "qwen-tiny" and cfg["model_provider"] == "hrl"
    assert cfg["approval_policy"] == "never"
    assert cfg["sandbox_mode"] == "danger-full-access"
    assert cfg["model_context_window"] == 40000
    assert cfg["model_auto_compact_token_limit"] == 30000
    assert cfg["analytics"] == {"enabled": False}
    assert cfg["model_providers"]["hrl"] == {
        "name": "harnessrl",
        "base_url": "http://127.0.0.1:18080/v1",
        "env_key": "HRL_API_KEY",
        "wire_api": "responses",
    }
    assert TOKEN not in spec.files["/home/hrl/.codex/config.toml"]


def test_mini_swe_agent_spec(cache: Path):
    """mini-swe-agent: venv python -m, endpoint and key in a config file, step limit."""
    spec = prepare("mini-swe-agent", cache, options={"command_timeout": 30})
    mount = "/opt/hrl/harnesses/mini-swe-agent"
    assert spec.argv[:3] == [f"{mount}/venv/bin/python", "-m", "minisweagent.run.mini"]
    a = spec.argv
    assert a[a.index("-m", 3) + 1] == "openai/qwen-tiny"
    assert a[a.index("-t") + 1] == "-- Fix the bug in main.py"
    cfg_path = "/home/hrl/.config/mini-swe-agent/hrl.yaml"
    assert ["-c", "mini.yaml", "-c", cfg_path] == a[a.index("-c") : a.index("-c") + 4]
    cfg = json.loads(spec.files[cfg_path])
    assert cfg["model"]["model_kwargs"] == {
        "api_base": "http://127.0.0.1:18080/v1",
        "api_key": TOKEN,
    }
    assert cfg["agent"] == {"cost_limit": 0, "step_limit": 7}
    assert cfg["environment"] == {"cwd": "/workspace", "timeout": 30}
    assert spec.env["MSWEA_CONFIGURED"] == "true"
    assert spec.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert spec.stdin is None


def test_opencode_spec(cache: Path):
    """opencode: openai-compatible provider config, run -m hrl/<model> -- <task>."""
    spec = prepare("opencode", cache, context_window=16000)
    assert spec.argv[1:4] == ["run", "-m", "hrl/qwen-tiny"]
    assert spec.argv[-2:] == ["--", "-- Fix the bug in main.py"]
    cfg_path = "/home/hrl/.config/opencode/opencode.json"
    assert spec.env["OPENCODE_CONFIG"] == cfg_path
    assert spec.env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    cfg = json.loads(spec.files[cfg_path])
    prov = cfg["provider"]["hrl"]
    assert prov["npm"] == "@ai-sdk/openai-compatible"
    assert prov["options"] == {"baseURL": "http://127.0.0.1:18080/v1", "apiKey": TOKEN}
    assert prov["models"]["qwen-tiny"]["limit"]["context"] == 16000
    assert cfg["model"] == "hrl/qwen-tiny"


@pytest.mark.parametrize(
    ("api", "kind", "base"),
    [
        ("chat", "openai-completions", "http://127.0.0.1:18080/v1"),
        ("responses", "openai-responses", "http://127.0.0.1:18080/v1"),
        ("messages", "anthropic-messages", "http://127.0.0.1:18080"),
    ],
)
def test_openclaw_spec(cache: Path, api: str, kind: str, base: str):
    """OpenClaw: its own Node 24, a JSON5 config per API (no /v1 for anthropic-messages)."""
    spec = prepare("openclaw", cache, options={"api": api})
    mount = "/opt/hrl/harnesses/openclaw"
    assert spec.argv[:4] == [
        f"{mount}/node_modules/node-linux-{ARCH}/bin/node",
        f"{mount}/node_modules/openclaw/openclaw.mjs",
        "agent",
        "exec",
    ]
    assert spec.argv[-2:] == ["--message-file", "-"]
    assert spec.argv[spec.argv.index("--timeout") + 1] == "123"
    assert spec.api == api
    cfg = json.loads(spec.files["/home/hrl/.openclaw/hrl.json5"])
    prov = cfg["models"]["providers"]["hrl"]
    assert (prov["api"], prov["baseUrl"], prov["apiKey"]) == (kind, base, TOKEN)
    assert prov["models"][0]["id"] == "qwen-tiny"
    assert cfg["agents"]["defaults"]["model"]["primary"] == "hrl/qwen-tiny"
    with pytest.raises(ValueError, match="api must be one of"):
        prepare("openclaw", cache, options={"api": "gemini"})


def test_openclaw_session_tools_denied_unless_asked(cache: Path):
    """OpenClaw's session tools (whose runtime-context message rewrites its history) are
    denied by default; ``session_tools: true`` keeps them."""
    path = "/home/hrl/.openclaw/hrl.json5"
    cfg = json.loads(prepare("openclaw", cache).files[path])
    assert cfg["tools"]["deny"] == ["process", "sessions_spawn", "sessions_yield"]
    cfg = json.loads(prepare("openclaw", cache, options={"session_tools": True}).files[path])
    assert "tools" not in cfg


def test_command_spec(cache: Path, tmp_path: Path):
    """command: sh -c, proxy URLs and token in the usual variables, task in env and a file."""
    solve = tmp_path / "solve.py"
    solve.write_text("print('hi')\n")
    spec = prepare(
        "command",
        cache,
        options={"command": "python3 /opt/solve.py", "ro_binds": [(str(solve), "/opt/solve.py")]},
    )
    assert spec.argv == ["/bin/sh", "-c", "python3 /opt/solve.py"]
    assert spec.env["OPENAI_BASE_URL"] == "http://127.0.0.1:18080/v1"
    assert spec.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:18080"
    assert spec.env["OPENAI_API_KEY"] == spec.env["ANTHROPIC_API_KEY"] == TOKEN
    assert spec.env["HRL_INSTRUCTION"] == "-- Fix the bug in main.py"
    assert spec.files[spec.env["HRL_INSTRUCTION_FILE"]] == "-- Fix the bug in main.py"
    assert spec.ro_binds == [(solve, "/opt/solve.py")]
    assert prepare("command", cache, options={"command": ["a", "b c"]}).argv == ["a", "b c"]
    with pytest.raises(ValueError, match="--harness-cmd"):
        prepare("command", cache)


def test_reference_spec(cache: Path):
    """reference: host python3 + the script bound as one file; compaction from context_window."""
    spec = prepare("reference", cache, context_window=8000, options={"subagent": True})
    script = "/opt/hrl/harnesses/reference/reference_agent.py"
    assert spec.argv[1] == script
    assert spec.ro_binds[0][1] == script and spec.ro_binds[0][0].name == "reference_agent.py"
    a = spec.argv
    assert a[a.index("--compact-tokens") + 1] == "6000"
    assert a[a.index("--max-turns") + 1] == "7"
    assert "--subagent" in a
    assert spec.files[a[a.index("--task-file") + 1]] == "-- Fix the bug in main.py"
    assert spec.env["OPENAI_API_KEY"] == TOKEN
    assert spec.env["OPENAI_BASE_URL"] == "http://127.0.0.1:18080/v1"


# ---------------------------------------------------------------------------------------------
# Context window and output limit (the rule in actors/harnesses/__init__.py)


def test_output_and_compaction_limits():
    """``output_limit``: the option, else the run's limit, else the default; the compaction
    limit keeps ``max(O, W/4)`` of the window free."""
    ctx = HarnessContext("x", "t", context_window=32768, max_output_tokens=4096)
    assert ctx.output_limit() == 4096 and ctx.compaction_limit() == 24576
    assert dataclasses.replace(ctx, options={"max_output_tokens": 1000}).output_limit() == 1000
    assert dataclasses.replace(ctx, max_output_tokens=16000).compaction_limit() == 16768
    assert ctx.compaction_limit(20000) == 12768
    bare = HarnessContext("x", "t")
    assert bare.output_limit() is None and bare.output_limit(8192) == 8192
    assert bare.compaction_limit() is None


def limits_of(name: str, spec: LaunchSpec) -> tuple:
    """(window, output limit, compaction limit) as a harness's spec tells them."""
    if name == "claude-code":
        e = spec.env
        assert e.get("CLAUDE_CODE_AUTO_COMPACT_WINDOW") == e.get("CLAUDE_CODE_MAX_CONTEXT_TOKENS")
        window = e.get("CLAUDE_CODE_MAX_CONTEXT_TOKENS")
        return (window and int(window), e.get("CLAUDE_CODE_MAX_OUTPUT_TOKENS"), None)
    if name == "codex":
        cfg = tomllib.loads(spec.files["/home/hrl/.codex/config.toml"])
        return (cfg.get("model_context_window"), None, cfg.get("model_auto_compact_token_limit"))
    if name == "opencode":
        cfg = json.loads(spec.files["/home/hrl/.config/opencode/opencode.json"])
        limit = cfg["provider"]["hrl"]["models"]["qwen-tiny"]["limit"]
        return (limit["context"], limit["output"], None)
    if name == "openclaw":
        cfg = json.loads(spec.files["/home/hrl/.openclaw/hrl.json5"])
        model = cfg["models"]["providers"]["hrl"]["models"][0]
        return (model["contextWindow"], model["maxTokens"], None)
    if name == "mini-swe-agent":
        cfg = json.loads(spec.files["/home/hrl/.config/mini-swe-agent/hrl.yaml"])
        return (None, cfg["model"]["model_kwargs"].get("max_tokens"), None)
    a = spec.argv
    flags = [
        int(a[a.index(f) + 1]) if f in a else None for f in ("--max-tokens", "--compact-tokens")
    ]
    return (None, *flags)


@pytest.mark.parametrize(
    ("name", "told", "untold"),
    [
        ("claude-code", (32768, "4096", None), (None, None, None)),
        ("codex", (32768, None, 24576), (None, None, None)),
        ("opencode", (32768, 4096, None), (32768, 8192, None)),
        ("openclaw", (32768, 4096, None), (32768, 8192, None)),
        ("mini-swe-agent", (None, 4096, None), (None, None, None)),
        ("reference", (None, 4096, 24576), (None, None, None)),
    ],
)
def test_window_and_output_limit_reach_the_harness(
    cache: Path, name: str, told: tuple, untold: tuple
):
    """Told W=32768 and O=4096, each harness gets both through its own knobs (and the HRL_*
    variables); told nothing, it keeps its defaults."""
    spec = prepare(name, cache, context_window=32768, max_output_tokens=4096)
    assert limits_of(name, spec) == told
    assert spec.env["HRL_CONTEXT_WINDOW"] == "32768"
    assert spec.env["HRL_MAX_OUTPUT_TOKENS"] == "4096"
    plain = prepare(name, cache)
    assert limits_of(name, plain) == untold
    assert "HRL_CONTEXT_WINDOW" not in plain.env and "HRL_MAX_OUTPUT_TOKENS" not in plain.env


def test_options_override_the_runs_output_limit(cache: Path):
    """A per-harness ``max_output_tokens`` option wins over the run's limit, everywhere."""
    kw = {"context_window": 32768, "max_output_tokens": 4096}
    opts = {"max_output_tokens": 12000}
    assert limits_of("opencode", prepare("opencode", cache, options=opts, **kw))[1] == 12000
    assert limits_of("openclaw", prepare("openclaw", cache, options=opts, **kw))[1] == 12000
    cc = prepare("claude-code", cache, options=opts, **kw)
    assert cc.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "12000"
    codex = prepare("codex", cache, options=opts, **kw)
    assert limits_of("codex", codex)[2] == 32768 - 12000
    ref = prepare("reference", cache, options={"max_tokens": 10000}, **kw)
    assert limits_of("reference", ref)[1:] == (10000, 32768 - 10000)
    ref = prepare("reference", cache, options={"compact_tokens": 0}, **kw)
    assert limits_of("reference", ref) == (None, 4096, None)


# ---------------------------------------------------------------------------------------------
# Installing: lock + temporary dir + rename


async def test_locked_install_is_idempotent_and_atomic(tmp_path: Path):
    """A failed build leaves nothing; a good one appears with its manifest; reruns are no-ops."""
    builds = []

    async def bad(tmp: Path) -> dict:
        (tmp / "half").write_text("x")
        raise RuntimeError("registry down")

    with pytest.raises(RuntimeError, match="registry down"):
        await locked_install(tmp_path, "h", bad)
    assert not (tmp_path / "h").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".h.lock"]

    async def good(tmp: Path) -> dict:
        builds.append(tmp)
        (tmp / "bin").write_text("ok")
        return {"version": "1.0"}

    final = await locked_install(tmp_path, "h", good)
    assert final == tmp_path / "h" and (final / "bin").read_text() == "ok"
    assert read_manifest(final)["version"] == "1.0"
    assert oct(final.stat().st_mode & 0o777) == "0o755"
    await locked_install(tmp_path, "h", good)
    assert len(builds) == 1
    await locked_install(tmp_path, "h", good, force=True)
    assert len(builds) == 2 and (final / "bin").read_text() == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".h.lock", "h"]


def test_concurrent_installs_from_two_processes_build_once(tmp_path: Path):
    """Two processes installing the same harness at once: one builds, the other waits."""
    code = textwrap.dedent(
        """
        import asyncio, sys, os
        from pathlib import Path
        from harnessrl.actors.harnesses.base import locked_install

        async def build(tmp):
            with open(sys.argv[2], "a") as f:
                f.write(f"{os.getpid()}\\n")
            await asyncio.sleep(1.0)
            (tmp / "payload").write_text("complete")
            return {"version": "1"}

        final = asyncio.run(locked_install(Path(sys.argv[1]), "h", build))
        print((final / "payload").read_text())
        """
    )
    log = tmp_path / "builds.log"
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache), str(log)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["complete\n", "complete\n"]
    assert len(log.read_text().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# The CLI


def run_cli(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> int:
    from harnessrl.common import cli

    cmd = dataclasses.replace(cli.COMMANDS["harness"], module="harnessrl.actors.harness_cmd")
    monkeypatch.setitem(cli.COMMANDS, "harness", cmd)
    return cli.main(argv)


def test_cli_list_json(monkeypatch, cache: Path, capsys):
    """``harness list --json``: every harness with API, installed state, version and dir."""
    assert run_cli(monkeypatch, ["harness", "list", "--cache-dir", str(cache), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(ADAPTERS)
    assert rows["codex"]["installed"] and rows["codex"]["version"] == "9.9.9"
    assert rows["codex"]["install_dir"] == str(cache / "codex")
    assert rows["reference"]["builtin"] and rows["reference"]["install_dir"] is None
    assert rows["reference"]["spoken_by"] == ["tiny-agent"] and rows["codex"]["spoken_by"] == []
    assert rows["codex"]["first_request_tokens"] == 12543
    assert rows["codex"]["first_request_measured_at"] == "0.171.0"
    assert rows["command"]["first_request_tokens"] is None


def test_cli_list_table_and_show(monkeypatch, tmp_path: Path, capsys):
    """The table marks what is missing; ``show`` prints the adapter's recipe."""
    assert run_cli(monkeypatch, ["harness", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["NAME", "API", "INSTALLED"]
    line = next(ln for ln in out.splitlines() if ln.startswith("claude-code"))
    assert line.split()[:6] == ["claude-code", "messages", "no", "-", "1346", "-"]
    line = next(ln for ln in out.splitlines() if ln.startswith("reference"))
    assert line.split()[:6] == ["reference", "chat", "built-in", "-", "458", "tiny-agent"]
    assert run_cli(monkeypatch, ["harness", "show", "codex"]) == 0
    assert 'wire_api = "responses"' in capsys.readouterr().out


def test_cli_list_marks_a_measure_of_another_version(monkeypatch, cache: Path, capsys):
    """First-request tokens measured at another version than the one installed say so."""
    assert run_cli(monkeypatch, ["harness", "list", "--cache-dir", str(cache)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("codex"))
    assert line.split()[3:5] == ["9.9.9", "~12543@0.171.0"]


FIRST_REQUESTS = {  # harness -> (captured first main request, API)
    "mini-swe-agent": ("mini_swe_agent_first_request", "chat"),
    "claude-code": ("claude_code_first_request", "messages"),
    "codex": ("codex_first_request", "responses"),
    "openclaw": ("openclaw_first_request", "chat"),
    "opencode": ("opencode_second_request", "chat"),  # its first is the title request
}


@pytest.mark.parametrize("name", sorted(FIRST_REQUESTS))
def test_recorded_first_request_tokens_match_the_captured_requests(name: str):
    """Each adapter's `first_request_tokens` is the token count of the request the harness
    sent at `measured_version`, through the proxy's conversion and the chat template."""
    from harnessrl.common.models import load_tokenizer, render_chat
    from harnessrl.proxy.messages_api import messages_request
    from harnessrl.proxy.responses_api import responses_request
    from harnessrl.proxy.server import chat_request

    fixture, api = FIRST_REQUESTS[name]
    captured = json.loads((Path(__file__).parent / "fixtures" / "harness_requests" / f"{fixture}.json").read_text())  # fmt: skip
    convert = {"chat": chat_request, "messages": messages_request, "responses": responses_request}
    req = convert[api](captured["body"], "r-0-1", {})
    text = render_chat(req.messages, tools=req.tools, add_generation_prompt=True)
    tok = load_tokenizer("tiny-1m")
    adapter = get_adapter(name)
    assert adapter.first_request_tokens == len(tok.encode(text, add_special_tokens=False))
    agent = captured["headers"].get("User-Agent", "")
    assert adapter.measured_version in agent or name in ("mini-swe-agent", "openclaw")


def test_reference_first_request_tokens():
    from harnessrl.actors.harnesses import reference_agent as ra
    from harnessrl.common.models import load_tokenizer, render_chat

    msgs = [
        {"role": "system", "content": ra.SYSTEM_PROMPT.format(workspace="/workspace")},
        {"role": "user", "content": "Create hello.txt containing a greeting."},
    ]
    text = render_chat(msgs, tools=ra.TOOLS, add_generation_prompt=True)
    n = len(load_tokenizer("tiny-1m").encode(text, add_special_tokens=False))
    assert get_adapter("reference").first_request_tokens == n


def test_cli_install_unknown_and_already_installed(monkeypatch, cache: Path, capsys):
    """Unknown names exit 2; an installed harness is not reinstalled."""
    assert run_cli(monkeypatch, ["harness", "install", "nope", "--cache-dir", str(cache)]) == 2
    assert "unknown harness 'nope'" in capsys.readouterr().err
    assert run_cli(monkeypatch, ["harness", "install", "codex", "--cache-dir", str(cache)]) == 0
    assert "already installed" in capsys.readouterr().out


def test_cli_help(monkeypatch, capsys):
    """``harnessrl harness install --help`` documents every flag."""
    with pytest.raises(SystemExit) as e:
        run_cli(monkeypatch, ["harness", "install", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--cache-dir", "--version", "--force", "claude-code"):
        assert flag in out

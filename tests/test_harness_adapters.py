"""Harness adapters without running the harnesses: the rules of their launch specs (token,
limits, options), installs, the registry, the CLI. What each harness receives when a rollout
launches it is checked in ``test_harness_launch.py``.

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
from harnessrl.actors.harnesses.base import locked_install, read_manifest
from tests.helpers.harnesses import FAKE_FILES, fake_installs

TOKEN = "tok-SECRET-rollout"


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache dir where every npm/pip harness looks installed."""
    return fake_installs(tmp_path)


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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize("name", list(FAKE_FILES))
def test_not_installed_is_a_clear_error(name: str, tmp_path: Path):
    """prepare() on an empty cache says how to install."""
    adapter = get_adapter(name)
    assert not adapter.is_installed(tmp_path)
    with pytest.raises(HarnessNotInstalled, match=f"harnessrl harness install {name}"):
        adapter.prepare(ctx_for(tmp_path))


@pytest.mark.unit
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
    a = spec.argv
    assert a[a.index("--output-format") + 1] == "stream-json" and "--verbose" in a
    assert a[-1] == "--foo"  # extra args come last
    assert spec.env["CLAUDE_CODE_MAX_RETRIES"] == "3"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("api", "kind", "base"),
    [
        ("chat", "openai-completions", "http://127.0.0.1:18080/v1"),
        ("responses", "openai-responses", "http://127.0.0.1:18080/v1"),
        ("messages", "anthropic-messages", "http://127.0.0.1:18080"),
    ],
)
def test_openclaw_provider_per_api(cache: Path, api: str, kind: str, base: str):
    """OpenClaw's JSON5 config has a provider per API (no /v1 for anthropic-messages); an
    unknown API is refused. (What it receives at launch: test_harness_launch.py.)"""
    spec = prepare("openclaw", cache, options={"api": api})
    assert spec.api == api
    cfg = json.loads(spec.files["/home/hrl/.openclaw/hrl.json5"])
    prov = cfg["models"]["providers"]["hrl"]
    assert (prov["api"], prov["baseUrl"], prov["apiKey"]) == (kind, base, TOKEN)
    with pytest.raises(ValueError, match="api must be one of"):
        prepare("openclaw", cache, options={"api": "gemini"})


@pytest.mark.unit
def test_openclaw_session_tools_denied_unless_asked(cache: Path):
    """OpenClaw's session tools (whose runtime-context message rewrites its history) are
    denied by default; ``session_tools: true`` keeps them."""
    path = "/home/hrl/.openclaw/hrl.json5"
    cfg = json.loads(prepare("openclaw", cache).files[path])
    assert cfg["tools"]["deny"] == ["process", "sessions_spawn", "sessions_yield"]
    cfg = json.loads(prepare("openclaw", cache, options={"session_tools": True}).files[path])
    assert "tools" not in cfg


@pytest.mark.unit
def test_command_needs_a_command(cache: Path):
    """command: a list is the argv as given; no command at all names the flag to pass. (What
    a command receives at launch: test_harness_launch.py.)"""
    assert prepare("command", cache, options={"command": ["a", "b c"]}).argv == ["a", "b c"]
    with pytest.raises(ValueError, match="--harness-cmd"):
        prepare("command", cache)


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.integration
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


@pytest.mark.unit
def test_cli_list_json(monkeypatch, cache: Path, capsys):
    """``harness list --json``: every harness with API, installed state, version and dir."""
    assert run_cli(monkeypatch, ["harness", "list", "--cache-dir", str(cache), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(ADAPTERS)
    assert rows["codex"]["installed"] and rows["codex"]["version"] == "9.9.9"
    assert rows["codex"]["install_dir"] == str(cache / "codex")
    assert rows["reference"]["builtin"] and rows["reference"]["install_dir"] is None
    assert rows["reference"]["spoken_by"] == ["tiny-agent", "tiny-agent-harness"]
    assert rows["claude-code"]["spoken_by"] == ["tiny-agent-harness"]
    assert rows["codex"]["spoken_by"] == []
    assert rows["codex"]["first_request_tokens"] == 12543
    assert rows["codex"]["first_request_measured_at"] == "0.171.0"
    assert rows["command"]["first_request_tokens"] is None


@pytest.mark.unit
def test_cli_list_table_and_show(monkeypatch, tmp_path: Path, capsys):
    """The table marks what is missing; ``show`` prints the adapter's recipe."""
    assert run_cli(monkeypatch, ["harness", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["NAME", "API", "INSTALLED"]
    line = next(ln for ln in out.splitlines() if ln.startswith("claude-code"))
    assert line.split()[:6] == ["claude-code", "messages", "no", "-", "1346", "tiny-agent-harness"]
    line = next(ln for ln in out.splitlines() if ln.startswith("codex"))
    assert line.split()[5] == "-"  # spoken by no shipped policy
    line = next(ln for ln in out.splitlines() if ln.startswith("reference"))
    assert line.split()[5] == "tiny-agent,tiny-agent-harness"
    lines = out.splitlines()
    col = lines[0].index("INSTALL DIR")  # the columns line up, however long the names
    rows = lines[1 : next(i for i, ln in enumerate(lines) if ln.startswith("1ST REQ:"))]
    assert rows and all(ln[col - 1] == " " and ln[col] != " " for ln in rows)
    assert run_cli(monkeypatch, ["harness", "show", "codex"]) == 0
    assert 'wire_api = "responses"' in capsys.readouterr().out


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_cli_install_unknown_and_already_installed(monkeypatch, cache: Path, capsys):
    """Unknown names exit 2; an installed harness is not reinstalled."""
    assert run_cli(monkeypatch, ["harness", "install", "nope", "--cache-dir", str(cache)]) == 2
    assert "unknown harness 'nope'" in capsys.readouterr().err
    assert run_cli(monkeypatch, ["harness", "install", "codex", "--cache-dir", str(cache)]) == 0
    assert "already installed" in capsys.readouterr().out


@pytest.mark.unit
def test_cli_help(monkeypatch, capsys):
    """``harnessrl harness install --help`` documents every flag."""
    with pytest.raises(SystemExit) as e:
        run_cli(monkeypatch, ["harness", "install", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--cache-dir", "--version", "--force", "claude-code"):
        assert flag in out

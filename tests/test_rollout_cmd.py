"""``harnessrl rollout``: one rollout by hand, its score and its tree, as text or JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from harnessrl.actors import rollout_cmd
from harnessrl.actors.config import RolloutConfig
from harnessrl.common import cli
from harnessrl.common.config import add_config_args, config_from_args, undocumented_fields
from harnessrl.proxy.scripted import ScriptedEngine
from tests.helpers.rollout import TASK, TOK, toy_solver
from tests.helpers.wait import until

REPO = Path(__file__).resolve().parents[1]
ENTRY = (
    ["-m", "harnessrl.common.cli", "rollout"]
    if cli.COMMANDS["rollout"].module
    else ["-m", "harnessrl.actors.rollout_cmd"]
)
TREE_KEYS = {
    "n_calls",
    "n_leaves",
    "dropped",
    "truncated_calls",
    "unique_tokens",
    "expanded_tokens",
    "model_tokens",
}


def parse(argv: list[str]) -> tuple[RolloutConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    rollout_cmd.add_arguments(parser)
    add_config_args(parser, RolloutConfig)
    args = parser.parse_args(argv)
    return config_from_args(RolloutConfig, args), args


@pytest.mark.integration
async def test_json_output_of_a_reference_rollout(sandbox_root: Path, tmp_path: Path):
    """As a process with an embedded nats-server: one JSON object with the score, the calls
    and the assembled tree's counters; the kept workspace holds the answer."""
    entry = ENTRY
    async with ScriptedEngine(TOK, toy_solver()) as eng:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *entry,
            "--suite",
            "toy",
            "--task",
            "copy_01",
            "--harness",
            "reference",
            "--engine",
            eng.url,
            "--model",
            "tiny-1m",
            "--sandbox-root",
            str(sandbox_root),
            "--no-install-harnesses",
            "--keep-workspace",
            str(tmp_path / "ws"),
            "--json",
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert (report["status"], report["reward"], report["n_calls"]) == ("ok", 1.0, 2)
    assert (report["reason"], report["harness"]) == ("", "reference")
    assert report["harness_version"]  # the reference agent ships with harnessrl: its version
    assert report["metrics"] == {"written": 1.0, "correct": 1.0}
    assert set(report["tree"]) >= TREE_KEYS
    tree = report["tree"]
    assert (tree["n_calls"], tree["n_leaves"], tree["dropped_reason"]) == (2, 1, "")
    assert 0 < tree["model_tokens"] < tree["unique_tokens"] == tree["expanded_tokens"]
    assert (tmp_path / "ws" / "output.txt").read_text() == (
        TASK.workspace_dir / "notes.txt"
    ).read_text()
    assert not any(sandbox_root.iterdir())


@pytest.mark.integration
async def test_task_folder_and_text_report(nats_url: str, sandbox_root: Path):
    """A task given as a folder path, run by --harness-cmd on an existing nats-server: scored
    below 1 when it does nothing, and the text report says there is no sample (no calls)."""
    async with ScriptedEngine(TOK, []) as eng:
        cfg, args = parse(
            [
                "--task",
                str(TASK.path),
                "--harness-cmd",
                "true",
                "--engine",
                eng.url,
                "--nats",
                nats_url,
                "--model",
                "tiny-1m",
                "--sandbox-root",
                str(sandbox_root),
            ]
        )
        report = await rollout_cmd.rollout(cfg, args)
    assert report["status"] == "ok" and report["reward"] < 1.0 and report["n_calls"] == 0
    assert report["harness"] == "command" and report["task"] == str(TASK.path)
    assert report["harness_stdout"] == report["harness_stderr"] == ""
    assert report["tree"]["truncated_calls"] == 0
    assert report["tree"]["dropped_reason"] == "no_calls"
    text = rollout_cmd.format_report(report)
    assert "status   ok" in text and "no sample: no_calls" in text and "written" in text


@pytest.mark.unit
def test_config_documented_and_bad_arguments():
    """Every field is documented; contradicting flags are refused with exit 2."""
    assert undocumented_fields(RolloutConfig) == []
    cfg, args = parse(["--task", "x", "--harness", "reference", "--harness-cmd", "true"])
    assert rollout_cmd.main(cfg, args) == 2
    cfg, args = parse([])
    assert rollout_cmd.main(cfg, args) == 2


async def run_cli(*argv: str, timeout: float = 120) -> tuple[int, str, str, float]:
    """``harnessrl rollout ARGV`` as a process: (exit status, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *ENTRY,
        *argv,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - t0


@pytest.mark.integration
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--suite", "toy", "--task", "concat_dir_1"], ["'concat_dir_1'", "concat_dir_01"]),
        (["--suite", "toy", "--task", "copy_01", "--harness", "claude"], ["'claude'", "codex"]),
        (["--suite", "no-such-suite", "--task", "copy_01"], ["'no-such-suite'", "toy"]),
        (["--suite", "toy", "--task", "copy_01", "--harness", "command"], ["--harness-cmd"]),
    ],
)
async def test_bad_arguments_exit_2_at_once(argv: list[str], says: list[str], tmp_path: Path):
    """An unknown task, suite or harness is refused with exit 2 and one line naming it and
    what exists, before any nats-server, engine check, sandbox or proxy (the engine here is
    a port nobody listens on: checking it alone would take seconds)."""
    engine = ["--engine", "http://127.0.0.1:9", "--sandbox-root", str(tmp_path / "sb")]
    rc, out, err, seconds = await run_cli(*argv, *engine)
    assert (rc, out) == (2, ""), err
    assert len(err.strip().splitlines()) == 1 and err.startswith("harnessrl rollout: ")
    assert all(s in err for s in says), err
    assert seconds < 3.0
    assert not (tmp_path / "sb").exists()


@pytest.mark.integration
async def test_dead_engine_is_refused_at_once(tmp_path: Path, sandbox_root: Path):
    """An engine nobody listens on: refused before any sandbox starts, as an engine_error
    (reason engine_unreachable) naming the URL, exit 1, in seconds rather than after the
    harness retried every call (the in-rollout path is tested in test_rollout.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc, out, err, seconds = await run_cli(
        *("--suite", "toy", "--task", "copy_01", "--harness", "reference", "--engine", dead),
        *("--model", "tiny-1m", "--sandbox-root", str(sandbox_root), "--json"),
    )
    assert rc == 1 and json.loads(out)["reason"] == "engine_unreachable", err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("harnessrl rollout: engine_error (engine_unreachable): ")
    assert dead in line
    assert seconds < 10.0
    assert not sandbox_root.exists() or not any(sandbox_root.iterdir())


@pytest.mark.unit
def test_help_quotes_the_shipped_models_own_output_limit(capsys):
    """``--max-new-tokens``'s help gives ``tiny-agent``'s limit as its files declare it."""
    from harnessrl.common.models import model_max_new_tokens

    with pytest.raises(SystemExit):
        cli.main(["rollout", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"``tiny-agent`` declares {model_max_new_tokens('tiny-agent')})" in text


@pytest.mark.unit
def test_help_documents_exit_status(capsys):
    """``--help`` says what each exit status means, as the module docstring does."""
    with pytest.raises(SystemExit):
        cli.main(["rollout", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for part in ("0 the rollout was scored", "1 an infrastructure failure", "2 bad arguments"):
        assert part in text
    assert "Exit status" in rollout_cmd.__doc__ and "2 bad arguments" in rollout_cmd.__doc__


@pytest.mark.unit
async def test_progress_lines_count_calls_and_tokens(run_name: str):
    """While a rollout runs, stderr gets lines with its calls and tokens so far, read back
    from the bus as the proxy records them."""
    import contextlib
    import io

    from harnessrl.common.bus import connect
    from harnessrl.common.records import CallRecord, pack_ids

    bus = await connect(f"memory://{run_name}", run_name)
    rid = "manual1-0-1"
    buf = io.StringIO()
    watch = asyncio.create_task(rollout_cmd.progress(bus, rid, every=0.05, out=buf))
    last_line = lambda: (buf.getvalue().splitlines() or [""])[-1]  # noqa: E731
    try:
        await until(lambda: "0 calls, 0 tokens generated" in last_line(), 10, "a first line")
        for seq, n_out in enumerate((3, 5)):
            rec = CallRecord(
                rollout_id=rid,
                seq=seq,
                suffix_ids=pack_ids(range(10)),
                input_len=10 + 8 * seq,
                output_ids=pack_ids(range(n_out)),
                finish_reason="length" if seq else "stop",
            )
            await bus.publish(bus.subjects.calls(rid), rec)
        await until(lambda: "2 calls" in last_line(), 10, "a line counting both calls")
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await bus.close()
    last = buf.getvalue().splitlines()[-1]
    assert "2 calls, 8 tokens generated" in last, last
    assert "last: main 18 in / 5 out (length)" in last, last


@pytest.fixture(scope="module")
def secure_nats(tmp_path_factory: pytest.TempPathFactory):
    """A nats-server requiring role credentials and TLS for run ``hand``, whose streams the
    admin created (as for a live run)."""
    from harnessrl.common import natsauth
    from harnessrl.common.bus import connect
    from harnessrl.common.natsd import NatsServer

    store = tmp_path_factory.mktemp("nats-secure")
    auth = natsauth.prepare_server_auth(store / "auth", ["hand"], tls=True)
    srv = NatsServer(store, auth=auth).start()

    async def streams() -> None:
        admin = await connect(srv.url, "hand", creds=srv.creds("admin"), ca=srv.ca)
        await admin.close()

    asyncio.run(streams())
    yield srv
    srv.stop()


FAILURES = {
    # name: (extra argv, exit status, status, reason, words of the error)
    "bad_arguments": (["--task", "nope"], 2, "bad_arguments", "", ["'nope'"]),
    "dead_engine": ([], 1, "engine_error", "engine_unreachable", ["/health"]),
    "missing_credential": ([], 1, "bus_error", "cannot_connect", ["no-such.cred"]),
    "actor_credential": ([], 1, "bus_error", "permission_denied", ["'actor'", "admin.cred"]),
    "learner_credential": ([], 1, "bus_error", "permission_denied", ["'learner'", "admin"]),
}


@pytest.mark.integration
@pytest.mark.parametrize("json_out", [True, False], ids=["json", "text"])
@pytest.mark.parametrize("case", list(FAILURES))
async def test_every_failure_is_one_line_and_a_json_object(
    case: str, json_out: bool, secure_nats, sandbox_root: Path, tmp_path: Path
):
    """Each way a hand-run rollout fails before it has a result: exit 1 (2 for bad arguments),
    one line on stderr naming what is wrong — the role needed for a credential of another
    role, refused before anything runs; no traceback, no doubled ``harnessrl rollout:`` —
    and with ``--json`` one object on stdout (``status``, ``reason``, ``error``, ``exit``)."""
    extra, code, status, reason, words = FAILURES[case]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    nats: list[str] = []
    if case == "missing_credential":
        nats = ["--nats", secure_nats.url, "--nats-creds", str(tmp_path / "no-such.cred")]
    elif case.endswith("_credential"):
        role = case.split("_")[0]
        user = "actor-0" if role == "actor" else role  # an actor's own credential
        nats = ["--nats", secure_nats.url, "--nats-creds", str(secure_nats.creds(user))]
        nats += ["--nats-ca", str(secure_nats.ca), "--run", "hand"]
    async with ScriptedEngine(TOK, toy_solver()) as eng:
        argv = ["--suite", "toy", "--task", "copy_01", "--harness", "reference", *extra]
        argv += ["--engine", dead if case == "dead_engine" else eng.url, *nats]
        argv += ["--model", "tiny-1m", "--sandbox-root", str(sandbox_root)]
        rc, out, err, _ = await run_cli(*argv, *(["--json"] if json_out else []))
    assert rc == code, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    (line,) = lines
    head = f"harnessrl rollout: {status} ({reason}): " if reason else "harnessrl rollout: "
    assert line.startswith(head) and "harnessrl rollout: harnessrl" not in line, line
    assert all(w in line for w in words), line
    if json_out:
        obj = json.loads(out)
        assert obj == {"status": status, "reason": reason, "error": obj["error"], "exit": code}
        assert all(w in obj["error"] for w in words), obj
    else:
        assert out == ""
    assert not sandbox_root.exists() or not any(sandbox_root.iterdir())

"""One rollout through ``harnessrl.actors.rollout.run_rollout``: real bubblewrap sandboxes, a real
nats-server, the real proxy on a unix socket, real harness processes; only the engine is faked
(``harnessrl.proxy.scripted.ScriptedEngine`` answering with the tool calls that solve a toy task)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from harnessrl.actors.config import RolloutSettings
from harnessrl.actors.rollout import RolloutDeps, RolloutReport, run_rollout
from harnessrl.actors.sandbox import SandboxError
from harnessrl.actors.sandbox.bwrap import BwrapBackend
from harnessrl.common.bus import connect
from harnessrl.common.records import CallRecord, unpack_ids
from harnessrl.common.tree import assemble
from harnessrl.proxy.calls import call_seed
from harnessrl.proxy.scripted import Reply
from tests.helpers.rollout import SOLVE, request, rollout_env, toy_solver


def sandbox_dirs(backend: BwrapBackend) -> list[str]:
    return [p.name for p in backend.root.iterdir() if not p.name.startswith(".")]


def processes_with(needle: str) -> list[int]:
    """PIDs whose command line contains ``needle`` (to find leftovers; nothing is killed)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                if needle.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                    found.append(int(d))
    return found


@pytest.mark.integration
async def test_command_reference_solution_scores_one(nats_url, run_name, bwrap, tmp_path):
    """The task's reference solution through the command harness scores 1.0; the kept
    workspace is the harness's final one, without reward files."""
    async with rollout_env(nats_url, run_name, bwrap, expose_solution=True) as (deps, _, _):
        report = RolloutReport()
        res = await run_rollout(
            request(cmd=SOLVE), 1, deps, keep_workspace=tmp_path / "kept", report=report
        )
    assert (res.status, res.reward, res.error) == ("ok", 1.0, "")
    assert res.metrics == {"written": 1.0, "correct": 1.0}
    assert (res.rollout_id, res.attempt, res.n_calls, res.actor) == ("g1-0-1", 1, 0, "test")
    assert {"sandbox", "harness", "verify", "total"} <= set(res.durations)
    assert report.harness_exit == 0 and report.task.id == "copy_01"
    kept = {p.name for p in (tmp_path / "kept").iterdir()}
    assert kept == {"notes.txt", "output.txt"}
    assert sandbox_dirs(bwrap) == []


@pytest.mark.integration
async def test_a_harness_over_its_disk_quota_is_scored_as_a_failure(nats_url, run_name, bwrap):
    """A harness that solves the task and then fills its sandbox past ``sandbox_disk_mb`` (40
    MB in the workspace, 40 in /tmp: 80 over a 64 MiB quota) is stopped within seconds, not at
    its timeout, and scored 0 without verifying (the same workspace scores 1 otherwise): the
    harness's failure, not an infrastructure outcome."""
    from harnessrl.common import metrics

    fill = "head -c 40000000 /dev/zero > {}; "
    cmd = f"{SOLVE}; {fill.format('junk')}{fill.format('/tmp/junk')}sleep 60"
    before = metrics.sample_value("hrl_actor_failures_total", {"reason": "disk_quota"}) or 0
    opts = dict(expose_solution=True, sandbox_disk_mb=64)
    async with rollout_env(nats_url, run_name, bwrap, **opts) as (deps, _, _):
        res = await run_rollout(request(cmd=cmd), 1, deps)
        ok = await run_rollout(request(cmd=SOLVE, group_id="g2"), 1, deps)
    assert (res.status, res.reward, res.reason) == ("ok", 0.0, ""), res
    assert "disk quota" in res.error and "64 MiB" in res.error, res.error
    assert res.durations["harness"] < 20 and "verify" not in res.durations, res.durations
    assert (ok.status, ok.reward) == ("ok", 1.0)  # under the quota: scored as usual
    after = metrics.sample_value("hrl_actor_failures_total", {"reason": "disk_quota"})
    assert after == before + 1
    assert sandbox_dirs(bwrap) == []


@pytest.mark.integration
async def test_doing_nothing_scores_below_one(nats_url, run_name, bwrap):
    """A harness that does nothing is scored, and scores below 1."""
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        res = await run_rollout(request(cmd="true"), 1, deps)
    assert res.status == "ok" and res.reward < 1.0


@pytest.mark.integration
async def test_reward_weights_override_the_tasks(nats_url, run_name, bwrap):
    """A wrong but written output earns the toy suite's partial credit (``written``) unless the
    run's ``reward_weights`` weigh that metric 0; the metrics themselves are unchanged."""
    wrong = "echo wrong > output.txt"
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        shaped = await run_rollout(request(cmd=wrong), 1, deps)
    async with rollout_env(nats_url, run_name, bwrap, reward_weights={"written": 0}) as (
        deps,
        _,
        _,
    ):
        exact = await run_rollout(request(cmd=wrong, group_id="g2"), 1, deps)
        right = await run_rollout(request(cmd="cp notes.txt output.txt", group_id="g3"), 1, deps)
    assert shaped.metrics == exact.metrics == {"written": 1.0, "correct": 0.0}
    assert (shaped.reward, exact.reward, right.reward) == (0.5, 0.0, 1.0)


@pytest.mark.unit
def test_reward_weights_must_not_be_negative():
    with pytest.raises(ValueError, match="'written' is negative"):
        RolloutSettings(reward_weights={"written": -1})


@pytest.mark.integration
async def test_reference_harness_with_scripted_engine(nats_url, run_name, bwrap):
    """The reference agent writes the answer through the proxy; both calls are on the bus and
    the second call's input extends the first call's input + output exactly (TITO)."""
    async with rollout_env(nats_url, run_name, bwrap, script=toy_solver()) as (deps, eng, bus):
        res = await run_rollout(request("reference", group_id="gref", k=3, seed=11), 2, deps)
        calls = await bus.read_subject(bus.subjects.calls(res.rollout_id), CallRecord)
        assert deps.caller.seeds == {}  # forgotten with the rollout
    assert (res.status, res.reward, res.rollout_id) == ("ok", 1.0, "gref-3-2")
    assert res.n_calls == 2 and len(calls) == 2 and len(eng.requests) == 2
    # each call samples with a seed derived from the request's seed and the call's seq
    seeds = [r["sampling_params"]["sampling_seed"] for r in eng.requests]
    assert seeds == [call_seed(11, 0), call_seed(11, 1)]
    first, second = sorted(calls, key=lambda c: c.seq)
    assert [c.label for c in (first, second)] == ["main", "main"]
    assert second.parent_seq == 0 and second.tito_hit
    assert second.prefix_len == first.input_len + len(unpack_ids(first.output_ids))
    full_first = list(unpack_ids(first.suffix_ids)) + list(unpack_ids(first.output_ids))
    assert eng.requests[1]["input_ids"][: len(full_first)] == full_first
    sample = assemble(calls, res)
    assert not sample.is_tombstone and sample.counters.n_leaves == 1
    # the harness's own CPU (a Python agent: its start-up alone is tens of ms), measured inside
    assert 0.01 < res.durations["harness_cpu"] < res.durations["harness"] * 2 + 1


@pytest.mark.integration
async def test_timeout_kills_and_cleans_up(nats_url, run_name, bwrap):
    """Past its timeout the harness is killed: status timeout, no process or sandbox left."""
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        res = await run_rollout(request(cmd="sleep 4242 & sleep 4242", timeout_s=1.0), 1, deps)
        assert sandbox_dirs(bwrap) == []
    assert res.status == "timeout" and "timeout" in res.error
    assert "verify" not in res.durations
    assert processes_with("sleep\x004242") == []


@pytest.mark.integration
async def test_timeout_scored_when_configured(nats_url, run_name, bwrap):
    """With timeout_scoring=score the killed harness's workspace is verified anyway."""
    cmd = "cp notes.txt output.txt; sleep 4243"
    async with rollout_env(nats_url, run_name, bwrap, timeout_scoring="score") as (deps, _, _):
        res = await run_rollout(request(cmd=cmd, timeout_s=1.0), 1, deps)
    assert (res.status, res.reward) == ("ok", 1.0)
    assert "scored anyway" in res.error


class FailingBackend:
    """A sandbox backend whose sandboxes cannot be created."""

    name = "failing"

    async def start(self) -> None:
        pass

    async def create(self, spec):
        raise SandboxError("no sandbox for you")

    async def sweep(self) -> int:
        return 0

    async def close(self) -> None:
        pass


@pytest.mark.integration
async def test_sandbox_failure_is_sandbox_error(nats_url, run_name):
    """A sandbox that cannot be made ends the rollout as sandbox_error (and nothing leaks)."""
    async with rollout_env(nats_url, run_name, FailingBackend()) as (deps, _, _):
        res = await run_rollout(request(cmd="true"), 1, deps)
        assert list(deps.socket_dir.iterdir()) == []
    assert res.status == "sandbox_error" and "no sandbox for you" in res.error


@pytest.mark.integration
async def test_harness_that_cannot_start_is_harness_error(nats_url, run_name, bwrap):
    """Exit 127 (command not found) is a harness_error with the harness's stderr."""
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        report = RolloutReport()
        res = await run_rollout(request(cmd="no-such-harness-xyz"), 1, deps, report=report)
    assert res.status == "harness_error" and "exit 127" in res.error
    assert "no-such-harness-xyz" in res.error and not report.bad_request


@pytest.mark.integration
async def test_harness_failing_with_its_reason_on_stdout_keeps_it(nats_url, run_name, bwrap):
    """A harness that says why it failed on stdout (as Codex does for a fatal error) and exits
    1 before any model call: the reason is in the result's error and the report keeps the tail
    of both streams."""
    cmd = "echo 'Error: no provider configured for model harnessrl'; echo warm-up >&2; exit 1"
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        report = RolloutReport()
        res = await run_rollout(request(cmd=cmd, group_id="gso"), 1, deps, report=report)
    assert (res.status, res.reason) == ("harness_error", "harness_exit"), res
    assert "no provider configured" in res.error and "warm-up" in res.error
    assert "no provider configured" in report.harness_stdout
    assert report.harness_stderr == "warm-up"


@pytest.mark.integration
async def test_unknown_task_is_a_bad_request(nats_url, run_name, bwrap):
    """A task the actor cannot load is a failed result and flagged as a bad request."""
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        report = RolloutReport()
        res = await run_rollout(request(cmd="true", task_id="nope"), 1, deps, report=report)
        changed = RolloutReport()
        res2 = await run_rollout(request(cmd="true", task_hash="0" * 32), 1, deps, report=changed)
    assert res.status == "harness_error" and "nope" in report.bad_request
    assert res2.status == "harness_error" and "changed" in changed.bad_request
    assert sandbox_dirs(bwrap) == []


QUICK_RETRIES = {"reference": {"retries": 1, "retry_base": 0.05}}
"""The reference agent retries a failed call once, at once (its default waits ~30 s)."""


@pytest.mark.integration
async def test_engine_failing_every_call_is_engine_error(nats_url, run_name, bwrap):
    """An engine that fails every call (HTTP 500): the harness gives up after calling the model,
    which is no model failure but an engine_error with its reason and cause, never verified,
    and a tombstone downstream. The records carry the harness identity of the result."""
    script = lambda ids, body: Reply(status=500, error="engine on fire")  # noqa: E731
    opts = dict(script=script, harness_options=QUICK_RETRIES)
    async with rollout_env(nats_url, run_name, bwrap, **opts) as (deps, eng, bus):
        report = RolloutReport()
        res = await run_rollout(request("reference"), 1, deps, report=report)
        calls = await bus.read_subject(bus.subjects.calls(res.rollout_id), CallRecord)
    assert (res.status, res.reason, res.n_calls, len(eng.requests)) == (
        "engine_error",
        "engine_failed",
        2,
        2,
    )
    assert res.error.startswith("2 of 2 model calls failed: engine http://")
    assert eng.url in res.error and "engine on fire" in res.error
    assert report.harness_exit not in (None, 0) and "verify" not in res.durations
    assert res.harness_version and res.reward == 0.0
    assert {(c.status, c.harness, c.harness_version) for c in calls} == {
        ("error", "reference", res.harness_version)
    }
    assert assemble(calls, res).dropped_reason == "rollout_engine_error"
    assert sandbox_dirs(bwrap) == []


@pytest.mark.integration
async def test_transient_engine_failure_is_scored(nats_url, run_name, bwrap):
    """A failed call followed by calls that generate is scored as usual."""
    solver, first = toy_solver(), []

    def script(ids, body):
        if not first:
            first.append(1)
            return Reply(status=500)
        return solver(ids, body)

    opts = dict(script=script, harness_options=QUICK_RETRIES)
    async with rollout_env(nats_url, run_name, bwrap, **opts) as (deps, _, _):
        res = await run_rollout(request("reference"), 1, deps)
    assert (res.status, res.reason, res.reward, res.n_calls) == ("ok", "", 1.0, 3)


@pytest.mark.integration
async def test_engine_refusing_the_request_is_the_models_failure(nats_url, run_name, bwrap):
    """A 400 (the request can never succeed) is no infrastructure failure: the harness that
    stops on it is scored."""
    script = lambda ids, body: Reply(status=400, error="prompt too long")  # noqa: E731
    async with rollout_env(nats_url, run_name, bwrap, script=script) as (deps, _, _):
        res = await run_rollout(request("reference"), 1, deps)
    assert (res.status, res.reason, res.n_calls) == ("ok", "", 1) and res.reward < 1.0


@pytest.mark.integration
async def test_failed_statuses_carry_their_reason(nats_url, run_name, bwrap):
    """Every failure names its reason: the metric's label, in the result."""
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        missing = await run_rollout(request(cmd="true", task_id="nope"), 1, deps)
        unknown = await run_rollout(request("nope-harness"), 1, deps)
        no_cmd = await run_rollout(request(cmd=""), 1, deps)
        exit127 = await run_rollout(request(cmd="no-such-harness-xyz"), 1, deps)
        slow = await run_rollout(request(cmd="sleep 4244", timeout_s=1.0), 1, deps)
    got = [(r.status, r.reason) for r in (missing, unknown, no_cmd, exit127, slow)]
    assert got == [
        ("harness_error", "task_not_found"),
        ("harness_error", "unknown_harness"),
        ("harness_error", "no_command"),
        ("harness_error", "harness_exit"),
        ("timeout", "timeout"),
    ]
    assert (exit127.harness_version, slow.harness_version) == ("", "")


@pytest.mark.integration
async def test_checker_crash_is_scored_zero_and_missing_module_tombstoned(
    nats_url, run_name, bwrap, tmp_path
):
    """A checker crashing on the workspace is the model's failure: ``ok``, reward 0, the
    checker's traceback in ``error``. One missing a module the task environment should provide
    is a ``verifier_error`` with reason ``verifier_environment``."""
    tasks = {}
    for name, checker in (
        ("crash", "import json, sys\njson.load(open(sys.argv[1] + '/out.json'))\n"),
        ("env", "import pandas_missing_here\n"),
    ):
        root = tmp_path / name
        (root / "reward").mkdir(parents=True)
        (root / "task.toml").write_text(f'id = "{name}"\ninstruction = "Write out.json."\n')
        (root / "reward" / "test.py").write_text(checker)
        tasks[name] = str(root)
    async with rollout_env(nats_url, run_name, bwrap) as (deps, _, _):
        crash = await run_rollout(request(cmd="true", suite="", task_id=tasks["crash"]), 1, deps)
        env = await run_rollout(request(cmd="true", suite="", task_id=tasks["env"]), 1, deps)
    assert (crash.status, crash.reason, crash.reward) == ("ok", "", 0.0)
    assert crash.error.startswith("checker failed (scored 0): test.py exited with status 1")
    assert "FileNotFoundError" in crash.error and "out.json" in crash.error
    assert (env.status, env.reason) == ("verifier_error", "verifier_environment")
    assert "pandas_missing_here" in env.error


MODEL_CALL = (
    "import json, os, urllib.request as u; u.urlopen(u.Request("
    "os.environ['OPENAI_BASE_URL'] + '/chat/completions', json.dumps({'model': "
    "os.environ['OPENAI_MODEL'], 'messages': [{'role': 'user', 'content': 'hi'}]}).encode(), "
    "{'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
    "'Content-Type': 'application/json'})).read()"
)
"""A command harness's one model call through the proxy (stdlib only)."""


def comm_and_ppid(pid: int) -> tuple[str, int]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.index("(") + 1 : stat.rindex(")")], int(
        stat[stat.rindex(")") + 2 :].split()[1]
    )


async def killed_mid_run(deps, group_id: str, then: str, victim: str):
    """Run a command harness that calls the model once and then runs ``then`` (``exec sleep
    N``); once that sleep runs, SIGKILL ``victim`` from outside: the harness (``sleep``, as the
    OOM killer would), the sandbox's ``bwrap``, or its pid namespace's ``init``."""
    import asyncio
    import shlex
    import signal

    cmd = f"python3 -c {shlex.quote(MODEL_CALL)} && {then}"
    task = asyncio.create_task(run_rollout(request(cmd=cmd, group_id=group_id), 1, deps))
    secs = then.split()[-1]
    for _ in range(600):
        sleeping = processes_with(f"sleep\x00{secs}")
        if sleeping or task.done():
            break
        await asyncio.sleep(0.05)
    assert sleeping, "the harness never got past its model call"
    (sleep_pid,) = sleeping
    chain = [p for p in processes_with(f"exec sleep {secs}") if comm_and_ppid(p)[0] == "bwrap"]
    outer = [p for p in chain if comm_and_ppid(p)[1] == os.getpid()]
    init = [p for p in chain if comm_and_ppid(p)[1] in outer]
    pid = {"sleep": [sleep_pid], "bwrap": outer, "init": init}[victim]
    assert len(pid) == 1, (victim, chain, outer, init)
    os.kill(pid[0], signal.SIGKILL)
    return await asyncio.wait_for(task, 60)


@pytest.mark.integration
@pytest.mark.parametrize("victim", ["sleep", "bwrap", "init"])
async def test_sandbox_killed_from_outside_is_tombstoned(nats_url, run_name, bwrap, victim):
    """A sandbox killed from outside mid-run (the harness SIGKILLed as by the OOM killer, or
    bwrap itself, or the sandbox's init) after the harness called the model is an
    infrastructure death: ``sandbox_error``/``sandbox_killed``, never verified, tombstoned
    downstream, nothing left behind; never ``ok`` with a reward the model would be trained
    on."""
    script = lambda ids, body: Reply(text="hello")  # noqa: E731
    async with rollout_env(nats_url, run_name, bwrap, script=script) as (deps, _, bus):
        res = await killed_mid_run(deps, f"gk{victim}", "exec sleep 4245", victim)
        calls = await bus.read_subject(bus.subjects.calls(res.rollout_id), CallRecord)
        assert sandbox_dirs(bwrap) == []
    assert (res.status, res.reason, res.n_calls) == ("sandbox_error", "sandbox_killed", 1), res
    assert "killed from outside" in res.error and "verify" not in res.durations
    assert assemble(calls, res).dropped_reason == "rollout_sandbox_error"
    assert processes_with("sleep\x004245") == []


@pytest.mark.integration
async def test_harness_exiting_137_by_itself_is_scored(nats_url, run_name, bwrap):
    """The control: a harness that calls the model and then exits 137 on its own (or dies of
    a signal other than SIGKILL, a crash) is the model's outcome, scored as usual."""
    script = lambda ids, body: Reply(text="hello")  # noqa: E731
    call = f"python3 -c {__import__('shlex').quote(MODEL_CALL)}"
    async with rollout_env(nats_url, run_name, bwrap, script=script) as (deps, _, _):
        own = await run_rollout(request(cmd=f"{call} && exit 137", group_id="gx1"), 1, deps)
        crash = await run_rollout(request(cmd=f"{call} && kill -SEGV $$", group_id="gx2"), 1, deps)
    for res in (own, crash):
        assert (res.status, res.reason, res.n_calls) == ("ok", "", 1), res
        assert "verify" in res.durations and res.reward < 1.0


CALL_FOREVER = r"""python3 -c '
import json, os, time, urllib.request
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
body = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
auth = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
while True:  # a harness that retries for ever, as real ones do on a 5xx
    try:
        urllib.request.urlopen(urllib.request.Request(url, body.encode(), auth), timeout=60)
    except Exception:
        pass
    time.sleep(0.1)
'"""


@pytest.mark.integration
async def test_dead_engine_stops_the_harness_within_the_grace(nats_url, run_name, bwrap):
    """A real engine process SIGKILLed mid-rollout while the harness keeps calling and
    retrying: once no engine has been in rotation for ``engine_grace_s`` the harness is stopped
    and the rollout ends as ``engine_error`` in seconds, not at the harness's timeout (300 s
    here); nothing of it is left running."""
    import asyncio
    import signal
    import time

    from harnessrl.common.models import resolve_model
    from harnessrl.proxy.engine_cmd import spawn_engine

    proc, url = spawn_engine(["--model", str(resolve_model("tiny-1m")), "--threads", "1"])
    bus = await connect(nats_url, run_name)
    cfg = RolloutSettings(
        engines=[url],
        model="tiny-1m",
        install_harnesses=False,
        engine_grace_s=2.0,
        engine_health_interval_s=0.5,
    )
    try:
        async with RolloutDeps.open(cfg, bus, actor="test", backend=bwrap) as deps:
            req = request(cmd=CALL_FOREVER, group_id="gdead", timeout_s=300.0)
            rollout = asyncio.ensure_future(run_rollout(req, 1, deps))
            rid = "gdead-0-1"
            while deps.router.outcome(rid).ok < 2:  # the harness is calling the engine
                assert not rollout.done(), rollout.result()
                await asyncio.sleep(0.1)
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            res = await asyncio.wait_for(rollout, 60)
            took = time.monotonic() - killed
            assert sandbox_dirs(bwrap) == []
    finally:
        await bus.close()
        proc.kill()
        proc.wait()
    assert (res.status, res.reason) == ("engine_error", "engine_unreachable"), res
    assert "no engine in rotation for 2 s" in res.error and url in res.error
    assert took < 20, took  # detection (~1 s) + the grace (2 s) + stopping the sandbox
    assert "verify" not in res.durations and res.n_calls >= 2
    assert processes_with("urllib.request.urlopen") == []

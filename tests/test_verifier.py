"""The verifier, run in real bubblewrap sandboxes (skipped where bwrap cannot run); checker
lint is tested in test_lint.py.

The rubric judge is a real aiohttp server speaking the OpenAI chat API with scripted replies.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from aiohttp import web

from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.bwrap import BwrapBackend
from harnessrl.actors.verifier import (
    JudgeConfig,
    RubricJudge,
    combine,
    run_solution,
    verify,
)
from harnessrl.common.tasks import CLAWGYM_MOUNT, Task, load_task_path
from tests.treefiles import write


def make_task(
    root: Path,
    checker: str,
    *,
    toml: str = "",
    solve: str = "",
    head: str = 'instruction = "Do the thing."\n',
    **files: str,
) -> Task:
    """A native task whose reward/test.py is ``checker`` (files: rel path with / as __)."""
    head = 'id = "t"\n' + head + textwrap.dedent(toml)
    extra = {k.replace("__", "/"): v for k, v in files.items()}
    if solve:
        extra["solution/solve.sh"] = solve
    write(root, {"task.toml": head, "reward/test.py": checker, "workspace/in.txt": "x\n", **extra})
    return load_task_path(root)


async def verify_fresh(backend: BwrapBackend, task: Task, judge=None, setup=None):
    spec = SandboxSpec(workspace_src=task.workspace_dir, workdir=task.mount)
    async with await backend.create(spec) as sb:
        if setup is not None:
            await setup(sb)
        return await verify(task, sb, judge)


# ---------------------------------------------------------------------- code checkers


@pytest.mark.integration
async def test_weighted_mean_of_metrics(backend: BwrapBackend, tmp_path: Path):
    """reward = weighted mean of the checker's metrics; bools count as 0/1."""
    checker = 'import json; print("debug line"); print(json.dumps({"a": 1, "b": 0.0, "c": True}))'
    task = make_task(tmp_path / "t", checker, toml="[score]\nweights = { b = 2.0 }\n")
    res = await verify_fresh(backend, task)
    assert res.status == "ok", res.error
    assert res.metrics == {"a": 1.0, "b": 0.0, "c": 1.0}
    assert res.reward == pytest.approx(0.5) and res.code_score == pytest.approx(0.5)
    assert res.rubric_score is None and res.duration > 0


@pytest.mark.integration
@pytest.mark.parametrize(
    ("checker", "needle"),
    [
        ("print('all good!')", "not a JSON dict"),
        ("print('')", "printed nothing"),
        ("import json; print(json.dumps({'a': 1.5}))", "outside [0, 1]"),
        ("import json; print(json.dumps({'a': -0.1}))", "outside [0, 1]"),
        ("print('{\"a\": NaN}')", "outside [0, 1]"),
        ("import json; print(json.dumps({'a': 'high'}))", "not a number"),
        ("print('{}')", "empty dict"),
        ("print('[1, 0]')", "not a JSON dict"),
    ],
)
async def test_bad_checkers_are_verifier_errors(
    backend: BwrapBackend, tmp_path: Path, checker: str, needle: str
):
    """A checker that exits 0 printing garbage is a verifier_error with a clear message."""
    res = await verify_fresh(backend, make_task(tmp_path / "t", checker))
    assert res.status == "verifier_error" and needle in res.error and res.reason == ""
    assert res.reward == 0.0 and res.code_score is None


@pytest.mark.integration
@pytest.mark.parametrize(
    ("checker", "needles"),
    [
        (
            "import json, pathlib\n"
            "def load(ws):\n"
            "    return json.loads((pathlib.Path(ws) / 'out.json').read_text())['total']\n"
            "import sys; print(json.dumps({'ok': float(load(sys.argv[1]) == 3)}))\n",
            ["exited with status 1", "Traceback", "in load", "FileNotFoundError", "out.json"],
        ),
        (
            "import os, sys; sys.stderr.write('bad input\\n'); os._exit(3)",
            ["status 3", "bad input"],
        ),
        (  # a module the agent was to write (the instruction names thing.py) is not missing
            "import sys; sys.path.insert(0, sys.argv[1]); import thing",
            ["No module named 'thing'"],
        ),
        ("import subprocess; subprocess.run(['sh', 'go.sh'], check=True)", ["CalledProcess"]),
    ],
)
async def test_crashing_checker_scores_zero(
    backend: BwrapBackend, tmp_path: Path, checker: str, needles: list[str]
):
    """ClawGym semantics: a checker that crashes or exits non-zero without a score scores 0
    (status ok, so the rollout is trained on), its traceback kept in ``checker_error``."""
    toml = 'instruction = "Write thing.py and go.sh."\n'
    task = make_task(tmp_path / "t", checker, head=toml)
    res = await verify_fresh(backend, task)
    assert res.status == "ok", res.error
    assert res.reward == 0.0 and res.code_score == 0.0 and res.metrics == {}
    for needle in needles:
        assert needle in res.checker_error, res.checker_error
    assert res.to_dict()["checker_error"] == res.checker_error


@pytest.mark.integration
@pytest.mark.parametrize(
    ("checker", "reason", "needle"),
    [
        ("import pandas_not_in_this_env", "environment", "module 'pandas_not_in_this_env'"),
        ("from yaml_nope.sub import x", "environment", "module 'yaml_nope'"),
        (
            "import subprocess; subprocess.run('jq-not-here . x.json', shell=True, check=True)",
            "environment",
            "command 'jq-not-here'",
        ),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed", "killed"),
        ("raise MemoryError()", "killed", "out of memory"),
    ],
)
async def test_infrastructure_failures_are_verifier_errors(
    backend: BwrapBackend, tmp_path: Path, checker: str, reason: str, needle: str
):
    """A checker killed, out of memory, or missing a module or command the task's environment
    should provide is no score of the workspace: a verifier_error (tombstone) with a reason."""
    res = await verify_fresh(backend, make_task(tmp_path / "t", checker))
    assert res.status == "verifier_error" and res.reason == reason, (res.reason, res.error)
    assert needle in res.error and res.checker_error == ""


@pytest.mark.integration
async def test_checker_timeout(
    backend: BwrapBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A checker that outlives its timeout is killed and reported, not scored."""
    import harnessrl.actors.verifier

    monkeypatch.setattr(harnessrl.actors.verifier, "STAGE_SLACK_S", 0.5)
    task = make_task(
        tmp_path / "t", "import time; time.sleep(30)", toml="[timeouts]\nverifier_s = 0.5\n"
    )
    res = await verify_fresh(backend, task)
    assert res.status == "verifier_error" and "timed out after 0.5 s" in res.error
    assert res.reason == "timeout"


@pytest.mark.integration
async def test_valid_metrics_with_nonzero_exit_count(backend: BwrapBackend, tmp_path: Path):
    """A checker may exit non-zero after printing valid metrics (some signal failure that way)."""
    checker = 'import json, sys; print(json.dumps({"ok": 0})); sys.exit(1)'
    res = await verify_fresh(backend, make_task(tmp_path / "t", checker))
    assert res.status == "ok" and res.reward == 0.0


@pytest.mark.integration
async def test_reward_files_hidden_from_harness_and_workspace(
    backend: BwrapBackend, tmp_path: Path
):
    """Before verify the reward files are nowhere in the sandbox; during verify they are outside
    the workspace, and what the harness planted in $HOME cannot hijack the checker."""
    checker = """\
        import json, os, sys
        ws = sys.argv[1]
        here = os.path.dirname(os.path.abspath(__file__))
        listing = [f for _, _, fs in os.walk(ws) for f in fs]
        print(json.dumps({
            "outside_ws": float(not here.startswith(ws)),
            "ws_clean": float(sorted(listing) == ["in.txt", "planted.txt"]),
            "cwd_is_ws": float(os.getcwd() == ws),
        }))
        """
    task = make_task(tmp_path / "t", checker, reward__secret_marker_8f3a="hidden\n")

    async def harness(sb):
        prune = " ".join(f"-path {d} -prune -o" for d in ("/proc", "/sys", "/usr", "/etc"))
        r = await sb.run(["sh", "-c", f"find / {prune} -name 'secret*' -print"], timeout=60)
        assert r.stdout == b"" and not r.timed_out, r.stdout
        site = "$HOME/.local/lib/python3.11/site-packages"
        hack = "import builtins; builtins.print = lambda *a, **k: None"
        await sb.run(["sh", "-c", f"mkdir -p {site} && echo '{hack}' > {site}/usercustomize.py"])
        await sb.write_file("planted.txt", b"x")

    res = await verify_fresh(backend, task, setup=harness)
    assert res.status == "ok", res.error
    assert res.metrics == {"outside_ws": 1.0, "ws_clean": 1.0, "cwd_is_ws": 1.0}


@pytest.mark.integration
async def test_clawgym_folder_end_to_end(backend: BwrapBackend, tmp_path: Path):
    """ClawGym layout: workspace at input_mount_dir, reward files at <mount>/reward, reward.sh's
    last line is the score, check.py's dict the metrics; a planted reward/ dir is ignored."""
    root = write(
        tmp_path / "task_0001",
        {
            "data_entry.json": json.dumps(
                {
                    "task_id": "task_0001",
                    "user_query": "Write a summary.",
                    "metadata": {"category": "Content", "grading_type": "automated"},
                    "input_mount_dir": CLAWGYM_MOUNT,
                }
            ),
            "input_files/notes.md": "notes\n",
            "reward/check.py": f"""\
                import json, os, sys
                ws = sys.argv[1]
                assert ws == "{CLAWGYM_MOUNT}", ws
                ok = os.path.isfile(os.path.join(ws, "summary.md"))
                print(json.dumps({{"exists": float(ok), "notes_kept": 1.0}}))
                """,
            "reward/reward.sh": f"""\
                #!/usr/bin/env bash
                set -euo pipefail
                echo "checking {CLAWGYM_MOUNT}"
                python3 {CLAWGYM_MOUNT}/reward/check.py {CLAWGYM_MOUNT} | python3 -c 'import json,sys; d=json.load(sys.stdin); print(sum(d.values())/len(d))'
                """,
        },
    )
    task = load_task_path(root)

    async def harness(sb):
        await sb.write_file("summary.md", b"done\n")
        await sb.write_file("reward/reward.sh", b"echo 1.0\n")  # a cheat that must not survive

    res = await verify_fresh(backend, task, setup=harness)
    assert res.status == "ok", res.error
    assert res.reward == 1.0 and res.metrics == {"exists": 1.0, "notes_kept": 1.0}
    res = await verify_fresh(backend, task)
    assert res.status == "ok" and res.reward == 0.5 and res.metrics["exists"] == 0.0


@pytest.mark.integration
async def test_clawgym_reward_sh_garbage(backend: BwrapBackend, tmp_path: Path):
    """A reward.sh whose last line is not a number in [0, 1] is a verifier_error."""
    root = write(
        tmp_path / "c",
        {
            "data_entry.json": json.dumps({"task_id": "c", "user_query": "q"}),
            "reward/reward.sh": "echo 3.5\n",
        },
    )
    res = await verify_fresh(backend, load_task_path(root))
    assert res.status == "verifier_error" and "outside [0, 1]" in res.error


def clawgym_task(root: Path, check_py: str, reward_sh: str = "", query: str = "q") -> Task:
    """A ClawGym folder whose reward.sh (default: ClawGym's usual one, averaging check.py's
    dict, with check.py's stderr thrown away) runs ``check_py``."""
    reward_sh = reward_sh or (
        f"python3 {CLAWGYM_MOUNT}/reward/check.py {CLAWGYM_MOUNT} 2>/dev/null"
        " | python3 -c 'import json,sys; d=json.load(sys.stdin); print(sum(d.values())/len(d))'\n"
    )
    entry = {"task_id": root.name, "user_query": query, "input_mount_dir": CLAWGYM_MOUNT}
    files = {
        "data_entry.json": json.dumps(entry),
        "input_files/data.csv": "a,b\n1,2\n",
        "reward/check.py": check_py,
        "reward/expected.json": '{"rows": 1}\n',
        "reward/reward.sh": reward_sh,
    }
    return load_task_path(write(root, files))


COUNTING_CHECK = """\
    import json, os, sys
    with open("/tmp/hrl-test-check-runs", "a") as f:
        f.write("run\\n")
    ws = sys.argv[1]
    expected = json.load(open("@MOUNT@/reward/expected.json"))
    print(json.dumps({"rows": float(expected["rows"] == 1), "out": float(os.path.exists(ws + "/out.txt"))}))
    """.replace("@MOUNT@", CLAWGYM_MOUNT)


@pytest.mark.integration
async def test_clawgym_check_py_runs_once(backend: BwrapBackend, tmp_path: Path):
    """reward.sh runs check.py once per verification, whatever reward.sh does with it; its
    printed dict still gives the metrics (and reward.sh's average the reward)."""
    task = clawgym_task(tmp_path / "once", COUNTING_CHECK)
    spec = SandboxSpec(workspace_src=task.workspace_dir, workdir=task.mount)
    async with await backend.create(spec) as sb:
        res = await verify(task, sb)
        runs = await sb.run(["cat", "/tmp/hrl-test-check-runs"])
        assert res.status == "ok", res.error
        assert runs.stdout.decode().split() == ["run"]
        assert res.reward == 0.5 and res.metrics == {"rows": 1.0, "out": 0.0}
        await sb.write_file("out.txt", b"x")
        res = await verify(task, sb)
        runs = await sb.run(["cat", "/tmp/hrl-test-check-runs"])
    assert res.reward == 1.0 and res.metrics == {"rows": 1.0, "out": 1.0}
    assert runs.stdout.decode().split() == ["run", "run"]


@pytest.mark.integration
async def test_clawgym_checker_files_not_in_workspace(backend: BwrapBackend, tmp_path: Path):
    """A checker that searches the judged workspace for its own files finds none of them;
    its absolute <input_mount_dir>/reward paths (in reward.sh and check.py) still work."""
    check = """\
        import json, os, sys
        ws = sys.argv[1]
        mine = {"check.py", "reward.sh", "expected.json"}
        found = [os.path.join(d, f) for d, _, fs in os.walk(ws) for f in fs if f in mine]
        here = os.path.dirname(os.path.abspath(__file__))
        data = json.load(open("@MOUNT@/reward/expected.json"))
        print(json.dumps({
            "nothing_found": float(not found),
            "outside_ws": float(not here.startswith(ws)),
            "no_reward_dir": float(not os.path.exists(os.path.join(ws, "reward"))),
            "data_read": float(data == {"rows": 1}),
        }))
        """.replace("@MOUNT@", CLAWGYM_MOUNT)
    task = clawgym_task(tmp_path / "hide", check)
    assert task.reward_mount == f"{CLAWGYM_MOUNT}/reward"
    res = await verify_fresh(backend, task)
    assert res.status == "ok", res.error
    assert res.metrics == {
        "nothing_found": 1.0,
        "outside_ws": 1.0,
        "no_reward_dir": 1.0,
        "data_read": 1.0,
    }
    assert res.reward == 1.0


@pytest.mark.integration
async def test_clawgym_crash_scores_zero_with_checker_traceback(
    backend: BwrapBackend, tmp_path: Path
):
    """check.py crashing on malformed output (its stderr thrown away by reward.sh, whose
    averaging step then fails on the empty input) scores 0; the message holds check.py's own
    traceback, not only the averaging step's JSONDecodeError."""
    check = """\
        import json, sys
        def total(path):
            return sum(row["amount"] for row in json.load(open(path)))
        print(json.dumps({"total_ok": float(total(sys.argv[1] + "/out.json") == 3)}))
        """
    task = clawgym_task(tmp_path / "crash", check)

    async def harness(sb):
        await sb.write_file("out.json", b'{"amount": "three"}')  # wrong type

    res = await verify_fresh(backend, task, setup=harness)
    assert res.status == "ok" and res.reward == 0.0, res.error
    err = res.checker_error
    assert err.startswith("check.py exited with status 1:"), err
    assert "in total" in err and "TypeError" in err and "JSONDecodeError" in err
    assert err.index("TypeError") < err.index("JSONDecodeError")


@pytest.mark.integration
async def test_clawgym_missing_module_is_environment_failure(backend: BwrapBackend, tmp_path: Path):
    """check.py failing on a module the task's environment lacks is a verifier_error (the
    rollout is tombstoned), even when reward.sh turns the failure into a score."""
    check = "import json\nimport pandas_missing_here\nprint(json.dumps({'x': 1}))\n"
    masking = (
        f"python3 {CLAWGYM_MOUNT}/reward/check.py {CLAWGYM_MOUNT} > /dev/null 2>&1 || echo 0\n"
    )
    for name, sh in (("plain", ""), ("masked", masking)):
        res = await verify_fresh(backend, clawgym_task(tmp_path / name, check, sh))
        assert res.status == "verifier_error" and res.reason == "environment", (name, res)
        assert "module 'pandas_missing_here'" in res.error
    res = await verify_fresh(backend, clawgym_task(tmp_path / "cmd", check, "python 1.py\n"))
    assert res.status == "verifier_error" and res.reason == "environment", res
    assert "command 'python'" in res.error


HARBOR_TOML = "[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 60.0\n"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("test_sh", "reward", "metrics"),
    [
        (
            "if grep -q hello /app/hello.txt; then echo 1 > /logs/verifier/reward.txt; "
            "else echo 0 > /logs/verifier/reward.txt; fi\n",
            1.0,
            {"reward": 1.0},
        ),
        (
            "cat > /logs/verifier/reward.json <<EOF\n"
            '{"exists": $(test -f hello.txt && echo 1 || echo 0),'
            ' "exact": $(grep -qx hello hello.txt && echo 1 || echo 0)}\nEOF\n',
            1.0,
            {"exists": 1.0, "exact": 1.0},
        ),
    ],
)
async def test_harbor_end_to_end(
    backend: BwrapBackend, tmp_path: Path, test_sh: str, reward: float, metrics: dict
):
    """Harbor: the solution (with /solution paths) runs, test.sh writes /logs/verifier/reward.*."""
    root = write(
        tmp_path / "hello",
        {
            "task.toml": HARBOR_TOML,
            "instruction.md": "Write hello to hello.txt\n",
            "environment/Dockerfile": "FROM ubuntu\nWORKDIR /app\nCOPY seed.txt /app/\n",
            "environment/seed.txt": "seed\n",
            "tests/test.sh": "test -f /tests/test.sh || exit 7\n" + test_sh,
            "solution/solve.sh": "cat /solution/word.txt > hello.txt\n",
            "solution/word.txt": "hello\n",
        },
    )
    task = load_task_path(root)
    assert task.mount == "/app"
    spec = SandboxSpec(workspace_src=task.workspace_dir, workdir=task.mount)
    async with await backend.create(spec) as sb:
        assert await sb.read_file("seed.txt") == b"seed\n"
        res0 = await verify(task, sb)
        await run_solution(task, sb)
        res = await verify(task, sb)
    assert res.status == "ok", res.error
    assert res.reward == reward and res.metrics == metrics
    assert res0.status == "ok" and res0.reward == 0.0


@pytest.mark.integration
async def test_harbor_without_reward_file(backend: BwrapBackend, tmp_path: Path):
    """A test.sh that fails writing no reward file scores 0 with its output kept; one that
    exits 0 without a reward file is a verifier_error saying so."""
    root = write(
        tmp_path / "h",
        {"instruction.md": "x\n", "tests/test.sh": "echo oops >&2; exit 2\n"},
    )
    res = await verify_fresh(backend, load_task_path(root))
    assert res.status == "ok" and res.reward == 0.0
    assert "test.sh exited with status 2" in res.checker_error and "oops" in res.checker_error
    (root / "tests/test.sh").write_text("echo fine\n")
    res = await verify_fresh(backend, load_task_path(root))
    assert res.status == "verifier_error"
    assert "neither reward.txt nor reward.json (exit 0)" in res.error and "fine" in res.error


# ---------------------------------------------------------------------- rubric judge


@pytest.fixture
async def judge_server():
    """An OpenAI-compatible chat endpoint replying from a script: list of (status, content)."""
    state: dict = {"replies": [], "requests": []}

    async def chat(request: web.Request) -> web.Response:
        state["requests"].append(await request.json())
        status, content = state["replies"].pop(0) if state["replies"] else (200, '{"scores": [1]}')
        if status != 200:
            return web.Response(status=status, text="judge trouble")
        msg = {"role": "assistant", "content": content}
        return web.json_response({"choices": [{"index": 0, "message": msg}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    judge = RubricJudge(
        JudgeConfig(url=f"http://127.0.0.1:{port}/v1", model="j", retries=1, retry_backoff_s=0.01)
    )
    yield state, judge
    await judge.close()
    await runner.cleanup()


RUBRIC_TOML = '[rubric]\nrules = ["Polite.", "Short."]\n'
HALF = 'import json; print(json.dumps({"a": 1, "b": 0}))'


@pytest.mark.integration
async def test_hybrid_score(backend: BwrapBackend, tmp_path: Path, judge_server):
    """0.7·code + 0.3·rubric; the judge sees instruction, rules and the workspace text."""
    state, judge = judge_server
    state["replies"] = [(200, 'Sure. {"scores": [1, 0.5], "reason": "fine"}')]
    task = make_task(tmp_path / "t", HALF, toml=RUBRIC_TOML)
    res = await verify_fresh(backend, task, judge)
    assert res.status == "ok" and res.judge_error == ""
    assert res.code_score == 0.5 and res.rubric_score == 0.75
    assert res.reward == pytest.approx(0.7 * 0.5 + 0.3 * 0.75)
    assert res.metrics["rubric"] == 0.75
    (req,) = state["requests"]
    user = req["messages"][-1]["content"]
    assert "Do the thing." in user and "1. Polite." in user and "### in.txt" in user


@pytest.mark.integration
@pytest.mark.parametrize(
    ("replies", "needle"),
    [
        ([(200, '{"scores": [0.8, 1]}')], "not one of"),
        ([(200, '{"scores": [1]}')], "expected 2 score(s)"),
        ([(200, "I think it is good.")], "no JSON scores"),
        ([(500, ""), (503, "")], "judge HTTP 503"),
        ([(400, "")], "judge HTTP 400"),
    ],
)
async def test_judge_failure_falls_back_to_code(
    backend: BwrapBackend, tmp_path: Path, judge_server, replies, needle
):
    """A judge that gives no valid score leaves the reward to the code side, and says why."""
    state, judge = judge_server
    state["replies"] = list(replies)
    res = await verify_fresh(backend, make_task(tmp_path / "t", HALF, toml=RUBRIC_TOML), judge)
    assert res.status == "ok" and res.reward == 0.5 and res.rubric_score is None
    assert needle in res.judge_error


@pytest.mark.integration
async def test_judge_retries_5xx(backend: BwrapBackend, tmp_path: Path, judge_server):
    """A 5xx is retried; the second answer counts."""
    state, judge = judge_server
    state["replies"] = [(502, ""), (200, '{"scores": [0, 0]}')]
    res = await verify_fresh(backend, make_task(tmp_path / "t", HALF, toml=RUBRIC_TOML), judge)
    assert res.rubric_score == 0.0 and res.reward == pytest.approx(0.35)
    assert len(state["requests"]) == 2


@pytest.mark.integration
async def test_rubric_only_task(backend: BwrapBackend, tmp_path: Path, judge_server):
    """With no code checker the rubric is the whole score; without a judge it is an error."""
    state, judge = judge_server
    state["replies"] = [(200, '{"scores": [0.25, 0.75]}')]
    task = make_task(tmp_path / "t", HALF, toml='[checker]\nkind = "none"\n' + RUBRIC_TOML)
    res = await verify_fresh(backend, task, judge)
    assert res.status == "ok" and res.reward == 0.5 and res.code_score is None
    res = await verify_fresh(backend, task)
    assert res.status == "verifier_error" and "no rubric judge" in res.error


@pytest.mark.unit
def test_combine_renormalises():
    """The hybrid renormalises to the sides that produced a number."""
    assert combine(0.5, 1.0, 0.7, 0.3) == pytest.approx(0.65)
    assert combine(0.5, None, 0.7, 0.3) == 0.5
    assert combine(None, 0.25, 0.7, 0.3) == 0.25
    assert combine(None, None, 0.7, 0.3) is None


@pytest.mark.unit
def test_judge_config_is_documented():
    """The judge's config follows the config rules (every field documented, strict)."""
    from harnessrl.common.config import undocumented_fields

    assert undocumented_fields(JudgeConfig) == []
    assert JudgeConfig.model_config.get("extra") == "forbid"

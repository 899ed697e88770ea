"""The test tiers (tests/helpers/tiers.py): collection refuses a test without exactly one tier
marker, and a ``unit`` test that starts a process or uses a socket fails, saying which tier to
mark it instead. The tests of this module that are ``unit`` run under that guard themselves."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.tiers import TierViolation

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_a_unit_test_cannot_start_a_subprocess() -> None:
    with pytest.raises(TierViolation, match="marked unit but started a subprocess.*integration"):
        subprocess.run([sys.executable, "-c", "pass"])


@pytest.mark.unit
async def test_a_unit_test_cannot_start_an_asyncio_subprocess() -> None:
    with pytest.raises(TierViolation, match="started a subprocess"):
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")


@pytest.mark.unit
def test_a_unit_test_cannot_fork() -> None:
    with pytest.raises(TierViolation, match=r"os\.fork"):
        if os.fork() == 0:  # only reached if the guard let the fork through
            os._exit(0)


@pytest.mark.unit
async def test_a_unit_test_cannot_serve_or_connect() -> None:
    with pytest.raises(TierViolation, match="bound a socket"):
        await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    with socket.socket() as s, pytest.raises(TierViolation, match="connected a socket"):
        s.connect(("127.0.0.1", 9))
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(TierViolation, match="bound"):
        s.bind("\0hrl-tiers-test")


@pytest.mark.unit
def test_a_unit_test_may_use_an_event_loop_and_threads() -> None:
    """What every unit test may do: an event loop (its self-pipe is a socketpair, no bind or
    connect) and threads."""
    assert asyncio.run(asyncio.to_thread(lambda: 42)) == 42


def sample(pytester: pytest.Pytester, code: str) -> None:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_sample=textwrap.dedent(code))


def tier_session(pytester: pytest.Pytester, code: str, *args: str) -> pytest.RunResult:
    sample(pytester, code)
    return pytester.runpytest("-p", "tests.helpers.tiers", "-p", "no:cacheprovider", *args)


@pytest.mark.unit
def test_collection_fails_on_a_test_without_exactly_one_tier(pytester: pytest.Pytester) -> None:
    """Unmarked and doubly marked tests are named with what to do; ``-m unit`` does not hide
    them (the check runs before deselection)."""
    code = """
        import pytest

        def test_bare():
            pass

        @pytest.mark.unit
        @pytest.mark.slow
        def test_both():
            pass

        @pytest.mark.integration
        def test_fine():
            pass
    """
    for args in ((), ("-m", "unit")):
        res = tier_session(pytester, code, *args)
        assert res.ret == pytest.ExitCode.USAGE_ERROR, res.outlines
        err = "\n".join(res.errlines)
        assert "2 test(s) without exactly one tier marker" in err, err
        assert "test_sample.py::test_bare: no tier marker" in err
        assert "test_sample.py::test_both: marked slow and unit: keep one" in err
        assert "test_fine" not in err
        assert "@pytest.mark.unit" in err and "pyproject.toml" in err


@pytest.mark.unit
def test_a_module_mark_is_the_tier_of_its_tests(pytester: pytest.Pytester) -> None:
    """``pytestmark`` gives every test of the module its tier; a unit test that starts a
    process fails with the guard's message, one that does not passes."""
    code = """
        import subprocess, sys
        import pytest

        pytestmark = pytest.mark.unit

        def test_pure():
            assert sum(range(4)) == 6

        def test_spawns():
            subprocess.run([sys.executable, "-c", "pass"])
    """
    res = tier_session(pytester, code)
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(
        ["*TierViolation*test_spawns is marked unit but started a subprocess*"]
    )


@pytest.mark.integration
def test_tiers_report_measures_each_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tiers-report`` runs tests unguarded, unmarked ones included, and records what each
    did and the tier that measures; the summary lists the tests declared otherwise."""
    code = """
        import socket, subprocess, sys, time
        import pytest

        @pytest.mark.unit
        def test_pure():
            pass

        @pytest.mark.unit
        def test_spawns():
            subprocess.run([sys.executable, "-c", "pass"])

        def test_connects():
            with socket.socket() as s:
                s.connect_ex(("127.0.0.1", 9))
    """
    report = pytester.path / "tiers.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the plugin, from this checkout
    sample(pytester, code)
    res = pytester.runpytest_subprocess(
        "-p", "tests.helpers.tiers", "-p", "no:cacheprovider", f"--tiers-report={report}"
    )
    res.assert_outcomes(passed=3)
    got = {
        (line := json.loads(raw))["nodeid"].split("::")[1]: line
        for raw in report.read_text().splitlines()
    }
    assert {k: (v["declared"], v["measured"], v["used"]) for k, v in got.items()} == {
        "test_pure": (["unit"], "unit", []),
        "test_spawns": (["unit"], "integration", ["process"]),
        "test_connects": ([], "integration", ["connect"]),
    }
    res.stdout.fnmatch_lines(["*2 of 3 tests measure another tier*"])


@pytest.mark.integration
def test_slow_tests_run_one_after_another_on_one_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``-n 2 --dist loadgroup`` (the README's test command) every ``slow`` test runs on
    the same worker, never two at once, while the other tiers spread over both workers."""
    log = pytester.path / "ran.log"
    code = f"""
        import os, time
        import pytest

        def note(tier):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{tier}} {{os.environ['PYTEST_XDIST_WORKER']}} {{time.time()}}\\n")

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.slow
        def test_slow(i):
            note("slow-start")
            time.sleep(0.3)
            note("slow-end")

        @pytest.mark.parametrize("i", range(8))
        @pytest.mark.integration
        def test_quick(i):
            time.sleep(0.3)
            note("quick")
    """
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the plugin, from this checkout
    sample(pytester, code)
    res = pytester.runpytest_subprocess(
        "-p",
        "tests.helpers.tiers",
        "-p",
        "tests.helpers.slow_group",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--dist",
        "loadgroup",
    )
    res.assert_outcomes(passed=12)
    rows = [line.split() for line in log.read_text().splitlines()]
    slow = [(what, worker, float(t)) for what, worker, t in rows if what.startswith("slow")]
    assert len({worker for _, worker, _ in slow}) == 1
    events = sorted(slow, key=lambda r: r[2])
    assert [what for what, _, _ in events] == ["slow-start", "slow-end"] * 4  # never overlap
    assert {worker for what, worker, _ in rows if what == "quick"} == {"gw0", "gw1"}

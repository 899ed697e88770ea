"""Checker lint (``actors/lint.py``), run in real bubblewrap sandboxes (skipped where bwrap
cannot run).

The corpus: one deliberately flawed ClawGym-format checker (``data_entry.json``,
``input_files/``, ``reward/reward.sh`` + ``check.py``, no reference solution) per flaw class
found in ClawGym-Bench, each of which lint must flag, and a correct checker it must pass.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from harnessrl.actors.lint import LintConfig, backend_factory, infer_outputs, lint_task, lint_tasks
from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.bwrap import BwrapBackend
from harnessrl.actors.verifier import verify
from harnessrl.common import cli
from harnessrl.common.tasks import CLAWGYM_MOUNT, Task, load_task_path
from tests.treefiles import write

M = CLAWGYM_MOUNT
REWARD_SH = f"""\
#!/usr/bin/env bash
set -o pipefail
python3 {M}/reward/check.py {M} | python3 -c 'import json, sys; d = json.load(sys.stdin); print(sum(d.values()) / len(d))'
"""
HEAD = "import csv, json, os, sys\nfrom pathlib import Path\nws = sys.argv[1]\n"


def clawgym(root: Path, query: str, check: str, **inputs: str) -> Task:
    """A ClawGym task folder: ``check`` is check.py's body (after `HEAD`), ``inputs`` the
    input files (``__`` for ``/``)."""
    entry = {"task_id": root.name, "user_query": query, "input_mount_dir": M}
    files = {
        "data_entry.json": json.dumps(entry),
        "reward/reward.sh": REWARD_SH,
        "reward/check.py": HEAD + textwrap.dedent(check),
        **{f"input_files/{k.replace('__', '/')}": v for k, v in inputs.items()},
    }
    return load_task_path(write(root, files))


def native(root: Path, checker: str, *, solve: str = "", instruction: str = "Do it.") -> Task:
    files = {
        "task.toml": f"id = {root.name!r}\ninstruction = {instruction!r}\n",
        "reward/test.py": checker,
        "workspace/in.txt": "x\n",
    }
    if solve:
        files["solution/solve.sh"] = solve
    return load_task_path(write(root, files))


# ------------------------------------------------------------------------- the flawed corpus

CORPUS = {
    # an existence check that passes for an empty file
    "exists_empty": (
        "Read notes.md and save a one-paragraph summary as report.md.",
        """\
        p = os.path.join(ws, "report.md")
        text = open(p).read() if os.path.exists(p) else ""
        print(json.dumps({"exists": float(os.path.exists(p)),
                          "mentions_budget": float("budget" in text.lower())}))
        """,
        {"notes.md": "The budget grew 10% in Q3.\n"},
        ("passes_failing_probe", "exists", "empty"),
    ),
    # a length limit that an empty (here: missing) file satisfies
    "word_limit": (
        "Write a short bio of Ada Lovelace for the team page and save it as bio.txt. "
        "Keep it under 80 words.",
        """\
        p = os.path.join(ws, "bio.txt")
        text = open(p).read() if os.path.exists(p) else ""
        print(json.dumps({"under_80_words": float(len(text.split()) < 80),
                          "names_ada": float("ada" in text.lower())}))
        """,
        {"brief.md": "Team page bios.\n"},
        ("passes_failing_probe", "under_80_words", "untouched"),
    ),
    # a checker that crashes on the task's own inputs (no output yet): exits non-zero
    "crash_exit": (
        "Count the data rows of data.csv and write the number to count.txt.",
        """\
        n = int(open(os.path.join(ws, "count.txt")).read())
        print(json.dumps({"count_right": float(n == 3)}))
        """,
        {"data.csv": "a,b\n1,2\n3,4\n5,6\n"},
        ("crash_on_inputs", "", "untouched"),
    ),
    # ... and one that swallows its crash, so it compares empty with empty
    "crash_swallowed": (
        "List the customers in customers.csv whose balance is negative, one name per line, "
        "in overdue.txt.",
        """\
        try:
            rows = list(csv.DictReader(open(os.path.join(ws, "customers.csv"))))
            expected = sorted(r["name"] for r in rows if float(r["amount"]) < 0)  # no such column
        except Exception:
            expected = []
        try:
            got = sorted(ln.strip() for ln in open(os.path.join(ws, "overdue.txt")) if ln.strip())
        except Exception:
            got = []
        print(json.dumps({"names_match": float(got == expected)}))
        """,
        {"customers.csv": "name,balance\nAda,-5\nBob,10\n"},
        ("passes_failing_probe", "names_match", "untouched"),
    ),
    # per-row checks that pass vacuously over zero rows
    "vacuous_rows": (
        "From people.csv, write adults.csv with the columns name,age holding only the people "
        "aged 18 or over.",
        """\
        p = os.path.join(ws, "adults.csv")
        rows = list(csv.DictReader(open(p))) if os.path.exists(p) else []
        def age(r):
            try:
                return int(r.get("age") or 0)
            except ValueError:
                return 0
        print(json.dumps({"all_adults": float(all(age(r) >= 18 for r in rows)),
                          "names_present": float(all((r.get("name") or "").strip() for r in rows))}))
        """,
        {"people.csv": "name,age\nAda,36\nTim,12\n"},
        ("passes_failing_probe", "all_adults", "untouched"),
    ),
    # an empty list counts as sorted, and as equal to an empty expected set
    "empty_sorted": (
        "numbers.json holds a list of integers. Write sorted.json: the same numbers in "
        "ascending order. Write dups.json: a JSON list of the numbers that occur more than once.",
        """\
        def load(name):
            try:
                return json.load(open(os.path.join(ws, name)))
            except Exception:
                return []
        nums = json.load(open(os.path.join(ws, "numbers.json")))
        s, d = load("sorted.json"), load("dups.json")
        print(json.dumps({"ascending": float(s == sorted(s)),
                          "dups_right": float(set(d) == {n for n in nums if nums.count(n) > 1})}))
        """,
        {"numbers.json": "[5, 3, 9, 1]\n"},
        ("passes_failing_probe", "ascending", "untouched"),
    ),
    # a checker that searches the workspace for a script and finds itself
    "finds_itself": (
        "Write a Python script that prints the first ten prime numbers and leave it in the "
        "workspace.",
        """\
        scripts = list(Path(ws).rglob("*.py"))
        print(json.dumps({"script_written": float(any("print" in p.read_text() for p in scripts)),
                          "primes_right": 0.0}))
        """,
        {"README.md": "Scratch space.\n"},
        ({"passes_failing_probe", "reads_verifier_files"}, "script_written", None),
    ),
}

CORRECT = (
    "Read notes.md and save a summary as report.md: under 60 words, naming the budget and Q3.",
    """\
    try:
        text = open(os.path.join(ws, "report.md")).read()
    except (OSError, UnicodeDecodeError):
        text = ""
    low = text.lower()
    on_topic = "budget" in low
    print(json.dumps({"mentions_budget": float(on_topic),
                      "mentions_q3": float("q3" in low),
                      "under_60_words": float(on_topic and 0 < len(text.split()) < 60)}))
    """,
    {"notes.md": "The budget grew 10% in Q3.\n"},
)


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, Task]:
    tasks = {n: clawgym(tmp_path / n, q, c, **i) for n, (q, c, i, _) in CORPUS.items()}
    tasks["correct"] = clawgym(tmp_path / "correct", CORRECT[0], CORRECT[1], **CORRECT[2])
    return tasks


@pytest.mark.integration
async def test_lint_flags_every_flaw_class(backend: BwrapBackend, corpus: dict[str, Task]):
    """Each flawed checker of the corpus is flagged by the rule of its class, naming the metric
    and the probe that show it; the correct checker is clean."""
    reports = await lint_tasks(list(corpus.values()), backend_factory(backend), jobs=4)
    by_name = {Path(r.task).name: r for r in reports}
    for name, (*_, (rule, metric, probe)) in CORPUS.items():
        rep = by_name[name]
        assert not rep.ok, name
        rules = {p.rule for p in rep.problems}
        if isinstance(rule, set):  # depends on where the verifier stages the checker's files
            assert rules and rules <= rule, (name, rep.problems)
            assert any(metric in p.metric for p in rep.problems), (name, rep.problems)
            continue
        hits = [p for p in rep.problems if (p.rule, p.metric, p.probe) == (rule, metric, probe)]
        assert hits, (name, [str(p) for p in rep.problems])
    ok = by_name["correct"]
    assert ok.ok, [str(p) for p in ok.problems]
    assert ok.outputs == ["report.md"]
    assert {p.probe: p.score for p in ok.probes} == dict.fromkeys(
        ("untouched", "empty", "wrong_type", "truncated"), 0.0
    )


@pytest.mark.integration
async def test_correct_checker_scores_a_correct_answer(backend: BwrapBackend, tmp_path: Path):
    """The corpus's correct checker is not clean by scoring everything 0: a right answer is 1."""
    task = clawgym(tmp_path / "correct", CORRECT[0], CORRECT[1], **CORRECT[2])
    spec = SandboxSpec(workspace_src=task.workspace_dir, workdir=task.mount)
    async with await backend.create(spec) as sb:
        await sb.write_file("report.md", b"The budget grew 10% in Q3.\n")
        res = await verify(task, sb)
    assert res.status == "ok" and res.reward == 1.0, res


@pytest.mark.integration
async def test_reads_verifier_files(backend: BwrapBackend, tmp_path: Path):
    """A checker whose verdict depends on finding its own files in the workspace is flagged by
    the decoy probe (native task: its files are staged outside the workspace)."""
    checker = HEAD + textwrap.dedent(CORPUS["finds_itself"][1])
    task = native(tmp_path / "t", checker, instruction=CORPUS["finds_itself"][0])
    rep = await lint_task(task, backend_factory(backend))
    assert [(p.rule, p.metric, p.probe) for p in rep.problems] == [
        ("reads_verifier_files", "script_written", "decoy")
    ]
    assert rep.score("untouched") == 0.0 and rep.score("decoy") == 0.5


@pytest.mark.integration
async def test_threshold_is_configurable(backend: BwrapBackend, tmp_path: Path):
    """A probe scoring 0.5 fails at the default threshold and passes at 0.6."""
    q, c, i, _ = CORPUS["exists_empty"]
    task = clawgym(tmp_path / "t", q, c, **i)
    rep = await lint_task(task, backend_factory(backend))
    assert rep.score("empty") == 0.5 and not rep.ok
    rep = await lint_task(task, backend_factory(backend), cfg=LintConfig(threshold=0.6))
    assert rep.ok, [str(p) for p in rep.problems]


@pytest.mark.integration
async def test_shaping_metrics_only_warn(backend: BwrapBackend, tmp_path: Path):
    """A metric the task declares as reward shaping is left out of the threshold rule."""
    checker = """\
        import json, os, sys
        p = os.path.join(sys.argv[1], "out.txt")
        t = open(p).read() if os.path.exists(p) else ""
        print(json.dumps({"written": float(bool(t.strip())), "correct": float(t == "42\\n")}))
        """
    root = tmp_path / "t"
    task = native(root, textwrap.dedent(checker), instruction="Write 42 to out.txt.")
    rep = await lint_task(task, backend_factory(backend))
    assert {p.metric for p in rep.problems} == {"written"}
    toml = (root / "task.toml").read_text() + '[metadata.lint]\nshaping = ["written"]\n'
    (root / "task.toml").write_text(toml)
    rep = await lint_task(load_task_path(root), backend_factory(backend))
    assert rep.ok and any("'written'" in w for w in rep.warnings), rep.problems


# ------------------------------------------------------------------------- output names


@pytest.mark.unit
@pytest.mark.parametrize(
    ("prompt", "check", "want"),
    [
        ("Read notes.md and save the summary as report.md.", "", ["report.md"]),
        (
            "Write the cleaned rows to `out/clean.csv` and a log to ./run.log; the format "
            "follows https://example.com/spec.json, e.g. version 2.1 (use np.mean).",
            "",
            ["out/clean.csv", "run.log"],
        ),
        (
            "Put your answer where the grader expects it.",
            'import json, os, sys\nws = sys.argv[1]\nEXP = json.load(open("expected.json"))\n'
            'a = os.path.join(ws, "result.json")\nb = open(f"{ws}/notes.md")\n'
            f'c = "{M}/final/answer.md"\nd = "/etc/passwd.txt"\n',
            ["result.json", "final/answer.md"],
        ),
        ("Save the digest as digest.summary.", 'p = "digest.summary"', ["digest.summary"]),
        ("Save the digest as digest.summary.", "", []),
    ],
)
def test_infer_outputs(tmp_path: Path, prompt: str, check: str, want: list[str]):
    """Outputs come from file-like prompt tokens (named only in prose) and checker literals,
    minus the inputs and the checker's own files; URLs, versions and attributes are not files."""
    root = tmp_path / "t"
    write(root, {"reward/expected.json": "{}", "input_files/notes.md": "n\n"})
    task = clawgym(root, prompt, check)
    assert infer_outputs(task) == want


# ------------------------------------------------------------------------- reference solutions

ANNOUNCE_CHECKER = """\
    import json, pathlib, sys
    p = pathlib.Path(sys.argv[1]) / "announcement.txt"
    text = p.read_text() if p.exists() else ""
    print(json.dumps({{
        "mentions_date": float("June 14" in text),
        "under_120_words": float({limit}),
    }}))
    """
FLAWED = textwrap.dedent(ANNOUNCE_CHECKER.format(limit="len(text.split()) < 120"))
FIXED = textwrap.dedent(
    ANNOUNCE_CHECKER.format(limit='"June 14" in text and 0 < len(text.split()) < 120')
)
SOLVE = "echo 'Launch party on June 14 in the main hall.' > announcement.txt\n"


@pytest.mark.integration
async def test_solution_mutations(backend: BwrapBackend, tmp_path: Path):
    """With a reference solution: a metric that stays 1 under every mutation of its outputs is
    named (besides the untouched probe it passes); the fixed checker is clean and flips."""
    flawed = native(tmp_path / "flawed", FLAWED, solve=SOLVE)
    rep = await lint_task(flawed, backend_factory(backend))
    got = {(p.rule, p.metric) for p in rep.problems}
    assert got == {("passes_failing_probe", "under_120_words"), ("never_flips", "under_120_words")}
    assert rep.flips["mentions_date"] and not rep.flips["under_120_words"]
    fixed = native(tmp_path / "fixed", FIXED, solve=SOLVE)
    rep = await lint_task(fixed, backend_factory(backend))
    assert rep.ok, [str(p) for p in rep.problems]
    assert rep.outputs == ["announcement.txt"] and rep.mutations >= 3
    assert "delete announcement.txt" in rep.flips["under_120_words"]
    assert rep.untouched_reward == 0.0 and rep.solution_metrics == {
        "mentions_date": 1.0,
        "under_120_words": 1.0,
    }


@pytest.mark.integration
@pytest.mark.parametrize(
    ("checker", "solve", "rule", "needle"),
    [
        (
            'import json; t = open("out.txt").read(); print(json.dumps({"ok": float(t == "a\\n")}))',
            "echo a > out.txt\n",
            "crash_on_inputs",
            "crashes on the untouched workspace",
        ),
        (
            'import json; print(json.dumps({"ok": 1}))',
            "echo a > out.txt\n",
            "passes_failing_probe",
            "",
        ),
        (
            'import json, os; print(json.dumps({"ok": float(os.path.exists("out.txt"))}))',
            "echo a > wrong.txt\n",
            "solution_below_1",
            "reference solution scores 0.000",
        ),
        (
            'import json, os; print(json.dumps({"ok": float(os.path.exists("out.txt"))}))',
            "exit 4\n",
            "solution_fails",
            "solve.sh exited with status 4",
        ),
    ],
)
async def test_lint_problems(backend: BwrapBackend, tmp_path: Path, checker, solve, rule, needle):
    """Crashing checkers, trivially passing tasks and broken reference solutions."""
    task = native(tmp_path / "t", checker, solve=solve)
    rep = await lint_task(task, backend_factory(backend))
    hits = [p for p in rep.problems if p.rule == rule and needle in p.detail]
    assert hits, [str(p) for p in rep.problems]


# ------------------------------------------------------------------------- CLI


@pytest.mark.integration
def test_cli_lint(tmp_path: Path, monkeypatch, capsys):
    """``tasks lint`` exits 1 on a flawed task and 0 on a clean one; ``--json`` gives task, ok,
    problems (rule, metric, probe, detail) and the probe scores; ``--threshold`` applies."""
    monkeypatch.setitem(cli.COMMANDS, "tasks", cli.Command("tasks", "harnessrl.actors.tasks_cmd"))
    q, c, i, _ = CORPUS["exists_empty"]
    clawgym(tmp_path / "flawed", q, c, **i)
    clawgym(tmp_path / "fixed", CORRECT[0], CORRECT[1], **CORRECT[2])
    rc = cli.main(
        ["tasks", "lint", "--jobs", "2", str(tmp_path / "flawed"), str(tmp_path / "fixed")]
    )
    out = capsys.readouterr()
    if "bubblewrap is not usable" in out.err:
        pytest.skip(out.err)
    assert rc == 1 and "passes_failing_probe" in out.out and "1/2 tasks pass lint" in out.err
    assert cli.main(["tasks", "lint", "--json", str(tmp_path / "flawed")]) == 1
    (rep,) = json.loads(capsys.readouterr().out)
    assert rep["task"] == str(tmp_path / "flawed") and rep["ok"] is False
    assert rep["scores"]["empty"] == 0.5 and rep["outputs"] == ["report.md"]
    (prob,) = rep["problems"]
    assert prob["rule"] == "passes_failing_probe" and prob["metric"] == "exists"
    assert prob["probe"] == "empty" and set(prob) == {"rule", "metric", "probe", "detail"}
    assert {"probe", "score", "passed", "metrics", "error"} <= set(rep["probes"][0])
    assert cli.main(["tasks", "lint", "--threshold", "0.6", str(tmp_path / "flawed")]) == 0


@pytest.mark.unit
def test_cli_lint_help(capsys):
    """``tasks lint --help`` documents every flag, with LintConfig's defaults."""
    with pytest.raises(SystemExit):
        cli.main(["tasks", "lint", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    flags = ("--jobs", "--threshold", "--json", "--sandbox", "--mutations", "--no-mutations")
    for flag in (*flags, "--max-outputs N"):
        assert flag in out
    d = LintConfig()
    assert d.mutations is True and "(default: on)" in out
    assert f"(1 <= N <= 1000, default {d.max_outputs})" in out
    assert f"default {d.threshold})" in out


TWO_OUTPUTS = """import json, os
def text(name):
    return open(name).read() if os.path.exists(name) else ""
print(json.dumps({"a": float(text("a.txt") == "A\\n"), "b": float(text("b.txt") == "B\\n")}))
"""


@pytest.mark.integration
def test_cli_lint_mutations_and_max_outputs(tmp_path: Path, monkeypatch, capsys):
    """``--no-mutations`` skips the reference solution and its mutations; ``--max-outputs``
    caps the probed outputs; out-of-range values exit 2 naming the flag."""
    monkeypatch.setitem(cli.COMMANDS, "tasks", cli.Command("tasks", "harnessrl.actors.tasks_cmd"))
    task = native(
        tmp_path / "t",
        TWO_OUTPUTS,
        solve="printf 'A\\n' > a.txt; printf 'B\\n' > b.txt\n",
        instruction="Write A to a.txt and B to b.txt.",
    )
    rc = cli.main(["tasks", "lint", "--json", str(task.path)])
    out = capsys.readouterr()
    if "bubblewrap is not usable" in out.err:
        pytest.skip(out.err)
    (full,) = json.loads(out.out)
    assert rc == 0 and full["outputs"] == ["a.txt", "b.txt"]
    assert "solution" in full["scores"] and "delete a.txt" in full["scores"]
    assert full["solution_metrics"] == {"a": 1.0, "b": 1.0}
    rc = cli.main(
        ["tasks", "lint", "--json", "--no-mutations", "--max-outputs", "1", str(task.path)]
    )
    (cut,) = json.loads(capsys.readouterr().out)
    assert rc == 0 and cut["outputs"] == ["a.txt"] and cut["solution_metrics"] == {}
    assert not [p for p in cut["scores"] if p == "solution" or " " in p]
    for flag, value in (("--max-outputs", "0"), ("--max-outputs", "1001"), ("--threshold", "0")):
        assert cli.main(["tasks", "lint", flag, value, str(task.path)]) == 2
        assert f"harnessrl tasks lint: {flag}:" in capsys.readouterr().err


@pytest.mark.unit
def test_lint_config_is_documented():
    from harnessrl.common.config import undocumented_fields

    assert undocumented_fields(LintConfig) == []


# ------------------------------------------------------------------------- speed

FAST_CHECK = """\
    p = os.path.join(ws, "out.txt")
    t = open(p).read() if os.path.exists(p) else ""
    print(json.dumps({"right": float(t.strip() == "42"), "mentions": float("42" in t)}))
    """


@pytest.mark.integration
async def test_lint_many_clawgym_tasks_share_jobs(backend: BwrapBackend, tmp_path: Path):
    """Many correct ClawGym-format tasks linted together under one ``jobs`` limit: all clean.
    (Timing: 200 such tasks took 58-78 s with ``--jobs 2`` on 2 busy cores; not asserted.)"""
    tasks = [
        clawgym(tmp_path / f"task_{k:04d}", "Write 42 to out.txt.", FAST_CHECK, **{"in.txt": "x\n"})
        for k in range(12)
    ]
    reports = await lint_tasks(tasks, backend_factory(backend), jobs=2)
    assert len(reports) == len(tasks)
    assert all(r.ok for r in reports), [str(p) for r in reports for p in r.problems][:5]

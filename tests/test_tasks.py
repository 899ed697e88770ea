"""Task formats, hashing, the suite registry and ``harnessrl tasks`` (no sandbox needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harnessrl.common import cli
from harnessrl.common.tasks import (
    CLAWGYM_MOUNT,
    Task,
    TaskError,
    detect_format,
    import_any,
    list_suites,
    list_tasks,
    load_task,
    load_task_path,
    resolve_task,
    resolve_tasks,
)
from tests.treefiles import write

pytestmark = pytest.mark.unit

CHECKER = 'import json, sys\nprint(json.dumps({"ok": 1.0}))\n'


def native(root: Path, toml: str | None = None, **extra: str) -> Path:
    toml = (
        toml
        or """\
        id = "hello"
        instruction = "Write hi to out.txt."
        category = "demo"
        [timeouts]
        agent_s = 30
        verifier_s = 5
        [score]
        weights = { ok = 2.0 }
        [rubric]
        rules = ["Be polite."]
        """
    )
    files = {"task.toml": toml, "workspace/in.txt": "x\n", "reward/test.py": CHECKER}
    return write(root, {**files, **extra})


def clawgym_folder(root: Path) -> Path:
    entry = {
        "task_id": "task_0007",
        "user_query": "Summarise notes.md into summary.md.",
        "metadata": {"category": "Content & Domain", "grading_type": "hybrid", "rule": "Concise."},
        "input_mount_dir": CLAWGYM_MOUNT,
    }
    return write(
        root,
        {
            "data_entry.json": json.dumps(entry),
            "input_files/notes.md": "# notes\n",
            "reward/reward.sh": f"python3 {CLAWGYM_MOUNT}/reward/check.py {CLAWGYM_MOUNT} | tail -1\n",
            "reward/check.py": CHECKER,
        },
    )


def harbor_folder(root: Path) -> Path:
    return write(
        root,
        {
            "task.toml": """\
                version = "1.0"
                [metadata]
                category = "programming"
                difficulty = "easy"
                [verifier]
                timeout_sec = 45.0
                [agent]
                timeout_sec = 200.0
                """,
            "instruction.md": "Create hello.txt containing 'hello'.\n",
            "environment/Dockerfile": """\
                FROM ubuntu:24.04
                WORKDIR /app
                RUN apt-get update && apt-get install -y python3
                COPY data/ /app/data/
                COPY seed.txt .
                """,
            "environment/data/a.txt": "alpha\n",
            "environment/seed.txt": "seed\n",
            "tests/test.sh": "echo 1 > /logs/verifier/reward.txt\n",
            "solution/solve.sh": "echo hello > hello.txt\n",
        },
    )


# ---------------------------------------------------------------------- loaders


def test_native_folder_loads(tmp_path: Path):
    """A native folder loads with every task.toml field in place."""
    t = load_task_path(native(tmp_path / "hello", **{"solution/solve.sh": "echo hi > out.txt\n"}))
    assert (t.id, t.format, t.category, t.checker, t.checker_entry) == (
        "hello",
        "native",
        "demo",
        "test_py",
        "test.py",
    )
    assert t.instruction == "Write hi to out.txt."
    assert (t.agent_timeout_s, t.verifier_timeout_s) == (30, 5)
    assert t.metric_weights == {"ok": 2.0} and t.rubric == ["Be polite."]
    assert t.mount == "/workspace" and t.reward_mount == ""
    assert t.workspace_dir == tmp_path / "hello" / "workspace"
    assert t.solution == tmp_path / "hello" / "solution" / "solve.sh"
    assert len(t.task_hash) == 32


def test_native_instruction_md(tmp_path: Path):
    """Without an instruction field, instruction.md beside task.toml is the instruction."""
    root = native(tmp_path / "t", toml='id = "t"\n', **{"instruction.md": "From the file.\n"})
    assert load_task_path(root).instruction == "From the file.\n"


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('id = "x"\ninstruction = "i"\nbogus = 1\n', "field 'bogus': unknown field"),
        ('id = "x"\ninstruction = "i"\n[timeouts]\nagent_s = -1\n', "field 'timeouts.agent_s'"),
        ('id = "bad id!"\ninstruction = "i"\n', "field 'id'"),
        ('id = "x"\ninstruction = "i"\nmount = "rel/path"\n', "field 'mount'"),
        ('id = "x"\n', "field 'instruction' is missing"),
        ('id = "x"\ninstruction = "i"\n[checker]\nkind = "none"\n', "no rubric"),
        ('id = "x"\ninstruction = "i"\n[checker]\nentry = "nope.py"\n', "nope.py does not exist"),
        ('id = "x"\ninstruction = = 1\n', "not valid TOML"),
    ],
)
def test_native_errors_name_file_and_field(tmp_path: Path, toml: str, needle: str):
    """A bad task.toml raises TaskError naming the file and the field."""
    root = native(tmp_path / "t", toml=toml)
    with pytest.raises(TaskError) as e:
        load_task_path(root)
    assert needle in str(e.value) and str(root / "task.toml") in str(e.value)


def test_clawgym_folder_loads(tmp_path: Path):
    """data_entry.json + input_files/ + reward/reward.sh load with the ClawGym mount."""
    t = load_task_path(clawgym_folder(tmp_path / "task_0007"))
    assert (t.format, t.id, t.checker, t.checker_entry) == (
        "clawgym",
        "task_0007",
        "reward_sh",
        "reward.sh",
    )
    assert t.mount == CLAWGYM_MOUNT and t.reward_mount == f"{CLAWGYM_MOUNT}/reward"
    assert t.workspace_dir == tmp_path / "task_0007" / "input_files"
    assert t.category == "Content & Domain" and t.rubric == ["Concise."]
    assert t.metadata["grading_type"] == "hybrid"


def test_clawgym_folder_errors(tmp_path: Path):
    """A data_entry.json without user_query is an error naming the field."""
    root = clawgym_folder(tmp_path / "c")
    (root / "data_entry.json").write_text(json.dumps({"task_id": "c"}))
    with pytest.raises(TaskError, match="data_entry.json: field 'user_query'"):
        load_task_path(root)


def test_harbor_folder_loads(tmp_path: Path):
    """instruction.md + tests/test.sh is Harbor: WORKDIR is the mount, COPYs are the workspace."""
    root = harbor_folder(tmp_path / "hello-world")
    assert detect_format(root) == "harbor"
    t = load_task_path(root)
    assert (t.format, t.checker, t.mount) == ("harbor", "harbor", "/app")
    assert (t.agent_timeout_s, t.verifier_timeout_s, t.difficulty) == (200.0, 45.0, "easy")
    assert t.workspace_dir is not None
    assert (t.workspace_dir / "data" / "a.txt").read_text() == "alpha\n"
    assert (t.workspace_dir / "seed.txt").read_text() == "seed\n"
    assert any("apt-get" in x for x in t.metadata["harbor_ignored"])
    assert t.solution == root / "solution" / "solve.sh"


def test_not_a_task_folder(tmp_path: Path):
    """A folder of no known format is refused with what was expected."""
    (tmp_path / "x").mkdir()
    with pytest.raises(TaskError, match="not a task folder"):
        load_task_path(tmp_path / "x")


# ---------------------------------------------------------------------- import


def jsonl_record(i: int, **kw) -> dict:
    rec = {
        "prompt": f"Write report {i}.",
        "category": "Analysis & Reason.",
        "hook_code": f"python3 reward/test.py {CLAWGYM_MOUNT}",
        "input_files": [
            {"file_path": "input/data.csv", "content": "a,b\n1,2\n"},
            {"file_path": "reward/test.py", "content": CHECKER},
        ],
        "rule": "The report is clear.",
        "origin_template": f"---\nid: task_{i:03d}_report\n---",
    }
    return rec | kw


def test_import_clawgym_jsonl(tmp_path: Path):
    """JSONL records become native folders: reward/ files hidden, the rest the workspace."""
    src = tmp_path / "syn.jsonl"
    src.write_text("\n".join(json.dumps(jsonl_record(i)) for i in range(3)) + "\n")
    rep = import_any(src, tmp_path / "suite")
    out = rep.written
    assert [p.name for p in out] == ["task_000_report", "task_001_report", "task_002_report"]
    assert rep.skipped == []
    t = load_task_path(out[0])
    assert t.format == "native" and t.checker == "test_py" and t.split == "train"
    assert t.mount == CLAWGYM_MOUNT and t.reward_mount == f"{CLAWGYM_MOUNT}/reward"
    assert (t.workspace_dir / "input/data.csv").read_text() == "a,b\n1,2\n"
    assert not (t.workspace_dir / "reward").exists() and (t.reward_dir / "test.py").is_file()
    assert t.rubric == ["The report is clear."] and t.category == "Analysis & Reason."
    assert t.metadata["hook_code"].startswith("python3 reward/test.py")
    assert len(list_tasks(str(tmp_path / "suite"))) == 3


def test_import_jsonl_checker_in_field(tmp_path: Path):
    """A checker shipped in a record field becomes reward/test.py."""
    rec = jsonl_record(1, input_files=[{"file_path": "a.txt", "content": "x"}], test_code=CHECKER)
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    (out,) = import_any(src, tmp_path / "s").written
    assert (out / "reward" / "test.py").read_text() == CHECKER


@pytest.mark.parametrize(
    ("rec", "needle"),
    [
        ({"input_files": []}, "field 'prompt'"),
        (
            jsonl_record(1, input_files=[{"file_path": "../x", "content": ""}]),
            "leaves the workspace",
        ),
        (jsonl_record(1, input_files="nope"), "field 'input_files'"),
        (jsonl_record(1, input_files=[{"file_path": "a", "content": ""}], rule=None), "no checker"),
    ],
)
def test_import_jsonl_errors_name_line(tmp_path: Path, rec: dict, needle: str):
    """A bad record is skipped naming file:line and the field, the others are imported; with
    nothing importable the import fails and nothing (half-)written is left."""
    src = tmp_path / "bad.jsonl"
    src.write_text("\n" + json.dumps(rec) + "\n" + json.dumps(jsonl_record(7)) + "\n")
    rep = import_any(src, tmp_path / "out")
    assert [p.name for p in rep.written] == ["task_007_report"]
    ((where, why),) = rep.failed
    assert where == f"{src}:2" and needle in why
    src.write_text("\n" + json.dumps(rec) + "\n")
    with pytest.raises(TaskError) as e:
        import_any(src, tmp_path / "out2")
    assert f"{src}:2" in str(e.value) and needle in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out"]


def test_import_folders_roundtrip(tmp_path: Path):
    """ClawGym and Harbor folders import into native folders with the same task content."""
    clawgym_folder(tmp_path / "src" / "task_0007")
    harbor_folder(tmp_path / "src" / "hello-world")
    out = import_any(tmp_path / "src", tmp_path / "native").written
    tasks = {p.name: load_task_path(p) for p in out}
    cg, hb = tasks["task_0007"], tasks["hello-world"]
    assert cg.format == hb.format == "native"
    assert (cg.checker, cg.reward_mount, cg.rubric) == (
        "reward_sh",
        f"{CLAWGYM_MOUNT}/reward",
        ["Concise."],
    )
    assert (hb.checker, hb.mount, hb.checker_entry) == ("harbor", "/app", "test.sh")
    assert (hb.workspace_dir / "seed.txt").is_file() and hb.solution.name == "solve.sh"
    assert cg.metadata["imported_from"] == "clawgym" and hb.metadata["imported_from"] == "harbor"


def _entry(folder: Path, **kw) -> Path:
    """Edit a ClawGym folder's data_entry.json."""
    p = folder / "data_entry.json"
    p.write_text(json.dumps(json.loads(p.read_text()) | kw))
    return folder


def test_import_duplicate_ids_fail_before_writing(tmp_path: Path):
    """Two folders (or records) with one task id: one error naming the id and both sources,
    and nothing written."""
    clawgym_folder(tmp_path / "src" / "a")
    clawgym_folder(tmp_path / "src" / "b")
    harbor_folder(tmp_path / "src" / "hello")
    with pytest.raises(TaskError) as e:
        import_any(tmp_path / "src", tmp_path / "out")
    msg = str(e.value)
    assert "duplicate task ids" in msg and "task_0007" in msg
    assert str(tmp_path / "src" / "a") in msg and str(tmp_path / "src" / "b") in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    src = tmp_path / "dup.jsonl"
    src.write_text("".join(json.dumps(jsonl_record(i)) + "\n" for i in (1, 2, 1)))
    with pytest.raises(TaskError, match=rf"task_001_report: {src}:1, {src}:3"):
        import_any(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_into_non_empty_out_needs_force(tmp_path: Path):
    """Re-importing into a non-empty --out is an error naming it; --force replaces it."""
    clawgym_folder(tmp_path / "src" / "a")
    out = tmp_path / "out"
    assert [p.name for p in import_any(tmp_path / "src", out).written] == ["task_0007"]
    (out / "stale").mkdir()
    with pytest.raises(TaskError, match=r"--out .*out: is not empty; use --force"):
        import_any(tmp_path / "src", out)
    assert (out / "stale").is_dir()
    _entry(tmp_path / "src" / "a", task_id="task_0008")
    rep = import_any(tmp_path / "src", out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["task_0008"] == [p.name for p in rep.written]
    (tmp_path / "empty").mkdir()  # an empty --out needs no --force
    assert import_any(tmp_path / "src", tmp_path / "empty").written
    with pytest.raises(TaskError, match="must not be the source"):
        import_any(tmp_path / "src", tmp_path, force=True)
    assert (tmp_path / "src" / "a" / "data_entry.json").is_file()


def test_import_continues_past_bad_and_non_task_folders(tmp_path: Path):
    """A folder that does not load and one that is no task folder are skipped with their
    reasons; the rest is imported."""
    src = tmp_path / "src"
    clawgym_folder(src / "good")
    _entry(clawgym_folder(src / "bad"), task_id="bad", user_query=17)
    (src / "docs").mkdir()
    (src / "docs" / "README.md").write_text("not a task\n")
    (src / ".git").mkdir()
    (src / "notes.txt").write_text("x\n")
    rep = import_any(src, tmp_path / "out")
    assert [p.name for p in rep.written] == ["task_0007"]
    ((where, why),) = rep.failed
    assert where == str(src / "bad") and "field 'user_query'" in why
    ((where, why),) = rep.not_tasks
    assert where == str(src / "docs") and "not a task folder" in why
    assert len(rep.skipped) == 2


def test_import_split(tmp_path: Path):
    """--split sets every imported task's split; without it each keeps its own (else train)."""
    clawgym_folder(tmp_path / "src" / "a")
    harbor_folder(tmp_path / "src" / "b")
    jl = tmp_path / "r.jsonl"
    jl.write_text(json.dumps(jsonl_record(1)) + "\n")
    for source in (tmp_path / "src", jl):
        out = tmp_path / f"eval-{source.name}"
        assert {load_task_path(p).split for p in import_any(source, out, split="eval").written} == {
            "eval"
        }
        assert list_tasks(str(out), split="eval") and not list_tasks(str(out), split="train")
        plain = import_any(source, tmp_path / f"plain-{source.name}").written
        assert {load_task_path(p).split for p in plain} == {"train"}
    with pytest.raises(TaskError, match="--split 'no good'"):
        import_any(jl, tmp_path / "x", split="no good")


def test_import_jsonl_hook_code(tmp_path: Path):
    """A hook that runs one of the record's reward files makes it the checker (and is kept);
    any other hook is refused for that record with a reason naming the field."""
    files = [
        {"file_path": "in.txt", "content": "x"},
        {"file_path": "reward/test.py", "content": CHECKER},
        {"file_path": "reward/grade.py", "content": CHECKER},
    ]
    hooks = {
        1: f"python3 {CLAWGYM_MOUNT}/reward/grade.py {CLAWGYM_MOUNT}",
        2: "python reward/test.py .",
        3: "pip install pandas && python3 reward/test.py",
        4: "python3 reward/missing.py",
        5: 42,
    }
    src = tmp_path / "h.jsonl"
    src.write_text(
        "".join(
            json.dumps(jsonl_record(i, input_files=files, hook_code=h)) + "\n"
            for i, h in hooks.items()
        )
    )
    rep = import_any(src, tmp_path / "out")
    tasks = {p.name: load_task_path(p) for p in rep.written}
    assert tasks["task_001_report"].checker_entry == "grade.py"
    assert tasks["task_001_report"].metadata["hook_code"] == hooks[1]
    assert tasks["task_002_report"].checker_entry == "test.py"
    failed = dict(rep.failed)
    assert set(failed) == {f"{src}:3", f"{src}:4", f"{src}:5"}
    assert "field 'hook_code'" in failed[f"{src}:3"] and "not supported" in failed[f"{src}:3"]
    assert "reward/missing.py, which the record does not ship" in failed[f"{src}:4"]
    assert "field 'hook_code' must be a string" in failed[f"{src}:5"]


# ---------------------------------------------------------------------- hashing


def test_task_hash_stable_and_location_free(tmp_path: Path):
    """The hash ignores location, mtimes, caches and the solution; reloading agrees."""
    a = native(tmp_path / "a" / "hello", **{"solution/solve.sh": "true\n"})
    h = load_task_path(a).task_hash
    assert load_task_path(a).task_hash == h
    b = tmp_path / "b" / "hello"
    shutil.copytree(a, b)
    (b / "reward" / "__pycache__").mkdir()
    (b / "reward" / "__pycache__" / "test.cpython-311.pyc").write_bytes(b"junk")
    (b / "solution" / "solve.sh").write_text("echo other\n")
    assert load_task_path(b).task_hash == h


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: (r / "workspace" / "in.txt").write_text("y\n"),
        lambda r: (r / "workspace" / "new.txt").write_text(""),
        lambda r: (r / "reward" / "test.py").write_text(CHECKER + "# changed\n"),
        lambda r: (r / "reward" / "expected.json").write_text("{}"),
        lambda r: (r / "task.toml").write_text("split = 'eval'\n" + (r / "task.toml").read_text()),
        lambda r: (r / "workspace" / "in.txt").rename(r / "workspace" / "renamed.txt"),
        lambda r: (r / "workspace" / "in.txt").rename(r / "reward" / "in.txt"),
    ],
)
def test_task_hash_sensitive(tmp_path: Path, edit):
    """Any change to task.toml, workspace or reward files (content or name) changes the hash."""
    root = native(tmp_path / "t")
    before = load_task_path(root).task_hash
    edit(root)
    assert load_task_path(root).task_hash != before


# ---------------------------------------------------------------------- registry


def test_builtin_suites_listed():
    """toy, toy-eval and workspace are built in; their ids are unique and splits right."""
    suites = list_suites()
    assert {"toy", "toy-eval", "workspace"} <= set(suites)
    toy, held_out = list_tasks("toy"), list_tasks("toy-eval")
    assert 50 <= len(toy) + len(held_out) <= 200
    assert {t.split for t in toy} == {"train"} and {t.split for t in held_out} == {"eval"}
    assert not {t.id for t in toy} & {t.id for t in held_out}
    assert {t.difficulty for t in toy} == {"1", "2", "3"}
    ws = list_tasks("workspace")
    assert len(ws) >= 20 and all(t.rubric and t.solution for t in ws)


def test_load_task_by_name_and_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """SUITE/ID, a task folder path and a suite folder path all name tasks."""
    t = load_task("workspace", "expense_report")
    assert t.suite == "workspace" and t.name == "workspace/expense_report"
    assert resolve_task("workspace/expense_report") == t
    by_path = resolve_task(str(t.path))
    assert by_path.task_hash == t.task_hash and by_path.suite == ""
    assert load_task("toy", str(t.path)).task_hash == t.task_hash
    native(tmp_path / "mine" / "hello")
    assert [x.id for x in resolve_tasks(str(tmp_path / "mine"))] == ["hello"]
    monkeypatch.setenv("HRL_SUITE_PATH", str(tmp_path))
    assert load_task("mine", "hello").suite == "mine"
    with pytest.raises(TaskError, match="has no task 'nope'"):
        load_task("workspace", "nope")
    with pytest.raises(TaskError, match="unknown suite 'nope'"):
        list_tasks("nope")


def test_duplicate_ids_in_suite(tmp_path: Path):
    """Two folders declaring the same id in one suite is an error naming both."""
    native(tmp_path / "a")
    native(tmp_path / "b")
    with pytest.raises(TaskError, match="task id 'hello' used by"):
        list_tasks(str(tmp_path))


# ---------------------------------------------------------------------- CLI


@pytest.fixture
def tasks_cli(monkeypatch: pytest.MonkeyPatch):
    """``harnessrl tasks`` whether or not the lead registered it yet."""
    monkeypatch.setitem(
        cli.COMMANDS,
        "tasks",
        cli.Command("list, show, import and lint tasks", "harnessrl.actors.tasks_cmd"),
    )
    return lambda *argv: cli.main(["tasks", *argv])


def test_cli_list_json(tasks_cli, capsys: pytest.CaptureFixture[str]):
    """``tasks list --json`` prints a JSON list of objects with at least suite and id."""
    assert tasks_cli("list", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and all({"suite", "id"} <= set(r) for r in rows)
    assert {"toy", "toy-eval", "workspace"} <= {r["suite"] for r in rows}
    assert tasks_cli("list", "--suite", "workspace", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["suite"] for r in rows} == {"workspace"} and len(rows) >= 20


def test_cli_show_import_and_errors(tasks_cli, capsys: pytest.CaptureFixture[str], tmp_path: Path):
    """show by SUITE/ID and by path, import a JSONL file; a bad name exits 2 with a message."""
    assert tasks_cli("show", "workspace/launch_announcement") == 0
    assert "under 120 words" in capsys.readouterr().out
    assert tasks_cli("show", str(clawgym_folder(tmp_path / "cg")), "--json") == 0
    assert json.loads(capsys.readouterr().out)["format"] == "clawgym"
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(jsonl_record(5)) + "\n")
    assert tasks_cli("import", str(src), "--out", str(tmp_path / "out")) == 0
    assert (tmp_path / "out" / "task_005_report" / "task.toml").is_file()
    assert tasks_cli("show", "nope/x") == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


def test_cli_import_summary_and_errors(
    tasks_cli, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    """``tasks import`` prints what it imported and skipped (exit 2 when a task failed); its
    errors name the bad folder or option and exit 2 without a traceback."""
    src = tmp_path / "src"
    clawgym_folder(src / "good")
    _entry(clawgym_folder(src / "bad"), task_id="bad", input_mount_dir="relative/dir")
    (src / "docs").mkdir()
    out = tmp_path / "out"
    assert tasks_cli("import", str(src), "--out", str(out), "--split", "eval") == 2
    res = capsys.readouterr()
    assert res.out.split() == [str(out / "task_0007")]
    assert f"skipped {src / 'bad'}: " in res.err and "field 'input_mount_dir'" in res.err
    assert f"skipped {src / 'docs'}: not a task folder" in res.err
    assert "imported 1 task(s)" in res.err and "skipped 2 (1 with errors, 1 not task" in res.err
    assert load_task_path(out / "task_0007").split == "eval"
    shutil.rmtree(src / "bad")
    for argv, needle in [
        ((str(src), "--out", str(out)), "is not empty; use --force"),
        ((str(tmp_path / "nope"), "--out", str(tmp_path / "o2")), "nope: no such file"),
        ((str(src / "docs"), "--out", str(tmp_path / "o3")), "docs: holds no task folder"),
        ((str(src), "--out", str(tmp_path / "o4"), "--split", "a b"), "--split 'a b'"),
    ]:
        assert tasks_cli("import", *argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    clawgym_folder(src / "twin")
    assert tasks_cli("import", str(src), "--out", str(tmp_path / "o5")) == 2
    err = capsys.readouterr().err
    assert "duplicate task ids" in err and str(src / "twin") in err
    assert not (tmp_path / "o5").exists()
    shutil.rmtree(src / "twin")
    assert tasks_cli("import", str(src), "--out", str(out), "--force") == 0
    assert "skipped 1 (0 with errors, 1 not task folders)" in capsys.readouterr().err
    assert load_task_path(out / "task_0007").split == "train"


def test_cli_help_is_complete(tasks_cli, capsys: pytest.CaptureFixture[str]):
    """Every action has --help text."""
    for action in ("list", "suites", "show", "import", "lint"):
        with pytest.raises(SystemExit) as e:
            tasks_cli(action, "--help")
        assert e.value.code == 0
        assert "usage: harnessrl tasks " + action in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tasks_cli("import", "--help")
    text = capsys.readouterr().out
    assert "--split" in text and "--force" in text and "hook_code" in text


def test_task_model_is_documented():
    """Every Task field has a docstring (it is the shared picture of a task)."""
    assert all(f.description for f in Task.model_fields.values())

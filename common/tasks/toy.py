"""The ``toy`` suites: small read-transform-write workspace tasks a tiny model can learn.

Each task is one *family* (a transformation) with random parameters and file contents. Three
levels: 1 — read one file, apply a simple transform, write one file; 2 — the same with a
transform that needs counting or arithmetic; 3 — list a directory, read several files, write
one. Every family has a `compute` function used three ways, so they cannot disagree: by the
generator (expected output), by the reference solution (embedded as a script), and by the
scripted teacher (on what its tool calls observed; see `harnessrl.common.tasks.teacher`).

Generation is deterministic: ``python -m harnessrl.common.tasks.toy`` rewrites
``suites/toy`` (train split) and ``suites/toy-eval`` (held-out split, different seeds and
parameters) from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.common.config import toml_text

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "maple",
    "tiger",
    "lemon",
    "candle",
    "silver",
    "garden",
    "rocket",
    "pepper",
    "window",
    "forest",
    "copper",
    "violet",
    "harbor",
    "marble",
    "ocean",
    "pencil",
    "basket",
    "rabbit",
    "thunder",
    "meadow",
    "lantern",
    "pebble",
    "falcon",
    "orchid",
    "walnut",
    "canyon",
]
INPUTS = ("notes.txt", "data.txt", "words.txt", "list.txt", "input.txt", "story.txt")
OUTPUTS = ("out.txt", "result.txt", "answer.txt", "output.txt")
DIRS = ("docs", "files", "parts", "inbox", "records")
JSON_KEYS = ("name", "city", "color", "owner", "status", "label")

Read = Callable[[str], str]
"""Reads a workspace file (relative path) -> its text."""
ListDir = Callable[[str], list[str]]
"""Lists a workspace directory -> entry names."""


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def as_lines(lines: list[str]) -> str:
    return "".join(f"{ln}\n" for ln in lines)


def word_re(w: str) -> re.Pattern[str]:
    return re.compile(rf"\b{re.escape(w)}\b")


def dir_files(ls: ListDir, d: str, suffix: str = "") -> list[str]:
    """Sorted file names of ``d`` (entries ending in ``/`` are directories)."""
    names = [n for n in ls(d) if n and not n.endswith("/")]
    return sorted(n for n in names if n.endswith(suffix))


# ---------------------------------------------------------------------------------------------
# families: make(rng) -> (params, files); compute(params, read, ls) -> expected output text
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    name: str
    level: int
    instruction: str
    """Template over the params."""
    make: Callable[[random.Random], tuple[dict[str, Any], dict[str, str]]]
    compute: Callable[[dict[str, Any], Read, ListDir], str]
    solve: str
    """Python source of the reference solution body; ``P`` is the params dict."""
    reads_dir: bool = False
    """Level-3 families: the teacher lists ``params['dir']`` and reads the files it needs."""
    stop_when: Callable[[dict[str, Any], str], bool] | None = None
    """For directory families that may stop reading early (the file text found it)."""
    shell: str = ""
    """A one-line shell solution (template over the params and ``WORD``), run in the workspace by
    the harness's ``run`` tool: the ``shell`` teacher style (``harnessrl.common.tasks.teacher``)."""

    near_miss: str = ""
    """A plausible *wrong* one-liner (template like ``shell``): off by one, the wrong flag,
    field or direction — the mistake an imperfect demonstrator makes. The ``near_miss`` teacher
    style runs it, so a warm start SFT'd on a share of such trajectories has a family-level
    mistake that RL can unlearn from the verifier's reward (and that generalises to held-out
    tasks of the family, unlike copying names, which RL on a few thousand rollouts does not
    improve)."""

    def command(self, params: dict[str, Any], near_miss: bool = False) -> str:
        """The shell solution for a task with these params (or its near miss)."""
        return (self.near_miss if near_miss else self.shell).format(**template_params(params))


def _sentence(rng: random.Random, must: str | None = None, n: int = 5) -> str:
    ws = [rng.choice(WORDS) for _ in range(n)]
    if must is not None:
        ws[rng.randrange(n)] = must
    return " ".join(ws)


def _io(rng: random.Random) -> dict[str, Any]:
    return {"input": rng.choice(INPUTS), "output": rng.choice(OUTPUTS)}


def _text_lines(rng: random.Random, lo: int = 3, hi: int = 6) -> list[str]:
    return [_sentence(rng, n=rng.randint(2, 4)) for _ in range(rng.randint(lo, hi))]


def make_lines(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = _io(rng)
    return p, {p["input"]: as_lines(_text_lines(rng))}


def make_word(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = _io(rng)
    p["word"] = rng.choice(WORDS)
    lines = [
        _sentence(rng, p["word"] if rng.random() < 0.7 else None, rng.randint(3, 5))
        for _ in range(rng.randint(3, 5))
    ]
    lines[0] = _sentence(rng, p["word"], 4)
    return p, {p["input"]: as_lines(lines)}


def make_replace(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p, files = make_word(rng)
    p["new"] = rng.choice([w for w in WORDS if w != p["word"]])
    return p, files


def make_sorted_words(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = _io(rng)
    return p, {p["input"]: as_lines(rng.sample(WORDS, rng.randint(4, 7)))}


def make_say(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = {"output": rng.choice(OUTPUTS), "word": rng.choice(WORDS)}
    return p, {"README.md": "# workspace\n"}


def make_numbers(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = _io(rng)
    return p, {p["input"]: as_lines([str(rng.randint(1, 50)) for _ in range(rng.randint(3, 6))])}


def make_json(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = {
        "input": rng.choice(("info.json", "record.json", "item.json")),
        "output": rng.choice(OUTPUTS),
    }
    keys = rng.sample(JSON_KEYS, 4)
    p["key"] = keys[0]
    obj = {k: rng.choice(WORDS) for k in sorted(keys)}
    return p, {p["input"]: json.dumps(obj, indent=2) + "\n"}


def make_json_nested(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = {"input": rng.choice(("config.json", "profile.json")), "output": rng.choice(OUTPUTS)}
    outer = rng.sample(("user", "server", "team", "pet"), 2)
    p["outer"], p["key"] = outer[0], rng.choice(JSON_KEYS)
    obj = {
        o: {k: rng.choice(WORDS) for k in sorted(rng.sample(JSON_KEYS, 3) + [p["key"]])}
        for o in sorted(outer)
    }
    return p, {p["input"]: json.dumps(obj, indent=2) + "\n"}


def make_dir_texts(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = {"dir": rng.choice(DIRS), "output": rng.choice(OUTPUTS)}
    names = sorted(rng.sample(WORDS, rng.randint(2, 4)))
    files = {f"{p['dir']}/{n}.txt": as_lines(_text_lines(rng, 1, 2)) for n in names}
    files[f"{p['dir']}/README.md"] = "# notes\n"
    return p, files


def make_dir_find(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = {"dir": rng.choice(DIRS), "output": rng.choice(OUTPUTS)}
    names = sorted(rng.sample(WORDS, rng.randint(3, 4)))
    p["word"] = rng.choice([w for w in WORDS if w not in names])
    pool = [w for w in WORDS if w != p["word"]]
    files = {f"{p['dir']}/{n}.txt": " ".join(rng.sample(pool, 4)) + "\n" for n in names}
    hit = rng.choice(names)
    files[f"{p['dir']}/{hit}.txt"] = _sentence(random.Random(hit), p["word"], 4) + "\n"
    return p, files


def make_dir_numbers(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = {"dir": rng.choice(DIRS), "output": rng.choice(OUTPUTS)}
    names = sorted(rng.sample(WORDS, rng.randint(2, 4)))
    return p, {f"{p['dir']}/{n}.txt": f"{rng.randint(1, 99)}\n" for n in names}


def make_dir_json(rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    p = {"dir": rng.choice(DIRS), "output": rng.choice(OUTPUTS), "key": rng.choice(JSON_KEYS)}
    names = sorted(rng.sample(WORDS, rng.randint(2, 4)))
    files = {
        f"{p['dir']}/{n}.json": json.dumps({p["key"]: rng.choice(WORDS), "id": i}) + "\n"
        for i, n in enumerate(names)
    }
    files[f"{p['dir']}/notes.txt"] = "not json\n"
    return p, files


def _count_word(p: dict[str, Any], text: str) -> int:
    return len(word_re(p["word"]).findall(text))


FAMILIES: tuple[Family, ...] = (
    # level 1 (the first two are the ladder's lowest rungs: one write, or one read then a
    # one-line write, so a small warm-start policy solves them often but not always)
    Family(
        "write_word",
        1,
        "Write the word '{word}' to {output}.",
        make_say,
        lambda p, r, ls: f"{p['word']}\n",
        'out = P["word"] + "\\n"',
        shell="echo {word} > {output}",
        near_miss="echo {WORD} > {output}",
    ),
    Family(
        "first_line",
        1,
        "Write the first line of {input} to {output}.",
        make_lines,
        lambda p, r, ls: as_lines(lines_of(r(p["input"]))[:1]),
        'out = read(P["input"]).splitlines()[0] + "\\n"',
        shell="head -n 1 {input} > {output}",
        near_miss="head -n 2 {input} > {output}",
    ),
    Family(
        "copy",
        1,
        "Copy the contents of {input} into a new file {output}.",
        make_lines,
        lambda p, r, ls: r(p["input"]),
        'out = read(P["input"])',
        shell="cp {input} {output}",
        near_miss="tail -n +2 {input} > {output}",
    ),
    Family(
        "upper_word",
        1,
        "In {input}, change every '{word}' to '{WORD}'. Write the result to {output}.",
        make_word,
        lambda p, r, ls: word_re(p["word"]).sub(p["word"].upper(), r(p["input"])),
        'word = P["word"]\nout = re.sub(rf"\\b{word}\\b", word.upper(), read(P["input"]))',
        shell="sed 's/\\b{word}\\b/{WORD}/g' {input} > {output}",
        near_miss="sed 's/\\b{WORD}\\b/{word}/g' {input} > {output}",
    ),
    Family(
        "upper_all",
        1,
        "Write the text of {input} in capital letters to {output}.",
        make_lines,
        lambda p, r, ls: r(p["input"]).upper(),
        'out = read(P["input"]).upper()',
        shell="tr a-z A-Z < {input} > {output}",
        near_miss="tr A-Z a-z < {input} > {output}",
    ),
    Family(
        "reverse_lines",
        1,
        "Write the lines of {input} in reverse order to {output}.",
        make_lines,
        lambda p, r, ls: as_lines(lines_of(r(p["input"]))[::-1]),
        'out = "".join(line + "\\n" for line in read(P["input"]).splitlines()[::-1])',
        shell="tac {input} > {output}",
        near_miss="sort -r {input} > {output}",
    ),
    Family(
        "count_lines",
        1,
        "Count the lines of {input} and write the number to {output}.",
        make_lines,
        lambda p, r, ls: f"{len(lines_of(r(p['input'])))}\n",
        'n = len(read(P["input"]).splitlines())\nout = f"{n}\\n"',
        shell="wc -l < {input} > {output}",
        near_miss="wc -w < {input} > {output}",
    ),
    Family(
        "json_field",
        1,
        "{input} holds a JSON object. Write the value of its '{key}' field to {output}.",
        make_json,
        lambda p, r, ls: f"{json.loads(r(p['input']))[p['key']]}\n",
        'value = json.loads(read(P["input"]))[P["key"]]\nout = f"{value}\\n"',
        shell="grep '\"{key}\"' {input} | cut -d '\"' -f 4 > {output}",
        near_miss="grep '\"{key}\"' {input} | cut -d '\"' -f 3 > {output}",
    ),
    # level 2
    Family(
        "sort_lines",
        2,
        "Sort the lines of {input} alphabetically and write them to {output}.",
        make_sorted_words,
        lambda p, r, ls: as_lines(sorted(lines_of(r(p["input"])))),
        'out = "".join(line + "\\n" for line in sorted(read(P["input"]).splitlines()))',
        shell="sort {input} > {output}",
        near_miss="sort -r {input} > {output}",
    ),
    Family(
        "count_word",
        2,
        "Count how many times the word '{word}' appears in {input}. Write the number to {output}.",
        make_word,
        lambda p, r, ls: f"{_count_word(p, r(p['input']))}\n",
        'word = P["word"]\nn = len(re.findall(rf"\\b{word}\\b", read(P["input"])))\nout = f"{n}\\n"',
        shell="grep -ow {word} {input} | wc -l > {output}",
        near_miss="wc -w < {input} > {output}",
    ),
    Family(
        "sum_numbers",
        2,
        "{input} has one number per line. Write their sum to {output}.",
        make_numbers,
        lambda p, r, ls: f"{sum(int(x) for x in lines_of(r(p['input'])) if x.strip())}\n",
        'n = sum(int(x) for x in read(P["input"]).split())\nout = f"{n}\\n"',
        shell="awk '{{s += $1}} END {{print s}}' {input} > {output}",
        near_miss="wc -l < {input} > {output}",
    ),
    Family(
        "json_nested",
        2,
        "{input} holds a JSON object. Write the value of the '{key}' field inside '{outer}' to {output}.",
        make_json_nested,
        lambda p, r, ls: f"{json.loads(r(p['input']))[p['outer']][p['key']]}\n",
        'value = json.loads(read(P["input"]))[P["outer"]][P["key"]]\nout = f"{value}\\n"',
        shell="python3 -c \"import json; print(json.load(open('{input}'))['{outer}']['{key}'])\" > {output}",
        near_miss="python3 -c \"import json; print(json.load(open('{input}'))['{outer}'])\" > {output}",
    ),
    Family(
        "replace_word",
        2,
        "In {input}, replace every '{word}' with '{new}'. Write the result to {output}.",
        make_replace,
        lambda p, r, ls: word_re(p["word"]).sub(p["new"], r(p["input"])),
        'word = P["word"]\nout = re.sub(rf"\\b{word}\\b", P["new"], read(P["input"]))',
        shell="sed 's/\\b{word}\\b/{new}/g' {input} > {output}",
        near_miss="sed 's/\\b{new}\\b/{word}/g' {input} > {output}",
    ),
    Family(
        "first_last",
        2,
        "Write the first line and the last line of {input} to {output}, in that order.",
        make_lines,
        lambda p, r, ls: as_lines([lines_of(r(p["input"]))[0], lines_of(r(p["input"]))[-1]]),
        'lines = read(P["input"]).splitlines()\nout = lines[0] + "\\n" + lines[-1] + "\\n"',
        shell="sed -n '1p;$p' {input} > {output}",
        near_miss="sed -n '1p' {input} > {output}",
    ),
    Family(
        "number_lines",
        2,
        "Number the lines of {input} like '1: first line', '2: second line' and write them to {output}.",
        make_lines,
        lambda p, r, ls: as_lines([f"{i}: {x}" for i, x in enumerate(lines_of(r(p["input"])), 1)]),
        'lines = read(P["input"]).splitlines()\nout = "".join(f"{i}: {line}\\n" for i, line in enumerate(lines, 1))',
        shell="awk '{{print NR \": \" $0}}' {input} > {output}",
        near_miss="cat -n {input} > {output}",
    ),
    # level 3: list a directory, read several files
    Family(
        "concat_dir",
        3,
        "Join the .txt files in {dir}/ in alphabetical order of their names and write the result to {output}.",
        make_dir_texts,
        lambda p, r, ls: "".join(r(f"{p['dir']}/{n}") for n in dir_files(ls, p["dir"], ".txt")),
        'names = sorted(n for n in os.listdir(P["dir"]) if n.endswith(".txt"))\n'
        'out = "".join(read(os.path.join(P["dir"], n)) for n in names)',
        reads_dir=True,
        shell="cat {dir}/*.txt > {output}",
        near_miss="ls {dir} > {output}",
    ),
    Family(
        "count_files",
        3,
        "Count the files in {dir}/ and write the number to {output}.",
        make_dir_texts,
        lambda p, r, ls: f"{len(dir_files(ls, p['dir']))}\n",
        'n = len(os.listdir(P["dir"]))\nout = f"{n}\\n"',
        reads_dir=True,
        shell="ls {dir} | wc -l > {output}",
        near_miss="ls -a {dir} | wc -l > {output}",
    ),
    Family(
        "find_word",
        3,
        "Exactly one file in {dir}/ contains the word '{word}'. Write that file's name to {output}.",
        make_dir_find,
        lambda p, r, ls: next(
            (
                f"{n}\n"
                for n in dir_files(ls, p["dir"])
                if word_re(p["word"]).search(r(f"{p['dir']}/{n}"))
            ),
            "\n",
        ),
        'word = P["word"]\nnames = sorted(os.listdir(P["dir"]))\n'
        'hits = [n for n in names if re.search(rf"\\b{word}\\b", read(os.path.join(P["dir"], n)))]\n'
        'out = hits[0] + "\\n"',
        reads_dir=True,
        stop_when=lambda p, text: bool(word_re(p["word"]).search(text)),
        shell="cd {dir} && grep -lw {word} * > ../{output}",
        near_miss="grep -rlw {word} {dir} > {output}",
    ),
    Family(
        "sum_files",
        3,
        "Each file in {dir}/ holds one number. Write the sum of all of them to {output}.",
        make_dir_numbers,
        lambda p, r, ls: (
            f"{sum(int(r(p['dir'] + '/' + n).strip()) for n in dir_files(ls, p['dir']))}\n"
        ),
        'n = sum(int(read(os.path.join(P["dir"], name))) for name in os.listdir(P["dir"]))\n'
        'out = f"{n}\\n"',
        reads_dir=True,
        shell="cat {dir}/* | awk '{{s += $1}} END {{print s}}' > {output}",
        near_miss="cat {dir}/* | wc -l > {output}",
    ),
    Family(
        "json_collect",
        3,
        "Every .json file in {dir}/ has a '{key}' field. Write those values to {output}, one per line, "
        "in alphabetical order of the file names.",
        make_dir_json,
        lambda p, r, ls: as_lines(
            [
                str(json.loads(r(f"{p['dir']}/{n}"))[p["key"]])
                for n in dir_files(ls, p["dir"], ".json")
            ]
        ),
        'names = sorted(n for n in os.listdir(P["dir"]) if n.endswith(".json"))\n'
        'values = [json.loads(read(os.path.join(P["dir"], n)))[P["key"]] for n in names]\n'
        'out = "".join(f"{v}\\n" for v in values)',
        reads_dir=True,
        shell="cat {dir}/*.json | cut -d '\"' -f 4 > {output}",
        near_miss="cat {dir}/*.json | cut -d '\"' -f 2 > {output}",
    ),
)
FAMILY = {f.name: f for f in FAMILIES}


def reads_needed(fam: Family, p: dict[str, Any], listing: list[str] | None) -> list[str]:
    """Files (relative) the family reads, given the directory listing for level 3."""
    if not fam.reads_dir:
        return [p["input"]] if "input" in p else []
    if listing is None:
        return []
    suffix = {"concat_dir": ".txt", "json_collect": ".json"}.get(fam.name, "")
    if fam.name == "count_files":
        return []
    return [f"{p['dir']}/{n}" for n in dir_files(lambda _d: listing, p["dir"], suffix)]


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------


@dataclass
class ToyTask:
    id: str
    family: Family
    params: dict[str, Any]
    files: dict[str, str]
    split: str
    expected: str = field(init=False)

    def __post_init__(self) -> None:
        def read(rel: str) -> str:
            return self.files[rel]

        def ls(d: str) -> list[str]:
            pre = d.rstrip("/") + "/"
            return sorted(k[len(pre) :] for k in self.files if k.startswith(pre))

        self.expected = self.family.compute(self.params, read, ls)

    @property
    def instruction(self) -> str:
        return self.family.instruction.format(**template_params(self.params))

    @property
    def command(self) -> str:
        """The family's one-line shell solution for this task."""
        return self.family.command(self.params)


def template_params(params: dict[str, Any]) -> dict[str, Any]:
    """What the instruction and shell templates are formatted with: the params and ``WORD``."""
    return {**params, "WORD": str(params.get("word", "")).upper()}


def _key(family: str, params: dict[str, Any], files: dict[str, str]) -> tuple[str, str, str]:
    """What makes two generated tasks the same task."""
    return family, json.dumps(params, sort_keys=True), json.dumps(files, sort_keys=True)


def generate(seed: int = 0, per_family: dict[str, int] | None = None) -> list[ToyTask]:
    """Deterministic toy tasks: ``per_family`` = {split: count}, default train 6, eval 2."""
    per_family = per_family or {"train": 6, "eval": 2}
    out, seen = [], set()
    for split, count in per_family.items():
        for fam in FAMILIES:
            i = attempt = 0
            while i < count and attempt < 20 * count + 200:  # small families run out
                rng = random.Random(f"toy:{seed}:{split}:{fam.name}:{attempt}")
                attempt += 1
                params, files = fam.make(rng)
                key = _key(fam.name, params, files)
                if key in seen:
                    continue
                seen.add(key)
                i += 1
                tid = f"{fam.name}_{i:02d}" if split == "train" else f"{fam.name}_{split}{i:02d}"
                out.append(ToyTask(tid, fam, params, files, split))
    return out


CHECKER = '''\
"""Toy checker: is the output file written, and is it exactly right?

Usage: python3 test.py WORKSPACE. Prints {"written": 0|1, "correct": 0|1}. Lines are compared
without trailing whitespace and without blank lines at the start or end.
"""

import json
import sys
from pathlib import Path


def norm(text):
    return "\\n".join(line.rstrip() for line in text.strip("\\n").splitlines())


spec = json.loads((Path(__file__).parent / "expected.json").read_text())
ws = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
written = correct = 0.0
try:
    got = (ws / spec["output"]).read_text(errors="replace")
    written = 1.0 if got.strip() else 0.0
    correct = 1.0 if got.strip() and norm(got) == norm(spec["expected"]) else 0.0
except OSError:
    pass
print(json.dumps({"written": written, "correct": correct}))
'''

SOLUTION = '''\
"""Reference solution ({family}); run with the workspace as the current directory."""

{imports}from pathlib import Path

P = {params}


def read(rel):
    return Path(rel).read_text()


{body}
Path(P["output"]).write_text(out)
'''


def toy_metadata(t: ToyTask) -> dict[str, str]:
    """The task's ``metadata.toy`` table: its family and parameters (what the teacher reads)."""
    return {"family": t.family.name, **{k: str(v) for k, v in t.params.items()}}


def task_toml(t: ToyTask) -> str:
    meta = toy_metadata(t)
    return toml_text(
        {
            "id": t.id,
            "instruction": t.instruction,
            "category": "toy",
            "difficulty": str(t.family.level),
            "split": t.split,
            "timeouts": {"agent_s": 300.0, "verifier_s": 30.0},
            # `written` rewards any non-empty output on purpose (reward shaping): lint allows it
            "metadata": {"toy": meta, "lint": {"shaping": ["written"]}},
        }
    )


def write_task(t: ToyTask, root: Path) -> Path:
    d = root / t.id
    for rel, text in t.files.items():
        (d / "workspace" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "workspace" / rel).write_text(text)
    (d / "reward").mkdir(parents=True)
    (d / "reward" / "test.py").write_text(CHECKER)
    spec = {"output": t.params["output"], "expected": t.expected}
    (d / "reward" / "expected.json").write_text(json.dumps(spec, indent=2) + "\n")
    (d / "solution").mkdir()
    mods = [m for m in ("json", "os", "re") if f"{m}." in t.family.solve]
    body = SOLUTION.format(
        family=t.family.name,
        imports="".join(f"import {m}\n" for m in mods),
        params=json.dumps(t.params),
        body=t.family.solve,
    )
    (d / "solution" / "solve.py").write_text(body)
    (d / "task.toml").write_text(task_toml(t))
    return d


SUITE_README = """\
# {suite}

Generated by `python -m harnessrl.common.tasks.toy --seed {seed}` ({n} tasks, split `{split}`); do not edit
by hand. See `common/tasks/toy.py` for the families and `common/tasks/teacher.py` for the
scripted teacher.
"""


def write_suites(out: Path, seed: int = 0) -> dict[str, int]:
    """(Re)write ``out/toy`` and ``out/toy-eval``; returns task counts per suite."""
    counts = {}
    tasks = generate(seed)
    for suite, split in (("toy", "train"), ("toy-eval", "eval")):
        root = out / suite
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        mine = [t for t in tasks if t.split == split]
        for t in mine:
            write_task(t, root)
        (root / "README.md").write_text(
            SUITE_README.format(suite=suite, seed=seed, n=len(mine), split=split)
        )
        counts[suite] = len(mine)
    return counts


def vary_names(t: ToyTask, rng: random.Random) -> ToyTask:
    """``t`` with its input file, output file and folder renamed to random ``WORDS`` stems
    (``apple.txt``, ``river/``): the same task otherwise, with its expected output recomputed.

    Warm-start data augmentation. With only six input and four output names, a tiny model
    learns to *guess* the likeliest name (``data.txt``, ``result.txt``) long before it learns to
    copy the one the instruction names; names it cannot guess make copying the only way to fit
    the data. Renamed names are never those of ``INPUTS``/``OUTPUTS``/``DIRS``, so a renamed
    task is never a held-out one."""
    p, files = dict(t.params), dict(t.files)
    stems = rng.sample(WORDS, 3)
    if "input" in p:
        old = p["input"]
        p["input"] = stems[0] + os.path.splitext(old)[1]
        files[p["input"]] = files.pop(old)
    if "dir" in p:
        old = p["dir"]
        p["dir"] = stems[1]
        files = {
            (p["dir"] + k[len(old) :] if k.startswith(old + "/") else k): v
            for k, v in files.items()
        }
    p["output"] = stems[2] + ".txt"
    return ToyTask(t.id + "_renamed", t.family, p, files, t.split)


def train_tasks(per_family: int, seed: int = 0) -> list[ToyTask]:
    """``per_family`` training tasks per family: the built-in ``toy`` tasks first (the same
    ids and files), then more from the same generator, none equal to a held-out task."""

    def key(t: ToyTask) -> tuple[str, str, str]:
        return _key(t.family.name, t.params, t.files)

    held_out = {key(t) for t in generate(seed) if t.split == "eval"}
    return [t for t in generate(seed, {"train": per_family}) if key(t) not in held_out]


def write_train_suite(root: Path, per_family: int, seed: int = 0) -> int:
    """Write a training suite of `train_tasks` to ``root`` (atomically: a complete suite or
    none; an existing complete one is kept). Returns its task count."""
    root = Path(root)
    if (root / "README.md").exists():
        return sum(1 for d in root.iterdir() if (d / "task.toml").exists())
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tasks = train_tasks(per_family, seed)
    for t in tasks:
        write_task(t, tmp)
    (tmp / "README.md").write_text(
        SUITE_README.format(suite=root.name, seed=seed, n=len(tasks), split="train")
        + f"\n{per_family} tasks per family (`harnessrl.common.tasks.toy.write_train_suite`).\n"
    )
    tmp.rename(root)
    return len(tasks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description="Regenerate the built-in toy suites."
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "suites",
        help="directory to write toy/ and toy-eval/ into (default: built-in suites)",
    )
    ap.add_argument("--seed", type=int, default=0, help="generation seed (default 0)")
    ap.add_argument(
        "--train-per-family",
        type=int,
        metavar="N",
        help="instead: write a larger training suite (N tasks per family, disjoint from "
        "toy-eval) to --out",
    )
    args = ap.parse_args(argv)
    if args.train_per_family:
        n = write_train_suite(args.out, args.train_per_family, args.seed)
        print(f"{args.out}: {n} tasks")
        return 0
    counts = write_suites(args.out, args.seed)
    print(", ".join(f"{k}: {v} tasks" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

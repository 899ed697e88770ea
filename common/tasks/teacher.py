"""Scripted teacher for the toy suites: the next assistant message, given the conversation.

``teacher_step(task, messages, style, vocab)`` is a pure function. It reads what its earlier tool
calls observed from ``messages`` (OpenAI chat format) and returns the next assistant message,
spoken in the harness's own tools: ``vocab`` (`harnessrl.common.tasks.vocabulary.Vocabulary`,
read from the tools the harness declared) maps the teacher's actions — run a shell command,
write / read a file, list a folder, finish — to the harness's tool names and arguments and to
its way of ending a task (the reference harness's ``finish`` tool, mini-swe-agent's submit
command, a plain answer for Claude Code, Codex, OpenClaw and opencode). Without ``vocab`` it
speaks the reference harness (`TOOLS`: ``read_file(path)``, ``write_file(path, content)``,
``list_dir(path)``, ``run(cmd)``, ``finish(summary)``).

Style ``edit``: list the directory (level 3), read the files the task needs, write the answer
computed *from the observed file texts*, then finish. It needs the reference harness's
``read_file``/``list_dir`` (whose results are the plain text); a harness without them gets the
``shell`` style. Style ``shell``: one ``run`` of the family's shell one-liner (the shell computes
the answer, as an engineer would do it), then finish — two short replies instead of up to
seven, and nothing to copy but names from the instruction: what a tiny warm-start policy can
learn (``harnessrl pretrain``'s default). Style ``near_miss``: the same with the family's
plausible wrong one-liner.
Served through the real proxy, its turns become cold-start SFT data whose every answer is
derivable from what the model saw.

Assumptions about the harness's tool results (``actors/harnesses/reference_agent.py``'s
contract, edit style only): ``read_file`` returns the file's text; ``list_dir`` returns one
entry per line, directories ending in ``/`` (``(empty)`` for none; a JSON list of names also
works). Paths are relative to the workspace. `TOOLS` mirrors the reference agent's tool names
and parameters for offline use; through a real harness, the harness's own tool definitions
are what the model sees.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from harnessrl.common.tasks.model import Task
from harnessrl.common.tasks.toy import FAMILY, Family, reads_needed
from harnessrl.common.tasks.vocabulary import Vocabulary

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string"} for p in params},
                "required": list(params),
            },
        },
    }
    for name, desc, params in (
        ("read_file", "Read a text file of the workspace.", ("path",)),
        ("write_file", "Create or overwrite a file with the given content.", ("path", "content")),
        ("list_dir", "List a directory of the workspace.", ("path",)),
        ("run", "Run a shell command in the workspace.", ("cmd",)),
        ("finish", "Say the task is done.", ("summary",)),
    )
]
"""The reference harness's tools, in OpenAI ``tools`` format."""

REFERENCE = Vocabulary.from_request(TOOLS)
"""The reference harness's vocabulary."""


@dataclass
class Observed:
    """What the teacher's earlier tool calls returned."""

    reads: dict[str, str] = field(default_factory=dict)
    listings: dict[str, list[str]] = field(default_factory=dict)
    wrote: set[str] = field(default_factory=set)
    ran: list[str] = field(default_factory=list)
    finished: bool = False
    turns: int = 0


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _norm(path: str) -> str:
    p = path.strip()
    while p.startswith("./"):
        p = p[2:]
    return p.rstrip("/") or "."


def _entries(text: str) -> list[str]:
    s = text.strip()
    if s.startswith("["):
        try:
            data = json.loads(s)
            if isinstance(data, list):
                return [str(x) for x in data]
        except json.JSONDecodeError:
            pass
    return [ln.strip() for ln in s.splitlines() if ln.strip() and ln.strip() != "(empty)"]


def observe(messages: list[dict[str, Any]], vocab: Vocabulary = REFERENCE) -> Observed:
    """Pair each assistant tool call with its tool result, as the teacher's actions."""
    obs, calls = Observed(), {}
    for m in messages:
        role = m.get("role")
        if role == "assistant":
            obs.turns += 1
            obs.finished |= vocab.is_final(m)
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                act = vocab.action_of(str(fn.get("name")), args if isinstance(args, dict) else {})
                if act is not None:
                    calls[tc.get("id")] = act
        elif role == "tool" and m.get("tool_call_id") in calls:
            name, args = calls[m["tool_call_id"]]
            result = _text(m.get("content"))
            path = _norm(str(args.get("path", "")))
            if name == "read_file":
                obs.reads[path] = result
            elif name == "list_dir":
                obs.listings[path] = _entries(result)
            elif name == "write_file":
                obs.wrote.add(path)
            elif name == "run":
                obs.ran.append(str(args.get("cmd", "")))
    return obs


def family_of(task: Task) -> tuple[Family, dict[str, Any]]:
    meta = dict(task.metadata.get("toy") or {})
    fam = FAMILY.get(meta.pop("family", ""))
    if fam is None:
        raise ValueError(f"task {task.name} is not a toy task (no metadata.toy.family)")
    return fam, meta


STYLES = ("edit", "shell", "near_miss")
"""``edit``: read the inputs, write the answer with ``write_file`` (the model computes it);
``shell``: one ``run`` of the family's shell one-liner (the shell computes it), then finish;
``near_miss``: the same with the family's plausible wrong one-liner (``Family.near_miss``): an
imperfect demonstrator, for a warm start with mistakes RL can correct."""


def teacher_step(
    task: Task,
    messages: list[dict[str, Any]],
    style: str = "edit",
    vocab: Vocabulary | None = None,
) -> dict[str, Any]:
    """The next assistant message (OpenAI chat format) that moves the toy task forward, in
    ``vocab``'s tools (default: the reference harness's)."""
    if style not in STYLES:
        raise ValueError(f"teacher style {style!r}: choose from {STYLES}")
    vocab = vocab or REFERENCE
    fam, p = family_of(task)
    obs = observe(messages, vocab)
    turn = obs.turns
    if obs.finished:
        return {"role": "assistant", "content": "The task is done."}
    out = p["output"]
    if style == "edit" and not vocab.has("read_file", "list_dir"):
        style = "shell"  # the harness's file tools decorate what they read
    if style in ("shell", "near_miss"):
        if obs.ran or out in obs.wrote:
            return vocab.message("finish", "", turn, summary=f"Wrote {out}.")
        return vocab.message("run", "", turn, cmd=fam.command(p, near_miss=style == "near_miss"))
    if out in obs.wrote:
        return vocab.message("finish", f"I wrote {out}.", turn, summary=f"Wrote {out}.")
    listing = None
    if fam.reads_dir:
        d = _norm(p["dir"])
        if d not in obs.listings:
            return vocab.message("list_dir", f"Let me see what is in {d}/.", turn, path=d)
        listing = obs.listings[d]
    needed = reads_needed(fam, p, listing)
    done_early = fam.stop_when is not None and any(
        fam.stop_when(p, obs.reads[f]) for f in needed if f in obs.reads
    )
    for f in needed:
        if f not in obs.reads and not done_early:
            return vocab.message("read_file", f"I will read {f}.", turn, path=f)
    answer = fam.compute(p, lambda rel: obs.reads.get(_norm(rel), ""), lambda _d: listing or [])
    return vocab.message(
        "write_file", f"Now I write the answer to {out}.", turn, path=out, content=answer
    )


def style_for(instruction: str, style: str, near_miss: float, seed: int = 0) -> str:
    """The style the teacher uses for a task: ``style``, or ``near_miss`` for a ``near_miss``
    share of instructions (``style`` ``shell`` only), chosen by a hash of the instruction and
    ``seed`` — so a teacher engine, which knows a task only by its instruction, and the
    command that records it agree on every task, and tasks sharing an instruction (the same
    one-liner solves them) share a style."""
    if style != "shell" or near_miss <= 0:
        return style
    h = hashlib.blake2b(f"{seed}:{instruction.strip()}".encode(), digest_size=8).digest()
    return "near_miss" if int.from_bytes(h, "big") / 2**64 < near_miss else style


def teacher_rollout(
    task: Task,
    execute: Any,
    *,
    max_turns: int = 16,
    system: str | None = None,
    style: str = "edit",
) -> list[dict[str, Any]]:
    """Drive `teacher_step` against ``execute(name, args) -> str`` until it finishes.

    Returns the whole conversation (system?, user, assistant/tool turns). For tests and for
    building SFT data without a harness.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": task.instruction})
    for _ in range(max_turns):
        msg = teacher_step(task, messages, style)
        messages.append(msg)
        calls = msg.get("tool_calls") or []
        if not calls:
            break
        for tc in calls:
            fn = tc["function"]
            result = execute(fn["name"], json.loads(fn["arguments"]))
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
        if calls[-1]["function"]["name"] == "finish":
            break
    return messages

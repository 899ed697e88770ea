"""A harness's tool vocabulary, read from the tools it declares in its own request.

The toy teacher thinks in five *actions* (`ACTIONS`): run a shell command, write a file, read a
file, list a folder, finish. Each harness spells them in its own tools — the reference agent's
``run(cmd)``, mini-swe-agent's ``bash(command)``, Claude Code's ``Bash(command, ...)``, Codex's
``exec_command(cmd, ...)``, OpenClaw's ``exec(command, ...)``, opencode's ``bash(command, ...)``
— and ends a task its own way. `Vocabulary.from_request` derives the mapping from what the
harness sends (its ``tools`` and its prompt text), never from a table of harness names, so a
harness version that renames or adds tools is read as it is:

* **run** (``cmd``): the declared function tool with a *required* string parameter ``command``
  or ``cmd`` whose other required parameters are all strings (filled with a short
  description of the step: Claude Code's ``description``, when a version requires it). Where
  several qualify, one whose name or description speaks of a shell wins, then the one with
  the fewest required parameters, then the first declared.
* **write_file** (``path``, ``content``): a tool requiring exactly a path parameter (``path``,
  ``file_path``, ``filePath``...) and ``content``. Its path is absolute when the parameter's or
  the tool's description asks for an absolute path (Claude Code, opencode), resolved against
  the workspace mount. Without such a tool, writing is a ``run`` of ``printf '%s' ... > path``.
* **read_file**, **list_dir** (``path``): only tools of exactly those names with a ``path``
  parameter (the reference harness's contract: the result is the plain text, resp. one entry
  per line). Other harnesses' file tools decorate their results (line numbers, JSON), so the
  teacher reads with the shell there, or not at all (`has`).
* **finish** (``summary``), in this order: a declared tool named ``finish``/``submit``/
  ``task_complete``/``done`` (the reference harness: ``finish(summary)``); else a *submit
  command* the prompt tells the model to run to finish (mini-swe-agent: "finish your work by
  issuing the following command: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`"), sent through
  the run tool on its own; else a plain text answer with no tool call, which ends the turn of
  Claude Code, Codex, OpenClaw and opencode.

A harness that declares no tool able to run a command and none able to write a file cannot be
driven: `VocabularyError` names what was declared and what is needed.

`Vocabulary.message` writes an action as an assistant message (OpenAI chat format) in the
harness's vocabulary; `Vocabulary.action_of` reads a tool call of the conversation back as an
action, so the teacher can tell what its earlier turns did.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harnessrl.common.tasks.model import DEFAULT_MOUNT

ACTIONS = ("run", "write_file", "read_file", "list_dir", "finish")
"""What the teacher can want to do."""

COMMAND_KEYS = ("command", "cmd")
"""Parameter names of a shell command."""
PATH_KEYS = ("path", "file_path", "filePath", "filepath", "filename", "file")
CONTENT_KEYS = ("content", "contents", "text")
FINISH_NAMES = ("finish", "submit", "task_complete", "done")
"""Names of a declared tool that ends the task."""
_SHELLISH = re.compile(r"\b(shell|bash|terminal|command)\b", re.IGNORECASE)
_ABSOLUTE = re.compile(r"\babsolute path\b|\bmust be absolute\b", re.IGNORECASE)
_SUBMIT = re.compile(
    r"\b(?:finish|end|complete|submit)\b[^`\n]{0,160}?\bcommand\b[^`\n]{0,20}?`([^`\n]+)`",
    re.IGNORECASE,
)


class VocabularyError(ValueError):
    """The harness declares no tool the teacher can act with."""


@dataclass(frozen=True)
class ToolUse:
    """One declared tool bound to an action."""

    name: str
    keys: Mapping[str, str]
    """Action argument -> the tool's parameter (``{"cmd": "command"}``)."""
    fill: Mapping[str, str] = field(default_factory=dict)
    """Other required string parameters -> what the teacher puts there."""
    absolute: bool = False
    """Paths are given absolute (joined to the workspace mount)."""


def declared_functions(tools: Iterable[Any]) -> list[tuple[str, dict[str, Any], str]]:
    """``(name, JSON schema of the arguments, description)`` of every function tool, from
    OpenAI chat tools (``{"type": "function", "function": {...}}``), Responses tools (flat
    ``{"type": "function", "name": ...}``, ``namespace`` tools as ``ns.name``) or Anthropic
    tools (``{"name", "input_schema"}``); other entries (hosted tools) are skipped."""
    out: list[tuple[str, dict[str, Any], str]] = []
    for t in tools or ():
        if not isinstance(t, dict):
            continue
        if t.get("type") == "namespace":
            for sub in t.get("tools") or ():
                if isinstance(sub, dict) and sub.get("name"):
                    out += [(f"{t.get('name')}.{n}", s, d) for n, s, d in declared_functions([sub])]
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str) or not name or t.get("type") not in (None, "function"):
            continue
        schema = fn.get("parameters") or fn.get("input_schema") or {}
        out.append(
            (name, schema if isinstance(schema, dict) else {}, str(fn.get("description") or ""))
        )
    return out


def _params(schema: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    props = schema.get("properties")
    props = (
        {k: v for k, v in props.items() if isinstance(v, dict)} if isinstance(props, dict) else {}
    )
    req = schema.get("required")
    return props, [r for r in req if isinstance(r, str)] if isinstance(req, list) else []


def _is_string(prop: dict[str, Any] | None) -> bool:
    if prop is None:
        return False
    t = prop.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t)


def _shell_tool(fns: list[tuple[str, dict[str, Any], str]]) -> ToolUse | None:
    best: tuple[tuple[int, int, int], ToolUse] | None = None
    for order, (name, schema, desc) in enumerate(fns):
        props, req = _params(schema)
        key = next((k for k in COMMAND_KEYS if k in req and _is_string(props.get(k))), None)
        if key is None:
            continue
        others = [r for r in req if r != key]
        if not all(_is_string(props.get(r)) for r in others):
            continue
        shellish = bool(_SHELLISH.search(name.replace("_", " ")) or _SHELLISH.search(desc))
        rank = (0 if shellish else 1, len(req), order)
        use = ToolUse(name, {"cmd": key}, {r: "" for r in others})
        if best is None or rank < best[0]:
            best = (rank, use)
    return best[1] if best else None


def _write_tool(fns: list[tuple[str, dict[str, Any], str]]) -> ToolUse | None:
    for name, schema, desc in fns:
        props, req = _params(schema)
        path = next((k for k in PATH_KEYS if k in req and _is_string(props.get(k))), None)
        content = next((k for k in CONTENT_KEYS if k in req and _is_string(props.get(k))), None)
        if path is None or content is None or set(req) != {path, content}:
            continue
        path_desc = str(props[path].get("description") or "")
        absolute = bool(_ABSOLUTE.search(path_desc) or _ABSOLUTE.search(desc))
        return ToolUse(name, {"path": path, "content": content}, absolute=absolute)
    return None


def _named_path_tool(fns: list[tuple[str, dict[str, Any], str]], action: str) -> ToolUse | None:
    for name, schema, _ in fns:
        props, _req = _params(schema)
        if name == action and _is_string(props.get("path")):
            return ToolUse(name, {"path": "path"})
    return None


def _finish_tool(fns: list[tuple[str, dict[str, Any], str]]) -> ToolUse | None:
    for name, schema, _ in fns:
        if name.lower() not in FINISH_NAMES:
            continue
        props, req = _params(schema)
        if not all(_is_string(props.get(r)) for r in req):
            continue
        key = req[0] if req else next((k for k, v in props.items() if _is_string(v)), "")
        return ToolUse(name, {"summary": key} if key else {}, {r: "" for r in req[1:]})
    return None


def submit_command(prompt: str) -> str:
    """The command the prompt says ends the task ("" when it names none)."""
    m = _SUBMIT.search(prompt or "")
    return m.group(1).strip() if m else ""


@dataclass(frozen=True)
class Vocabulary:
    """How the teacher speaks one harness (see the module docstring)."""

    tools: Mapping[str, ToolUse]
    """Action -> the declared tool that does it (``run``, ``write_file``, ``read_file``,
    ``list_dir``, ``finish``; absent ones are not declared)."""
    finish: str
    """How the task ends: ``tool`` (the ``finish`` tool), ``command`` (a run of ``submit``) or
    ``answer`` (a reply with no tool call)."""
    submit: str = ""
    """The submit command (``finish == "command"``)."""
    declared: tuple[str, ...] = ()
    """Every function tool the harness declared, in order."""
    workspace: str = DEFAULT_MOUNT
    """Where the harness sees the workspace (for tools that take absolute paths)."""

    @classmethod
    def from_request(
        cls, tools: Iterable[Any] | None, prompt: str = "", workspace: str = DEFAULT_MOUNT
    ) -> Vocabulary:
        """The vocabulary of a harness that declared ``tools`` (any API's tool list) and whose
        instructions (system prompt and user messages) are ``prompt``."""
        fns = declared_functions(tools or ())
        names = tuple(n for n, _, _ in fns)
        found = {
            "run": _shell_tool(fns),
            "write_file": _write_tool(fns),
            "read_file": _named_path_tool(fns, "read_file"),
            "list_dir": _named_path_tool(fns, "list_dir"),
            "finish": _finish_tool(fns),
        }
        uses = {a: u for a, u in found.items() if u is not None}
        if "run" not in uses and "write_file" not in uses:
            raise VocabularyError(
                "the harness declares no tool that runs a shell command (a function with a "
                "required string parameter 'command' or 'cmd') nor one that writes a file (a "
                "function requiring a path and 'content'); declared: "
                + (", ".join(names) if names else "no tools")
            )
        submit = submit_command(prompt) if "run" in uses else ""
        how = "tool" if "finish" in uses else "command" if submit else "answer"
        return cls(uses, how, submit if how == "command" else "", names, workspace)

    def has(self, *actions: str) -> bool:
        """Whether the harness declares tools for every one of ``actions`` (``finish`` always
        has a way; ``write_file`` has one through ``run``)."""
        ok = set(self.tools) | {"finish"} | ({"write_file"} if "run" in self.tools else set())
        return all(a in ok for a in actions)

    # -----------------------------------------------------------------------------------------
    # speaking

    def message(self, action: str, say: str = "", turn: int = 0, **args: str) -> dict[str, Any]:
        """An assistant message doing ``action`` with ``args`` (``cmd``; ``path``, ``content``;
        ``summary``) in this harness's tools; `VocabularyError` when it has none for it."""
        if action == "finish":
            if self.finish == "tool":
                return self._call(turn, "finish", say, summary=args.get("summary", ""))
            if self.finish == "command":
                return self._call(turn, "run", say, cmd=self.submit)
            return {"role": "assistant", "content": args.get("summary") or say or "Done."}
        if action == "write_file" and "write_file" not in self.tools and "run" in self.tools:
            path, content = args["path"], args["content"]
            cmd = f"printf '%s' {shlex.quote(content)} > {shlex.quote(path)}"
            return self._call(turn, "run", say, cmd=cmd)
        if action not in self.tools:
            raise VocabularyError(
                f"the harness declares no tool to {action.replace('_', ' ')} "
                f"(declared: {', '.join(self.declared) or 'no tools'})"
            )
        return self._call(turn, action, say, **args)

    def _call(self, turn: int, action: str, say: str, **args: str) -> dict[str, Any]:
        use = self.tools[action]
        out: dict[str, Any] = {}
        for k, v in args.items():
            if k not in use.keys:
                continue
            if k == "path" and use.absolute and not v.startswith("/"):
                v = f"{self.workspace.rstrip('/')}/{v}"
            out[use.keys[k]] = v
        for k in use.fill:
            out[k] = say or f"{action.replace('_', ' ')} for the task"
        return {
            "role": "assistant",
            "content": say,
            "tool_calls": [
                {
                    "id": f"call_{turn}_{action}",
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(out)},
                }
            ],
        }

    # -----------------------------------------------------------------------------------------
    # reading back

    def action_of(
        self, name: str, arguments: Mapping[str, Any]
    ) -> tuple[str, dict[str, str]] | None:
        """The action a tool call of this harness did, with the teacher's argument names
        (None: a call of no tool the vocabulary uses)."""
        for action, use in self.tools.items():
            if use.name != name:
                continue
            args = {k: str(arguments.get(p, "")) for k, p in use.keys.items()}
            if "path" in args and use.absolute:
                args["path"] = _relative(args["path"], self.workspace)
            if action == "run" and self.finish == "command" and args["cmd"].strip() == self.submit:
                return "finish", {"summary": ""}
            return action, args
        return None

    def is_final(self, message: Mapping[str, Any]) -> bool:
        """Whether an assistant message ended the task (a ``finish`` in this vocabulary)."""
        calls = message.get("tool_calls") or []
        if not calls:
            return self.finish == "answer" and message.get("role") == "assistant"
        for tc in calls:
            fn = tc.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                args = {}
            got = self.action_of(str(fn.get("name")), args if isinstance(args, dict) else {})
            if got is not None and got[0] == "finish":
                return True
        return False


def _relative(path: str, workspace: str) -> str:
    root = workspace.rstrip("/") + "/"
    return path[len(root) :] if path.startswith(root) else path


def tools_in_prompt(text: str) -> list[dict[str, Any]]:
    """The tools a rendered ChatML prompt declares: each JSON line of its ``<tools>`` block (the
    chat template writes one tool per line, as the proxy received it)."""
    m = re.search(r"<tools>\n(.*?)\n</tools>", text, re.DOTALL)
    out: list[dict[str, Any]] = []
    for line in m.group(1).splitlines() if m else ():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict):
            out.append(tool)
    return out


def prompt_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The instructions a harness gives (system and user messages' text): where a submit
    command is named."""
    parts = []
    for m in messages:
        if m.get("role") in ("system", "user"):
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            parts.append(str(c or ""))
    return "\n".join(parts)

#!/usr/bin/env python3
"""reference_agent — harnessrl's own small agent CLI (OpenAI chat completions + tools).

Standard library only, so it runs with the plain host interpreter inside a sandbox that sees
nothing but a read-only ``/usr``: ``python3 reference_agent.py TASK`` works as well as
``python -m harnessrl.actors.harnesses.reference_agent TASK``. Nothing here may import a third-party
package or anything of harnessrl.

The loop (one model call per turn):

* tools ``read_file(path)``, ``write_file(path, content)``, ``list_dir(path)``, ``run(cmd)``
  (``sh -c`` in the workspace, per-command timeout, output truncated), ``finish(summary)``, and
  with ``--subagent`` ``delegate(task)`` (a nested loop with its own history);
* every request carries the *full* history, the assistant messages echoed back exactly as the
  server sent them (tool calls and ids unchanged), so each request extends the previous one;
* malformed tool calls (bad JSON arguments, unknown tool, wrong arguments) are answered with an
  error tool message, never a crash; a reply without tool calls gets a nudge;
* when the last reply's ``usage`` (prompt + completion tokens) exceeds ``--compact-tokens``, the
  history is compacted through the model: a request without tools whose last message is
  `COMPACTION_PROMPT`, then the loop restarts from ``[system, task + summary]``;
* HTTP 5xx, 408, 429, connection errors and unparsable replies are retried with exponential
  backoff (``Retry-After`` honoured); any other 4xx is fatal.

Calls are labelled for the proxy with the ``x-hrl-call-label`` header: ``compaction`` and
``subagent`` (compactions inside a sub-agent are ``compaction`` too); ordinary calls carry none.

Output: progress on stderr; one final JSON line on stdout (``status``, ``turns``, ``calls``,
``compactions``, ``subagents``, ``summary``, ``error``). Exit status: 0 finished, 1 error,
2 out of turns.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

LABEL_HEADER = "x-hrl-call-label"
EXIT_FINISHED, EXIT_ERROR, EXIT_MAX_TURNS = 0, 1, 2

SYSTEM_PROMPT = """\
You are a software agent in {workspace}. Use the tools to read, write and run things there.
When the task is done, call `finish`."""

SUBAGENT_SYSTEM_PROMPT = """\
You are a sub-agent: another agent delegated one focused task to you, in the directory
{workspace}. Do only that task with the tools, then call `finish` with what you found or did;
your summary is all the other agent will see."""

COMPACTION_PROMPT = """\
CONTEXT COMPACTION: the conversation is too long and will be replaced by your summary.
Do not call tools. Write a concise but complete summary of the work so far: what the task is,
what you have done and found (files read and written, commands run and their key results),
what remains to be done, and anything needed to continue. Reply with the summary only."""

NUDGE = "Continue with the task using the tools. Call `finish` with a summary when done."


def _fn(name: str, description: str, *params: str) -> dict:
    """A tool in OpenAI form. Kept terse on purpose: the schema is part of every prompt
    (rendered ~190 tokens with the tiny tokenizer, was ~430 with per-parameter descriptions)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string"} for k in params},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _fn("read_file", "Read a file.", "path"),
    _fn("write_file", "Write a file.", "path", "content"),
    _fn("list_dir", "List a directory.", "path"),
    _fn("run", "Run a shell command.", "cmd"),
    _fn("finish", "End the task.", "summary"),
]
DELEGATE_TOOL = _fn("delegate", "Give a sub-task to a sub-agent; returns its summary.", "task")


def log(msg: str) -> None:
    print(f"[reference-agent] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# HTTP client


class FatalHTTPError(Exception):
    """A reply that retrying cannot fix (4xx other than 408/429), or retries ran out."""


class ChatClient:
    """POST /chat/completions with retries; counts calls."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url = args.base_url.rstrip("/") + "/chat/completions"
        self.api_key = args.api_key
        self.model = args.model
        self.retries = args.retries
        self.retry_base = args.retry_base
        self.timeout = args.request_timeout
        self.extra = {}
        if args.max_tokens:
            self.extra["max_tokens"] = args.max_tokens
        if args.temperature is not None:
            self.extra["temperature"] = args.temperature
        self.calls = 0

    def chat(self, messages: list, tools: list | None, label: str | None = None) -> dict:
        body = {"model": self.model, "messages": messages, **self.extra}
        if tools:
            body["tools"] = tools
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"}
        if label:
            headers[LABEL_HEADER] = label
        for attempt in range(self.retries + 1):
            self.calls += 1
            try:
                req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    reply = json.loads(resp.read())
                if not isinstance(reply["choices"][0]["message"], dict):
                    raise ValueError("reply has no choices[0].message object")
                return reply
            except urllib.error.HTTPError as e:
                detail = e.read()[:500].decode(errors="replace")
                if e.code < 500 and e.code not in (408, 429):
                    raise FatalHTTPError(f"HTTP {e.code}: {detail}") from None
                why, retry_after = f"HTTP {e.code}", _retry_after(e.headers)
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                why, retry_after = f"{type(e).__name__}: {e}", None
            if attempt == self.retries:
                raise FatalHTTPError(f"giving up after {attempt + 1} attempts: {why}")
            delay = retry_after or min(self.retry_base * 2**attempt, 30.0) * random.uniform(
                0.8, 1.2
            )
            log(f"call failed ({why}); retry {attempt + 1}/{self.retries} in {delay:.2f}s")
            time.sleep(delay)
        raise AssertionError("unreachable")


def _retry_after(headers) -> float | None:
    try:
        return min(float(headers.get("Retry-After")), 60.0)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Tools (the workspace side)


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n...[{len(text) - head - tail} characters truncated]...\n{text[-tail:]}"


class Workspace:
    """The tools' implementations; every path is relative to the workspace unless absolute."""

    def __init__(self, root: str, cmd_timeout: float, max_output: int) -> None:
        self.root = os.path.abspath(root)
        self.cmd_timeout = cmd_timeout
        self.max_output = max_output

    def path(self, p: str) -> str:
        return os.path.join(self.root, os.path.expanduser(p))

    def read_file(self, path: str) -> str:
        with open(self.path(path), encoding="utf-8", errors="replace") as f:
            return truncate(f.read(), self.max_output)

    def write_file(self, path: str, content: str) -> str:
        full = self.path(path)
        os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(content)
        return f"wrote {len(content.encode())} bytes to {path}"

    def list_dir(self, path: str = ".") -> str:
        full = self.path(path or ".")
        names = sorted(
            n + ("/" if os.path.isdir(os.path.join(full, n)) else "") for n in os.listdir(full)
        )
        return truncate("\n".join(names) or "(empty)", self.max_output)

    def run(self, cmd: str) -> str:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", cmd],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=self.cmd_timeout)
            status = f"exit code: {proc.returncode}"
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
            status = f"timed out after {self.cmd_timeout:g}s (killed)"
        return f"{status}\n{truncate(out.decode(errors='replace'), self.max_output)}"


# ---------------------------------------------------------------------------------------------
# The agent loop


class Finished(Exception):
    def __init__(self, summary: str) -> None:
        self.summary = summary


class Agent:
    """One conversation: the main agent, or a sub-agent started by ``delegate``."""

    def __init__(
        self, client: ChatClient, ws: Workspace, args: argparse.Namespace, *, sub: bool = False
    ) -> None:
        self.client, self.ws, self.args, self.sub = client, ws, args, sub
        self.label = "subagent" if sub else None
        self.max_turns = args.subagent_max_turns if sub else args.max_turns
        self.tools = TOOLS + ([DELEGATE_TOOL] if args.subagent and not sub else [])
        prompt = SUBAGENT_SYSTEM_PROMPT if sub else SYSTEM_PROMPT
        self.system = {"role": "system", "content": prompt.format(workspace=ws.root)}
        self.turns = self.compactions = self.subagents = 0
        self.context_tokens = 0

    def run(self, task: str) -> tuple[str, str]:
        """Returns ``(status, summary)``: status ``finished`` or ``max_turns``."""
        messages = [self.system, {"role": "user", "content": task}]
        while self.turns < self.max_turns:
            if self.args.compact_tokens and self.context_tokens > self.args.compact_tokens:
                messages = self.compact(messages, task)
            self.turns += 1
            reply = self.client.chat(messages, self.tools, self.label)
            self.context_tokens = _context_tokens(reply, messages)
            msg = reply["choices"][0]["message"]
            messages.append(echo(msg))
            calls = msg.get("tool_calls") or []
            if not calls:
                messages.append({"role": "user", "content": NUDGE})
                continue
            finished = None
            for call in calls:  # answer every call, so the history stays well-formed
                content, done = self.dispatch(call)
                call_id = call.get("id") if isinstance(call, dict) else None
                messages.append({"role": "tool", "tool_call_id": call_id or "", "content": content})
                if done is not None and finished is None:
                    finished = done
            if finished is not None:
                return "finished", finished
        return "max_turns", ""

    def compact(self, messages: list, task: str) -> list:
        log(f"compacting history (~{self.context_tokens} tokens > {self.args.compact_tokens})")
        request = [*messages, {"role": "user", "content": COMPACTION_PROMPT}]
        reply = self.client.chat(request, None, "compaction")
        summary = reply["choices"][0]["message"].get("content") or "(no summary)"
        self.compactions += 1
        self.context_tokens = 0
        restart = f"{task}\n\n## Progress so far (summary of earlier work)\n\n{summary}"
        return [self.system, {"role": "user", "content": restart}]

    def dispatch(self, call: object) -> tuple[str, str | None]:
        """Run one tool call; returns (tool message content, finish summary or None)."""
        try:
            fn = call["function"]  # type: ignore[index]
            name = fn.get("name")
            raw = fn.get("arguments") or "{}"
            args = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            return f"error: malformed tool call ({e}); arguments must be a JSON object", None
        names = [t["function"]["name"] for t in self.tools]
        if name not in names:
            return f"error: unknown tool {name!r}; available tools: {', '.join(names)}", None
        log(f"turn {self.turns}: {name}({_brief(args)})")
        try:
            if name == "finish":
                return "ok", str(args.get("summary", ""))
            if name == "delegate":
                return self.delegate(str(args["task"])), None
            return getattr(self.ws, name)(**args), None
        except FatalHTTPError:
            raise  # a sub-agent's fatal API error ends the whole run
        except TypeError as e:
            return f"error: bad arguments for {name}: {e}", None
        except Exception as e:  # a tool failing is information for the model, not a crash
            return f"error: {type(e).__name__}: {e}", None

    def delegate(self, task: str) -> str:
        self.subagents += 1
        sub = Agent(self.client, self.ws, self.args, sub=True)
        status, summary = sub.run(task)
        self.compactions += sub.compactions
        if status == "finished":
            return f"sub-agent finished: {summary}"
        return f"sub-agent stopped after {sub.turns} turns without finishing"


def echo(msg: dict) -> dict:
    """The assistant message as sent back: the server's fields unchanged, minus nulls."""
    out = {k: v for k, v in msg.items() if v is not None}
    out["role"] = "assistant"
    out.setdefault("content", msg.get("content"))
    return out


def _context_tokens(reply: dict, messages: list) -> int:
    usage = reply.get("usage") or {}
    if isinstance(usage.get("prompt_tokens"), int):
        return usage["prompt_tokens"] + int(usage.get("completion_tokens") or 0)
    return len(json.dumps(messages)) // 4  # no usage: a rough estimate


def _brief(args: dict) -> str:
    return ", ".join(f"{k}={str(v)[:60]!r}" for k, v in args.items())


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="reference_agent",
        description="harnessrl's reference agent: OpenAI chat completions with file/shell tools.",
        epilog="Exit status: 0 finished, 1 error, 2 out of turns. Last stdout line: JSON summary.",
    )
    p.add_argument("task", nargs="?", help="the task (else --task-file, else stdin)")
    p.add_argument("--task-file", help="read the task from this file")
    p.add_argument("--workspace", default=".", help="working directory of the tools (default .)")
    p.add_argument(
        "--base-url",
        default=env("OPENAI_BASE_URL", "http://127.0.0.1:18080/v1"),
        help="OpenAI-compatible base URL, with /v1 (env OPENAI_BASE_URL)",
    )
    p.add_argument(
        "--api-key", default=env("OPENAI_API_KEY", ""), help="API key (env OPENAI_API_KEY)"
    )
    p.add_argument("--model", default=env("HRL_MODEL", "policy"), help="model (env HRL_MODEL)")
    p.add_argument(
        "--max-turns",
        type=int,
        default=int(env("HRL_MAX_TURNS", "30")),
        help="most model turns of the main loop (env HRL_MAX_TURNS, default 30)",
    )
    p.add_argument(
        "--compact-tokens",
        type=int,
        default=0,
        help="compact the history when the context exceeds this many tokens (0: never)",
    )
    p.add_argument("--subagent", action="store_true", help="offer the delegate(task) tool")
    p.add_argument("--subagent-max-turns", type=int, default=10, help="turns per sub-agent")
    p.add_argument("--cmd-timeout", type=float, default=60.0, help="seconds per run() command")
    p.add_argument("--max-output", type=int, default=10000, help="characters kept per tool result")
    p.add_argument("--max-tokens", type=int, default=0, help="max_tokens per call (0: unset)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    p.add_argument("--retries", type=int, default=6, help="retries per call on 5xx/network errors")
    p.add_argument("--retry-base", type=float, default=0.5, help="first backoff delay, seconds")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per HTTP call")
    return p.parse_args(argv)


def read_task(args: argparse.Namespace) -> str:
    if args.task:
        return args.task
    if args.task_file:
        with open(args.task_file, encoding="utf-8") as f:
            return f.read()
    if not sys.stdin.isatty():
        return sys.stdin.read()
    return ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = read_task(args).strip()
    ws = Workspace(args.workspace, args.cmd_timeout, args.max_output)
    client = ChatClient(args)
    agent = Agent(client, ws, args)
    status, summary, error = "error", "", None
    try:
        if not task:
            raise ValueError("no task given (argument, --task-file or stdin)")
        status, summary = agent.run(task)
    except (FatalHTTPError, ValueError, OSError) as e:
        error = str(e)
        log(f"error: {error}")
    except KeyboardInterrupt:
        error = "interrupted"
    result = {
        "status": status,
        "turns": agent.turns,
        "calls": client.calls,
        "compactions": agent.compactions,
        "subagents": agent.subagents,
        "summary": summary,
        "error": error,
    }
    print(json.dumps(result), flush=True)
    return {"finished": EXIT_FINISHED, "max_turns": EXIT_MAX_TURNS}.get(status, EXIT_ERROR)


if __name__ == "__main__":
    sys.exit(main())

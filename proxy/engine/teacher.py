"""The scripted toy teacher as an *engine*: cold-start SFT data through the real pipeline.

A `ScriptedEngine` whose replies come from ``harnessrl.common.tasks.teacher.teacher_step``, so teacher
trajectories flow through the same actors, sandboxes, harness, proxy (TITO, CallRecords) and
assembler as the policy's own rollouts, and the SFT learner trains on exactly the token layout
the RL phase will sample in. For each ``/generate`` call it:

1. decodes the prompt ids with the tokenizer (special tokens kept) and splits the ChatML turns
   back into chat messages: system, user, assistant (``<think>``, content, ``<tool_call>``
   blocks, parsed by the proxy's own Hermes parser) and tool results (``<tool_response>``
   blocks of a user turn, paired in order with the previous assistant turn's calls);
2. identifies the toy task from the first user message (exact instruction match, else the
   longest instruction contained in it) among the tasks of ``suites``;
3. asks ``teacher_step(task, messages)`` for the next assistant message and renders it exactly
   as the chat template would after the generation prompt (``[content\\n]<tool_call>\\n{json}
   \\n</tool_call><|im_end|>``), returning those token ids with log-probs 0 (the teacher is
   deterministic).

A prompt it cannot read, or whose task it does not know, gets a ``finish`` call (the harness
ends; the rollout scores 0, and an SFT learner with ``sft_min_reward`` drops it).

Run it as a kind of ``harnessrl engine`` (prints the engine's ready line,
``engine ready: URL (...)``, and stops on SIGTERM/SIGINT)::

    harnessrl engine --kind teacher --suites toy [--suites toy-eval] --model tiny --port 0
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
from typing import TYPE_CHECKING, Any

from harnessrl.proxy.engine.auth import key_note, serving_key

if TYPE_CHECKING:
    from harnessrl.proxy.config import EngineConfig

log = logging.getLogger("harnessrl.teacher_engine")

_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.DOTALL)
_GEN_PROMPT = "<|im_start|>assistant\n"
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def parse_prompt(text: str) -> list[dict[str, Any]]:
    """Chat messages (OpenAI format) from a rendered ChatML prompt.

    Tool results become ``tool`` messages whose ``tool_call_id`` is the id given here to the
    matching call of the previous assistant turn (``call_<turn>_<i>``), in order.
    """
    from harnessrl.proxy.parsers import HermesParser

    parser = HermesParser()
    messages: list[dict[str, Any]] = []
    turn = 0
    pending_ids: list[str] = []
    for m in _TURN.finditer(text):
        role, body = m.group(1), m.group(2)
        if role == "assistant":
            parsed = parser.parse(body + "<|im_end|>")
            ids = [f"call_{turn}_{i}" for i in range(len(parsed.tool_calls))]
            messages.append(parsed.message(ids))
            pending_ids = ids
            turn += 1
        elif role == "user" and body.startswith("<tool_response>"):
            for i, result in enumerate(_RESPONSE.findall(body)):
                call_id = pending_ids[i] if i < len(pending_ids) else f"call_orphan_{i}"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif role == "system":
            content = body.split("\n\n# Tools\n\n", 1)[0] if "# Tools" in body else body
            messages.append({"role": "system", "content": content})
        else:
            messages.append({"role": role, "content": body})
    return messages


def render_reply(message: dict[str, Any]) -> str:
    """What the model generates for ``message`` after the generation prompt: the template's
    rendering of that assistant turn, ending with ``<|im_end|>`` (without the newline the
    template writes after it, which an engine does not generate)."""
    from harnessrl.common.models import render_chat

    full = render_chat([message])
    if not full.startswith(_GEN_PROMPT) or not full.endswith("<|im_end|>\n"):
        raise ValueError(f"unexpected rendering of an assistant turn: {full[:80]!r}")
    return full[len(_GEN_PROMPT) : -1]


class TaskIndex:
    """Toy tasks by instruction text."""

    def __init__(self, suites: list[str]) -> None:
        from harnessrl.common.tasks import list_tasks

        self.by_instruction: dict[str, Any] = {}
        for suite in suites:
            for task in list_tasks(suite):
                self.by_instruction.setdefault(task.instruction.strip(), task)
        if not self.by_instruction:
            raise ValueError(f"no tasks in suites {suites}")

    def find(self, user_text: str) -> Any | None:
        text = user_text.strip()
        task = self.by_instruction.get(text)
        if task is not None:
            return task
        hits = [(len(i), t) for i, t in self.by_instruction.items() if i in text]
        return max(hits, key=lambda h: h[0])[1] if hits else None


class Teacher:
    """The ``(input_ids, body) -> Reply`` callable behind the teacher engine."""

    def __init__(self, tokenizer: Any, suites: list[str]) -> None:
        self.tokenizer = tokenizer
        self.tasks = TaskIndex(suites)
        self.served = 0
        self.unknown = 0

    def reply_text(self, prompt: str) -> str:
        """The teacher's completion for a rendered prompt (ending with ``<|im_end|>``)."""
        from harnessrl.common.tasks.teacher import teacher_step

        messages = parse_prompt(prompt)
        first_user = next((m for m in messages if m["role"] == "user"), None)
        task = self.tasks.find(first_user["content"]) if first_user else None
        if task is None:
            self.unknown += 1
            log.warning("teacher: no known task in this prompt; answering finish")
            message = _finish("I do not know this task.")
        else:
            try:
                message = teacher_step(task, messages)
            except Exception as e:  # a conversation the teacher cannot follow
                log.warning("teacher: %s: %r; answering finish", task.name, e)
                message = _finish(f"teacher error: {e}")
        self.served += 1
        return render_reply(message)

    def __call__(self, input_ids: list[int], body: dict[str, Any]) -> Any:
        from harnessrl.proxy.scripted import Reply

        prompt = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        text = self.reply_text(prompt)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return Reply(ids=ids, logprobs=[0.0] * len(ids))


def _finish(summary: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_finish",
                "type": "function",
                "function": {"name": "finish", "arguments": json.dumps({"summary": summary})},
            }
        ],
    }


def make_teacher_engine(
    suites: list[str],
    tokenizer: str = "tiny",
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str = "",
) -> Any:
    """A `ScriptedEngine` (not started) answering as the toy teacher (``api_key``: required
    on every request but ``/health``)."""
    from harnessrl.common.models import load_tokenizer, resolve_model
    from harnessrl.proxy.scripted import ScriptedEngine

    tok = load_tokenizer(resolve_model(tokenizer))
    return ScriptedEngine(
        tok,
        Teacher(tok, suites),
        host=host,
        port=port,
        model_path=f"teacher:{tokenizer}",
        api_key=api_key,
    )


async def serve_teacher(cfg: EngineConfig, stop: asyncio.Event | None = None) -> int:
    """``harnessrl engine --kind teacher``: serve until SIGTERM/SIGINT (or ``stop``); print the
    engine's ready line on stdout."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        key, where = serving_key(cfg.api_key, cfg.api_key_file, cfg.insecure)
        eng = make_teacher_engine(cfg.suites, cfg.model, host=cfg.host, port=cfg.port, api_key=key)
        await eng.start()
    except (ValueError, KeyError, OSError) as e:
        print(f"harnessrl engine: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        print(
            f"engine ready: {eng.url} (teacher, tokenizer {cfg.model}, "
            f"suites {', '.join(cfg.suites)}, weight_version {eng.weight_version}, "
            f"{key_note(where)})",
            flush=True,
        )
        await stop.wait()
        teacher = eng.fn
        log.info("teacher served %d calls (%d unknown tasks)", teacher.served, teacher.unknown)
    finally:
        await eng.stop()
    print("engine stopped", flush=True)
    return 0

"""The scripted toy teacher as an *engine*: cold-start SFT data through the real pipeline.

A `ScriptedEngine` whose replies come from ``harnessrl.common.tasks.teacher.teacher_step``, so teacher
trajectories flow through the same actors, sandboxes, harness, proxy (TITO, CallRecords) and
assembler as the policy's own rollouts, and the SFT learner trains on exactly the token layout
the RL phase will sample in. For each ``/generate`` call it:

1. decodes the prompt ids with the tokenizer (special tokens kept) and splits the ChatML turns
   back into chat messages: system, user, assistant (``<think>``, content, ``<tool_call>``
   blocks, parsed by the proxy's own Hermes parser) and tool results (``<tool_response>``
   blocks of a user turn, paired in order with the previous assistant turn's calls);
2. identifies the toy task from the first user message that holds one (exact instruction
   match, else the longest instruction contained in it) among the tasks of ``suites``;
3. reads the harness's tool vocabulary from the prompt: the tools it declared (the template's
   ``<tools>`` block, one tool per line as the harness sent it) and its instructions (a submit
   command) — `harnessrl.common.tasks.vocabulary.Vocabulary`;
4. asks ``teacher_step(task, messages, style, vocab)`` for the next assistant message, in that
   harness's tools, and renders it exactly as the chat template would after the generation
   prompt (``[content\\n]<tool_call>\\n{json}\\n</tool_call><|im_end|>``), returning those
   token ids with log-probs 0 (the teacher is deterministic).

The style is ``style`` (``edit`` or ``shell``), with a ``near_miss`` share of instructions
demonstrating the family's plausible mistake (``harnessrl.common.tasks.teacher.style_for``).

A prompt whose task it does not know gets the harness's way of finishing (the harness ends;
the rollout scores 0, and an SFT learner with ``sft_min_reward`` drops it); a call that
declares no tools (a title request) gets a short plain answer; a harness that declares no tool
the teacher can use gets a plain answer saying so, and the reason is logged (once per
harness tool set).

Run it as a kind of ``harnessrl engine`` (prints the engine's ready line,
``engine ready: URL (...)``, and stops on SIGTERM/SIGINT)::

    harnessrl engine --kind teacher --suites toy [--suites toy-eval] --model tiny --port 0
"""

from __future__ import annotations

import asyncio
import contextlib
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

    def __init__(
        self,
        tokenizer: Any,
        suites: list[str],
        *,
        style: str = "edit",
        near_miss: float = 0.0,
        seed: int = 0,
    ) -> None:
        from harnessrl.common.tasks.teacher import STYLES

        if style not in STYLES or style == "near_miss":
            raise ValueError(f"teacher style {style!r}: choose edit or shell")
        self.tokenizer = tokenizer
        self.tasks = TaskIndex(suites)
        self.style, self.near_miss, self.seed = style, near_miss, seed
        self.served = 0
        self.unknown = 0
        self.unusable = 0
        """Calls of a harness that declares no tool the teacher can use."""
        self._vocab: dict[str, Any] = {}
        self._found: dict[str, Any] = {}
        self._warned: set[str] = set()

    def find_task(self, messages: list[dict[str, Any]]) -> Any | None:
        """The task of the first user message that holds a known instruction (Codex sends its
        environment context first, the task after it); cached by message text."""
        for m in messages:
            if m["role"] != "user" or not isinstance(m.get("content"), str):
                continue
            text = m["content"]
            if text not in self._found:
                if len(self._found) > 4096:
                    self._found.clear()
                self._found[text] = self.tasks.find(text)
            if self._found[text] is not None:
                return self._found[text]
        return None

    def vocabulary(self, prompt: str, messages: list[dict[str, Any]]) -> Any:
        """The harness's vocabulary (cached per tool block and instructions); raises
        `VocabularyError` when it declares nothing usable."""
        from harnessrl.common.tasks.vocabulary import Vocabulary, prompt_text, tools_in_prompt

        m = re.search(r"<tools>\n.*?\n</tools>", prompt, re.DOTALL)
        text = prompt_text(messages)
        key = (m.group(0) if m else "") + "\0" + text
        got = self._vocab.get(key)
        if got is None:
            tools = tools_in_prompt(prompt)
            try:
                got = Vocabulary.from_request(tools, text)
            except ValueError as e:
                got = e
            if len(self._vocab) > 256:
                self._vocab.clear()
            self._vocab[key] = got
        if isinstance(got, Exception):
            raise got
        return got

    def reply_text(self, prompt: str) -> str:
        """The teacher's completion for a rendered prompt (ending with ``<|im_end|>``)."""
        from harnessrl.common.tasks.teacher import style_for, teacher_step
        from harnessrl.common.tasks.vocabulary import VocabularyError

        messages = parse_prompt(prompt)
        task = self.find_task(messages)
        self.served += 1
        if "<tools>" not in prompt:  # a title or summary request: no tools to act with
            words = (task.instruction if task else "Toy task").split()
            return render_reply({"role": "assistant", "content": " ".join(words[:6])})
        try:
            vocab = self.vocabulary(prompt, messages)
        except VocabularyError as e:
            self.unusable += 1
            if str(e) not in self._warned:
                self._warned.add(str(e))
                log.warning("teacher: %s", e)
            return render_reply({"role": "assistant", "content": f"I cannot act here: {e}"})
        if task is None:
            self.unknown += 1
            log.warning("teacher: no known task in this prompt; finishing")
            return render_reply(vocab.message("finish", summary="I do not know this task."))
        style = style_for(task.instruction, self.style, self.near_miss, self.seed)
        try:
            message = teacher_step(task, messages, style, vocab)
        except Exception as e:  # a conversation the teacher cannot follow
            log.warning("teacher: %s: %r; finishing", task.name, e)
            message = vocab.message("finish", summary=f"teacher error: {e}")
        return render_reply(message)

    def __call__(self, input_ids: list[int], body: dict[str, Any]) -> Any:
        from harnessrl.proxy.scripted import Reply

        prompt = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        text = self.reply_text(prompt)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return Reply(ids=ids, logprobs=[0.0] * len(ids))


def make_teacher_engine(
    suites: list[str],
    tokenizer: str = "tiny",
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str = "",
    style: str = "edit",
    near_miss: float = 0.0,
    seed: int = 0,
) -> Any:
    """A `ScriptedEngine` (not started) answering as the toy teacher (``api_key``: required
    on every request but ``/health``; ``style``, ``near_miss``, ``seed``: see `Teacher`)."""
    from harnessrl.common.models import load_tokenizer, resolve_model
    from harnessrl.proxy.scripted import ScriptedEngine

    tok = load_tokenizer(resolve_model(tokenizer))
    return ScriptedEngine(
        tok,
        Teacher(tok, suites, style=style, near_miss=near_miss, seed=seed),
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
        eng = make_teacher_engine(
            cfg.suites,
            cfg.model,
            host=cfg.host,
            port=cfg.port,
            api_key=key,
            style=cfg.teacher_style,
            near_miss=cfg.near_miss,
            seed=cfg.seed,
        )
        await eng.start()
    except (ValueError, KeyError, OSError) as e:
        print(f"harnessrl engine: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        print(
            f"engine ready: {eng.url} (teacher, tokenizer {cfg.model}, "
            f"suites {', '.join(cfg.suites)}, style {cfg.teacher_style}, "
            f"weight_version {eng.weight_version}, {key_note(where)})",
            flush=True,
        )
        await stop.wait()
        teacher = eng.fn
        log.info(
            "teacher served %d calls (%d unknown tasks, %d without a usable tool)",
            teacher.served,
            teacher.unknown,
            teacher.unusable,
        )
    finally:
        await eng.stop()
    print("engine stopped", flush=True)
    return 0

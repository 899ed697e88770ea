"""Token-in-token-out (TITO): build each call's prompt from the ids the engine really sampled.

A harness sends its whole conversation on every call, as text. Re-encoding that text does not
reproduce what the model produced (BPE merges differently, harnesses re-serialise tool calls,
templates rewrite earlier turns), and training on re-encoded ids would train on tokens nobody
sampled. So, per rollout, TITO keeps every earlier call (its request messages, its input ids,
its output ids and its parsed reply) and builds call *i*'s input as::

    input_k + output_k + encode(the template's closing + render(new messages only))

where *k* is the earliest-started, longest earlier call whose request messages plus its own reply
are a prefix of call *i*'s messages (see ``TitoSession.prepare``). Where no reply matches (a fork,
a compaction) the prompt is rendered from the longest prefix known in ids (an earlier request's
input, else nothing) and counted as a miss. A request identical to an earlier successful one (a
harness regenerating a reply) gets exactly that request's ids; the retry of a failed call is
built like the failed call was, from the same anchors.

Invariants (tested):

* Sampled ids are never altered or dropped: the input of call *i* starts with ``input_k +
  output_k`` exactly, every sampled id of ``output_k`` included (and its log-prob stays on the
  record), followed by exactly what the template writes to close that turn (see below). So the
  recorded output and the next render agree, and a linear conversation is one branch of the
  assembled tree (one leaf), never a dead end at every turn.
* On a conversation nobody re-serialised, the TITO ids equal the ids of a full render, except
  right after an output that stopped on a stop token the template does not write
  (``<|endoftext|>``): that sampled token is kept, followed by the template's turn end.
* Whatever the harness does to earlier turns that keeps their meaning (reordered JSON keys,
  renamed tool-call ids, whitespace in arguments, a dropped reasoning field), the input of call
  *i* still starts with ``input_k + output_k`` exactly.
* The new part is rendered by the template and encoded on its own, starting at its first special
  token, so BPE never merges across the boundary with sampled ids.
* A prompt whose messages reuse an earlier call's request and reply (by meaning) but whose ids
  do not start with that call's ``input + output`` is a **false fork** (a dead-end branch in the
  tree): it is never a hit (``kind`` ``miss``, ``false_fork`` set) and is counted on its own
  (``hrl_proxy_false_forks_total``) besides the miss. A hit always extends its anchor's ids.
* Only calls that succeeded count: ``prepare`` changes no state and counts nothing; ``commit``
  (called once the engine answered) remembers the call and counts its kind. A failed call (engine
  down, error, abort) is never committed, so it is neither a miss nor an anchor, and the next
  call of a rollout whose first calls all failed is still its ``first``.

What a call costs follows the tokens it adds, not its context (a long rollout's calls must not
grow ever slower): the new part is rendered from a window of the conversation, not the whole of
it (``ChatRenderer.new_part``; whole conversations only for a template that fails the window
probe, and for the first call and misses), only it is tokenised, the meaning hashes of messages
the previous call already had are reused (``_Seen``), anchors are looked up by digest rather
than scanned, messages already normalised by the API layer are not normalised again
(``Normalized``), and ids stay int32 arrays (``TitoPrompt.ids``), concatenated, never rebuilt
as lists.

Seams handled (each has its test in tests/test_proxy_tito.py):

* The engine stops on ``<|im_end|>`` without the ``\\n`` the template writes after it: every
  sampled id is kept and exactly that ``\\n`` is spliced in. An output that stopped on another
  stop token (``<|endoftext|>``) keeps that token and is followed by the template's whole turn end
  (``<|im_end|>\\n``); an output cut off by ``max_new_tokens`` is closed the same way.
* Templates group consecutive tool results into one turn: the new part is found by rendering
  the prefix and the conversation (from a window) and checking that one is a string prefix of
  the other; when it is not, the next candidate is tried, and finally a full render.
* Templates without a tool section (SmolLM2): tools, tool calls and tool results are written
  into the messages Hermes-style before rendering (``harnessrl.proxy.tool_fallback``; only for
  a template that does not render the tools it is given).
* Templates that drop ``<think>`` of earlier turns (Qwen3): when the prefix check fails, it is
  retried with the reasoning of the reused turns blanked on both sides, so the new part is still
  found and the history stays as the engine saw it.

Normalised message format (what the API layers convert OpenAI chat, Anthropic messages and
Responses input into; ``normalize_messages`` does it for OpenAI-chat-shaped dicts)::

    {"role": "system" | "user" | "assistant" | "tool" | <other>,
     "content": str,                               # text parts concatenated; "" if none
     "reasoning_content": str,                     # assistant only; absent = unknown/none
     "tool_calls": [{"id": str, "type": "function",
                     "function": {"name": str, "arguments": str}}],  # assistant only; raw JSON
     "tool_call_id": str, "name": str}             # tool only, optional

Tools are OpenAI function tools ``{"type": "function", "function": {name, description,
parameters}}``; ``None`` and ``[]`` are the same.

Matching compares by meaning: user/system/tool turns by role and exact content; assistant
turns by stripped content, tool names and canonical JSON arguments (``json.loads`` then
``json.dumps(sort_keys=True)``), and reasoning when the harness sent it (a harness that drops
reasoning still matches: the sampled reasoning stays in the ids). Tool-call ids are ignored.
Tools must be equal as canonical JSON.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from harnessrl.common import metrics
from harnessrl.common.models import eos_token_ids, render_chat
from harnessrl.proxy.tool_fallback import hermes_messages, template_renders_tools

log = logging.getLogger("harnessrl.proxy.tito")

__all__ = [
    "ChatRenderer",
    "Normalized",
    "PromptTooLong",
    "TitoPrompt",
    "TitoSession",
    "canonical_json",
    "normalize_messages",
    "normalize_tools",
]

M_TITO = metrics.counter(
    "hrl_proxy_tito_total",
    "Successful calls by how token-in-token-out built their prompt (first, hit, miss)",
    ("result",),
)
M_FALSE_FORKS = metrics.counter(
    "hrl_proxy_false_forks_total",
    "Successful calls whose messages reuse an earlier call's request and reply but whose ids "
    "do not extend that call's input+output (a dead-end branch in the tree)",
)
M_WINDOW_MISMATCHES = metrics.counter(
    "hrl_proxy_tito_window_mismatches_total",
    "New parts rendered from a window of the conversation that differed from the full render "
    "(the renderer renders whole conversations from then on)",
)


class PromptTooLong(Exception):
    """The prompt would have at least ``at_least`` ids, ``max_ids`` or more: known from the
    length of the text still to encode, before encoding it (see ``TitoSession.prepare``)."""

    def __init__(self, at_least: int, max_ids: int) -> None:
        super().__init__(f"the prompt has at least {at_least} ids (limit {max_ids})")
        self.at_least, self.max_ids = at_least, max_ids


# ---------------------------------------------------------------------------------------------
# normalisation and meaning keys
# ---------------------------------------------------------------------------------------------

_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def _text(content: Any) -> str:
    """Content as the template renders it: strings and ``text`` parts concatenated."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
            out.append(str(part.get("text") or ""))
    return "".join(out)


def _arguments(args: Any) -> str:
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False)


class Normalized(list):
    """Messages already in the normalised format (what ``normalize_messages`` returns):
    ``TitoSession.prepare`` takes them as they are instead of normalising them again."""


def normalize_messages(messages: Sequence[dict[str, Any]]) -> Normalized:
    """OpenAI-chat-shaped messages -> the normalised format (rendering is unchanged by it)."""
    out = Normalized()
    for m in messages:
        role = str(m.get("role") or "user")
        n: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if role == "assistant":
            reasoning = next((m[k] for k in _REASONING_KEYS if isinstance(m.get(k), str)), None)
            if reasoning is not None:
                n["reasoning_content"] = reasoning
            calls = []
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or tc
                calls.append(
                    {
                        "id": str(tc.get("id") or ""),
                        "type": "function",
                        "function": {
                            "name": str(fn.get("name") or ""),
                            "arguments": _arguments(fn.get("arguments")),
                        },
                    }
                )
            if calls:
                n["tool_calls"] = calls
        elif role == "tool":
            for k in ("tool_call_id", "name"):
                if m.get(k):
                    n[k] = str(m[k])
        out.append(n)
    return out


def normalize_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools list, ``None`` when empty."""
    return [dict(t) for t in tools] if tools else None


def canonical_json(text: str) -> str:
    """JSON text re-serialised with sorted keys and no whitespace (unparseable: stripped text)."""
    try:
        return json.dumps(
            json.loads(text), sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )
    except (ValueError, TypeError):
        return text.strip()


def _visible_key(m: dict[str, Any]) -> bytes:
    """What a turn means, without reasoning and tool-call ids."""
    if m.get("role") == "assistant":
        calls = [
            (tc["function"]["name"], canonical_json(tc["function"]["arguments"]))
            for tc in m.get("tool_calls") or []
        ]
        key: Any = ["assistant", (m.get("content") or "").strip(), calls]
    else:
        key = [m.get("role"), m.get("content") or ""]
    return json.dumps(key, ensure_ascii=False).encode()


def _reasoning(m: dict[str, Any]) -> str | None:
    r = m.get("reasoning_content")
    return r.strip() if isinstance(r, str) else None


def _chain(prev: bytes, m: dict[str, Any]) -> bytes:
    return hashlib.blake2b(prev + _visible_key(m), digest_size=16).digest()


def _digests(messages: Sequence[dict[str, Any]], seen: _Seen | None = None) -> list[bytes]:
    """``d[i]`` identifies the meaning of ``messages[:i]`` (a hash chain of visible keys). A
    link is taken from ``seen`` (a ``_Seen``) where the chain so far and the message are the
    same there, so only what changed or is new is hashed."""
    old, old_d = (seen.messages, seen.digests) if seen is not None else ((), ())
    out = [b""]
    for i, m in enumerate(messages):
        if i < len(old) and out[i] == old_d[i] and m == old[i]:
            out.append(old_d[i + 1])
        else:
            out.append(_chain(out[i], m))
    return out


def _array(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


_WINDOW_EXACT: dict[str, bool] = {}
"""Whether window rendering is exact for a template (and its kwargs), probed once per process."""


class ChatRenderer:
    """A tokenizer plus its chat template, and the facts about the template TITO relies on.

    **Window rendering.** The new part of a prompt (``new_part``) is what the template writes
    for the new messages once the earlier ones are written. Rendering the whole conversation to
    find it makes each call cost as much as its context; instead it is rendered from a *window*:
    the first message (system prompt and tools header), the last user message (templates that
    treat the turns after the last user query differently, Qwen3), the last earlier message
    (templates that join consecutive turns, tool results), then the new messages. That is exact
    for a template whose rendering of a message depends only on those, so it is used only for
    templates that pass a probe (``window_exact``: every split of a few agent conversations gives
    the same new part both ways), and the first ``verify_first`` window renders on real traffic
    are checked against the full render: on a difference the full one is used, the renderer
    renders whole conversations from then on, and it is counted
    (``hrl_proxy_tito_window_mismatches_total``).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        stop_ids: Sequence[int] | None = None,
        *,
        incremental: bool | None = None,
        verify_first: int = 16,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = getattr(self._backend, "encode_batch_fast", None)
        """tokenizers' encode without offsets (0.21+), the hot path of every call's prompt."""
        self.template = template or getattr(tokenizer, "chat_template", None) or None
        self.template_kwargs = dict(template_kwargs or {})
        self.tool_fallback = not template_renders_tools(
            lambda m, t: render_chat(m, tools=t, template=self.template, **self.template_kwargs)
        )
        """The template cannot render tools: tools, tool calls and tool results are written
        into the messages Hermes-style first (``harnessrl.proxy.tool_fallback``)."""
        self.stop_ids = list(stop_ids) if stop_ids is not None else eos_token_ids(tokenizer)
        self.turn_end = self._probe_turn_end()
        """What the template writes after an assistant turn's content (``<|im_end|>\\n``)."""
        probe = [{"role": "user", "content": "x"}]
        gen_text = self.render(probe, None, gen=True)[len(self.render(probe, None, gen=False)) :]
        self.gen_ids = self.encode(gen_text)
        """Ids of the generation prompt (``<|im_start|>assistant\\n``), assumed history-free."""
        self._stop_text = {i: self.decode([i]) for i in self.stop_ids}
        self.incremental = incremental
        """Whether new parts are rendered from a window (see the class docstring); None:
        whether the template passes the probe, decided on first use."""
        self.verify_first = verify_first
        """How many window renders (the first ones) are checked against the full render (a
        bounded cost, paid while conversations are short)."""
        self._windows = 0

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, gen: bool
    ) -> str:
        if self.tool_fallback:
            messages, tools = hermes_messages(messages, tools), None
        return render_chat(
            messages,
            tools=tools or None,
            add_generation_prompt=gen,
            template=self.template,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:  # same ids without the offsets: ~30 % less of a call's CPU
            return self._fast([text], add_special_tokens=False)[0].ids
        if self._backend is not None:  # same ids, faster, no max-length warning
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for (the longest vocabulary
        entry: byte-level entries hold a character per byte); 0 when the tokenizer does not
        list its vocabulary. A text of ``c`` characters encodes to at least
        ``c / max_token_chars`` ids."""
        try:
            return max(map(len, self.tokenizer.get_vocab()), default=0)
        except (AttributeError, TypeError):
            return 0

    def at_least(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))``, without encoding it."""
        most = self.max_token_chars
        return -(-len(text) // most) if most else 0

    def _probe_turn_end(self) -> str:
        marker = "\u2063probe\u2063"
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
        text = self.render(probe, None, gen=False)
        return text[text.rindex(marker) + len(marker) :]

    def new_part(
        self,
        msgs: list[dict[str, Any]],
        n: int,
        tools: list[dict[str, Any]] | None,
        *,
        reply: bool,
        full: str | None = None,
    ) -> str | None:
        """What ``render(msgs, gen=True)`` adds to ``render(msgs[:n])``: the template's
        rendering of the new messages and the generation prompt. Where ``render(msgs[:n])`` is
        not a prefix (a template that drops the reasoning of earlier turns), it is retried with
        the reasoning of ``msgs[:n]`` left out on both sides. None when it still is not, or, for
        a ``reply`` (``msgs[n - 1]`` is a sampled turn), when it does not end with the
        template's turn end. ``full``: ``render(msgs, gen=True)`` if the caller has it."""
        if not self.windowed():
            return self._new_part(msgs, n, tools, reply, full)
        keep = _window(msgs, n)
        try:
            part = self._new_part([msgs[i] for i in keep] + msgs[n:], len(keep), tools, reply)
        except Exception:  # the template refuses the window: render the whole conversation
            return self._new_part(msgs, n, tools, reply, full)
        self._windows += 1
        if self._windows <= self.verify_first:
            whole = self._new_part(msgs, n, tools, reply, full)
            if whole != part:
                self.incremental = False
                M_WINDOW_MISMATCHES.inc()
                log.warning(
                    "a window render differs from the full render with this chat template "
                    "(%d messages, new from %d): rendering whole conversations from now on",
                    len(msgs),
                    n,
                )
                return whole
        return part

    def windowed(self) -> bool:
        """Whether new parts are rendered from a window now (probing the template once)."""
        if self.incremental is None:
            self.incremental = self.window_exact()
        return self.incremental

    def _new_part(
        self,
        msgs: list[dict[str, Any]],
        n: int,
        tools: list[dict[str, Any]] | None,
        reply: bool,
        full: str | None = None,
    ) -> str | None:
        """``new_part`` from renders of the whole of ``msgs``."""
        part = self._split(msgs, n, tools, reply, full)
        if part is None and any("reasoning_content" in m for m in msgs[:n]):
            blank = [_without_reasoning(m) for m in msgs[:n]] + msgs[n:]
            part = self._split(blank, n, tools, reply)
        return part

    def _split(
        self,
        msgs: list[dict[str, Any]],
        n: int,
        tools: list[dict[str, Any]] | None,
        reply: bool,
        full: str | None = None,
    ) -> str | None:
        head = self.render(msgs[:n], tools, gen=False)
        if full is None:
            full = self.render(msgs, tools, gen=True)
        if not full.startswith(head) or (reply and not head.endswith(self.turn_end)):
            return None
        return full[len(head) :]

    def window_exact(self) -> bool:
        """Whether a window render gives the same new part as rendering the whole conversation
        at every split of the probe conversations (``_PROBES``, with and without tools);
        probed once per template and kwargs."""
        key = repr((self.template, sorted(self.template_kwargs.items())))
        exact = _WINDOW_EXACT.get(key)
        if exact is None:
            exact = _WINDOW_EXACT[key] = self._probe_window()
            if not exact:
                log.info("the chat template fails the window probe: TITO renders in full")
        return exact

    def _probe_window(self) -> bool:
        for msgs, tools in itertools.product(_PROBES, (None, _PROBE_TOOLS)):
            try:
                full = self.render(msgs, tools, gen=True)
            except Exception:  # the template refuses this conversation: nothing to compare
                continue
            for n in range(1, len(msgs)):
                reply = msgs[n - 1]["role"] == "assistant"  # as the anchors that end there
                keep = _window(msgs, n)
                window = [msgs[i] for i in keep] + msgs[n:]
                try:
                    want = self._new_part(msgs, n, tools, reply, full)
                except Exception:
                    continue
                try:
                    if self._new_part(window, len(keep), tools, reply) != want:
                        return False
                except Exception:
                    return False
        return True

    def closing(self, output_ids: Sequence[int]) -> str:
        """The text the template writes after a sampled output to close its turn; every sampled
        id is kept before it (never altered or dropped).

        Stopped on the token the template's turn end starts with (``<|im_end|>``): the rest of
        the turn end (``\\n``). Stopped on another stop token (``<|endoftext|>``) or cut off by
        ``max_new_tokens``: the whole turn end (``<|im_end|>\\n``).
        """
        if output_ids and output_ids[-1] in self._stop_text:
            stop = self._stop_text[output_ids[-1]]
            if stop and self.turn_end.startswith(stop):
                return self.turn_end[len(stop) :]
        return self.turn_end


def _window(msgs: Sequence[dict[str, Any]], n: int) -> list[int]:
    """Indices of the messages of ``msgs[:n]`` a window render keeps (see ``ChatRenderer``): the
    first, the last user message and the last."""
    if n <= 3:
        return list(range(n))
    user = next((i for i in range(n - 2, 0, -1) if msgs[i].get("role") == "user"), 0)
    return [0, user, n - 1] if user else [0, n - 1]


def _probe_call(i: int, arguments: str) -> dict[str, Any]:
    return {
        "id": f"p{i}",
        "type": "function",
        "function": {"name": "probe", "arguments": arguments},
    }


def _probe_conversations() -> list[list[dict[str, Any]]]:
    """Agent conversations (normalised) that exercise what templates do across turns: a system
    prompt or none, tool calls and grouped tool results, reasoning before and after the last
    user message, consecutive assistant turns, several user turns."""
    system = {"role": "system", "content": "Be brief."}
    users = [{"role": "user", "content": f"Task {i}."} for i in range(3)]
    text = {"role": "assistant", "content": "Done."}
    think = {"role": "assistant", "content": "Looking.", "reasoning_content": "Think first."}

    def call(i: int, think: bool = False, two: bool = False) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": "Running." if two else ""}
        if think:
            m["reasoning_content"] = f"Plan {i}."
        m["tool_calls"] = [_probe_call(i, f'{{"x": {i}}}')]
        if two:
            m["tool_calls"].append(_probe_call(i + 100, '{"y": "z"}'))
        return m

    def result(i: int) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": f"p{i}", "content": f"out {i}"}

    return [
        [system, users[0], call(1), result(1), call(2, two=True), result(2), result(102),
         think, users[1], call(3, think=True), result(3), text, users[2], text],
        [users[0], think, users[1], call(4, think=True, two=True), result(4), result(104),
         call(5, think=True), result(5), call(6), result(6), text],
        [system, users[0], call(7, think=True), result(7), call(8, think=True), result(8),
         think, think, users[1], call(9), result(9)],
    ]  # fmt: skip


_PROBES = _probe_conversations()
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe tool.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


# ---------------------------------------------------------------------------------------------
# per-rollout state
# ---------------------------------------------------------------------------------------------


@dataclass
class _Anchor:
    """A conversation prefix whose token ids are known exactly."""

    seq: int
    n_msgs: int
    digest: bytes
    tools_key: str
    reasoning: dict[int, str | None]
    """Reasoning (stripped) of each covered assistant message, by index."""
    ids: np.ndarray
    """int32 ids of the prefix: a ``reply`` anchor's are its call's whole input + output, a
    ``request`` anchor's its call's input without the generation prompt."""
    closing: str
    """Text the template writes after ``ids`` to close the turn (``reply``; ``""``: none)."""
    kind: Literal["reply", "request"]


TitoKind = Literal["hit", "miss", "first"]


@dataclass(eq=False)
class TitoPrompt:
    """A prompt built for one call."""

    ids: np.ndarray
    """The input ids (int32; ``input_ids`` is the same as a list)."""
    kind: TitoKind
    """``first``: no earlier call of the rollout succeeded. ``hit``: every assistant turn of the
    prompt comes from ids the engine sampled (and the ids extend them). ``miss``: some assistant
    turn had to be rendered from text (a fork or edit of history, a compaction, a false fork);
    the longest prefix known in ids is still reused."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    anchor_seq: int = -1
    """Call whose ids were reused (-1: none)."""
    anchor_kind: str = ""
    """``reply`` (its input+output) or ``request`` (its input, for a retried/extended request)."""
    reused: int = 0
    """Number of leading ids taken from the anchor."""
    false_fork: bool = False
    """The messages reuse an earlier call's request and reply, but the ids do not extend that
    call's input+output (see the module docstring). Never a hit."""
    digests: list[bytes] = field(default_factory=list, repr=False)
    tools_key: str = field(default="", repr=False)
    track: str = "main"
    """The call's label: ``first`` and misses are counted per track."""

    @property
    def hit(self) -> bool:
        return self.kind == "hit"

    @functools.cached_property
    def input_ids(self) -> list[int]:
        """The input ids as a list (built on first use)."""
        return self.ids.tolist()


@dataclass
class _Seen:
    """The last committed conversation of a track: its messages (the reply included) and their
    digests. The next call reuses the digests of the messages it repeats (equal dicts, in the
    same place after the same history) instead of hashing its whole history again; normalised
    messages hold only strings, so equal dicts mean equal meaning keys."""

    messages: list[dict[str, Any]]
    digests: list[bytes]


class TitoSession:
    """TITO state of one rollout: ``prepare`` a prompt, then ``commit`` what the call produced
    (only when it succeeded: a failed call leaves no trace, see the module docstring)."""

    def __init__(self, renderer: ChatRenderer, max_tries: int = 4) -> None:
        self.r = renderer
        self.max_tries = max_tries
        """Candidate anchors tried (longest first) before rendering in full."""
        self.anchors: list[_Anchor] = []
        self._by_digest: dict[bytes, list[_Anchor]] = {}
        """The anchors by digest."""
        self.calls: dict[str, int] = {}
        """Calls committed (succeeded), by track (the call's label): a rollout's first ``main``
        call is its ``first`` even when a title (``aux``) request succeeded before it."""
        self.counts: dict[str, int] = {"hit": 0, "miss": 0, "first": 0}
        """Committed calls by prompt kind."""
        self.false_forks = 0
        """Committed calls that were false forks."""
        self._seen: dict[str, _Seen] = {}
        """The last committed conversation, by track."""

    def prepare(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        track: str = "main",
        max_ids: int = 0,
    ) -> TitoPrompt:
        """The input ids for a call with these messages (normalised here unless they are a
        ``Normalized`` list: OpenAI-chat-shaped input is accepted) and tools. Changes no state
        and counts nothing: the call counts once ``commit`` says it succeeded, so it may run in
        a worker thread while the event loop serves other rollouts. With ``max_ids``, raises
        `PromptTooLong` instead of encoding a text that makes the prompt that long for
        certain (a harness cannot make the proxy tokenise megabytes that can never fit)."""
        msgs = messages if isinstance(messages, Normalized) else normalize_messages(messages)
        tools_n = normalize_tools(tools)
        digests = _digests(msgs, self._seen.get(track))
        tkey = _tools_key(tools_n)
        # whole-conversation rendering only: rendered once for every anchor tried
        full = None if self.r.windowed() else self.r.render(msgs, tools_n, gen=True)
        sent = [(i, r) for i, m in enumerate(msgs) if (r := _reasoning(m)) is not None]
        prompt = None
        for a in itertools.islice(_matching(self._found(digests, tkey), sent), self.max_tries):
            prompt = self._extend(a, msgs, tools_n, full, max_ids)
            if prompt is not None:
                break
        if prompt is None:
            kind: TitoKind = "miss" if self.calls.get(track) else "first"
            if full is None:
                full = self.r.render(msgs, tools_n, gen=True)
            prompt = TitoPrompt(_array(self._encode(full, 0, max_ids)), kind, msgs, tools_n)
        prompt.digests, prompt.tools_key, prompt.track = digests, tkey, track
        if self._false_fork(prompt, _matching(self._found(digests, tkey), sent)):
            prompt.false_fork = True
            prompt.kind = "miss"
        return prompt

    def _found(self, digests: list[bytes], tkey: str) -> Iterator[_Anchor]:
        """Anchors whose visible meaning and tools are a prefix of the messages ``digests``
        describe: longest first, then earliest. Lazily, by digest: a hit needs only the first
        few, never a scan of every anchor of the rollout."""
        for n in range(len(digests) - 1, -1, -1):
            same = self._by_digest.get(digests[n])
            if same:
                yield from sorted(
                    (a for a in same if a.n_msgs == n and a.tools_key == tkey), key=_anchor_order
                )

    @staticmethod
    def _false_fork(prompt: TitoPrompt, matching: Iterator[_Anchor]) -> bool:
        """Whether ``prompt`` fails to extend the input+output of every call whose request and
        reply its messages reuse most deeply (those calls' ``reply`` anchors)."""
        deepest: list[_Anchor] = []
        for a in matching:
            if deepest and a.n_msgs < deepest[0].n_msgs:
                break
            if a.kind != "reply":
                continue
            if prompt.anchor_seq == a.seq and prompt.anchor_kind == "reply":
                return False  # built as a.ids + closing + new part: extends it by construction
            deepest.append(a)
        ids = prompt.ids
        for a in deepest:
            n = len(a.ids)
            if len(ids) >= n and np.array_equal(ids[:n], a.ids):
                return False
        return bool(deepest)

    def _extend(
        self,
        a: _Anchor,
        msgs: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        full: str | None,
        max_ids: int = 0,
    ) -> TitoPrompt | None:
        """``a.ids + encode(closing + new part)``, or None when the new part cannot be found."""
        suffix = self.r.new_part(msgs, a.n_msgs, tools, reply=a.kind == "reply", full=full)
        if suffix is None:
            return None
        new = self._encode(a.closing + suffix, len(a.ids), max_ids)
        ids = np.concatenate([a.ids, _array(new)])
        rerendered = any(m.get("role") == "assistant" for m in msgs[a.n_msgs :])
        kind: TitoKind = "miss" if rerendered else "hit"
        return TitoPrompt(ids, kind, msgs, tools, a.seq, a.kind, len(a.ids))

    def _encode(self, text: str, before: int, max_ids: int) -> list[int]:
        """``encode(text)``, to follow ``before`` ids; `PromptTooLong` when that makes
        ``max_ids`` or more for certain (``max_ids`` 0: unchecked)."""
        if max_ids and (n := before + self.r.at_least(text)) >= max_ids:
            raise PromptTooLong(n, max_ids)
        return self.r.encode(text)

    def commit(
        self,
        seq: int,
        prompt: TitoPrompt,
        output_ids: Sequence[int] | None = None,
        reply: dict[str, Any] | None = None,
    ) -> None:
        """Remember a call that succeeded, and count it: its request (always) and its reply
        (when it had one). Never called for a failed call.

        ``reply`` is the parsed assistant message in the normalised format (what the harness
        was sent); ``output_ids`` the ids the engine sampled for it, all of which are kept.
        """
        kind: TitoKind = prompt.kind
        track = prompt.track
        if kind == "first" and self.calls.get(track):  # an overlapping call succeeded first
            kind = "miss"
        self.calls[track] = self.calls.get(track, 0) + 1
        self.counts[kind] += 1
        M_TITO.labels(result=kind).inc()
        if prompt.false_fork:
            self.false_forks += 1
            M_FALSE_FORKS.inc()
        msgs = prompt.messages
        reasoning = {i: _reasoning(m) for i, m in enumerate(msgs) if m.get("role") == "assistant"}
        n, gen = len(msgs), self.r.gen_ids
        out = list(output_ids or [])
        ids = np.concatenate([prompt.ids, _array(out)])
        n_in = len(prompt.ids)
        seen = _Seen(msgs, prompt.digests)
        if gen and prompt.ids[n_in - len(gen) :].tolist() == gen:
            self._add(
                _Anchor(
                    seq,
                    n,
                    prompt.digests[n],
                    prompt.tools_key,
                    reasoning,
                    ids[: n_in - len(gen)],
                    "",
                    "request",
                )
            )
        if reply is None or not out:
            self._seen[track] = seen
            return
        seen.messages = [*msgs, reply]
        seen.digests = [*prompt.digests, _chain(prompt.digests[n], reply)]
        self._seen[track] = seen
        self._add(
            _Anchor(
                seq,
                n + 1,
                seen.digests[-1],
                prompt.tools_key,
                {**reasoning, n: _reasoning(reply)},
                ids,
                self.r.closing(out),
                "reply",
            )
        )

    def _add(self, anchor: _Anchor) -> None:
        self.anchors.append(anchor)
        self._by_digest.setdefault(anchor.digest, []).append(anchor)


def _anchor_order(a: _Anchor) -> tuple[int, bool]:
    """Among anchors of the same length: the earliest call first, its reply before its request."""
    return a.seq, a.kind != "reply"


def _matching(found: Iterator[_Anchor], sent: list[tuple[int, str]]) -> Iterator[_Anchor]:
    """The anchors of ``found`` that are a prefix by meaning, reasoning included (in order);
    ``sent``: the reasoning the messages send, by index."""
    for a in found:
        if all(a.reasoning.get(i) == r for i, r in sent if i < a.n_msgs):
            yield a


def _without_reasoning(m: dict[str, Any]) -> dict[str, Any]:
    if "reasoning_content" not in m:
        return m
    m = dict(m)
    del m["reasoning_content"]
    return m


class Tito:
    """TITO sessions of many rollouts sharing one renderer."""

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.sessions: dict[str, TitoSession] = {}

    def session(self, rollout_id: str) -> TitoSession:
        s = self.sessions.get(rollout_id)
        if s is None:
            s = self.sessions[rollout_id] = TitoSession(self.renderer)
        return s

    def drop(self, rollout_id: str) -> None:
        self.sessions.pop(rollout_id, None)

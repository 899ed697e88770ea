"""The request schemas of the three model APIs, checked before a request is converted.

``check(api, body)`` validates a decoded JSON body against that API's own request schema
(OpenAI chat completions, Anthropic messages, OpenAI responses, as their references document
them) and raises `SchemaError`, which names the field (``messages[0].role``) and says what
was expected; the server answers it with a 400 in the API's own error shape. Only the fields
the schema knows are checked:

* **Unknown fields are ignored**, at the top level and inside objects, never refused: harnesses
  send fields newer than any schema here (Claude Code's ``context_management``, Codex's
  ``client_metadata``). ``check`` returns the unknown *top-level* names so the server can
  count them.
* **Closed sets are closed**: roles, content-block and item types, ``tool_choice`` forms and
  ``thinking`` modes outside the documented ones are refused, as the real APIs refuse them;
  the error lists the supported values.
* Types are exact (``stream: "yes"`` is not a boolean; ``content: 5`` is neither text nor
  blocks), as the real APIs check them. Values the proxy itself judges (``max_tokens >= 1``,
  ``n == 1``, non-empty ``messages``) are left to the converters.

The schemas are msgspec structs; validation is one ``msgspec.convert`` per request (tens of
microseconds for a long agent conversation: free-form fields such as tool schemas and
tool-call inputs are typed ``dict`` and not walked).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import Struct, defstruct
from msgspec import inspect as mi

__all__ = ["APIS", "SchemaError", "anthropic_path", "check", "openai_param"]

Obj = dict[str, Any]
"""A free-form JSON object (not walked)."""

# ---------------------------------------------------------------------------------------------
# OpenAI chat completions
# ---------------------------------------------------------------------------------------------


def _tagged(tag_field: str, name: str, tag: str, fields: Iterable[tuple[str, Any]] = ()) -> type:
    """A struct for one member of a tagged union whose other fields are optional and loose."""
    return defstruct(name, [(f, t, None) for f, t in fields], tag_field=tag_field, tag=tag)


class _Text(Struct, tag_field="type", tag="text"):
    text: str


class _ImageUrl(Struct, tag_field="type", tag="image_url"):
    image_url: Obj | str


_InputAudio = _tagged("type", "_InputAudio", "input_audio", [("input_audio", Obj)])
_File = _tagged("type", "_File", "file", [("file", Obj)])


class _Refusal(Struct, tag_field="type", tag="refusal"):
    refusal: str


class _Function(Struct):
    name: str
    arguments: str | Obj | None = None


class _FunctionCall(Struct, tag_field="type", tag="function"):
    function: _Function
    id: str | None = None


_CustomCall = _tagged("type", "_CustomCall", "custom", [("id", str), ("custom", Obj)])


class _System(Struct, tag_field="role", tag="system"):
    content: str | list[_Text]
    name: str | None = None


class _Developer(Struct, tag_field="role", tag="developer"):
    content: str | list[_Text]
    name: str | None = None


class _User(Struct, tag_field="role", tag="user"):
    content: str | list[_Text | _ImageUrl | _InputAudio | _File]
    name: str | None = None


class _Assistant(Struct, tag_field="role", tag="assistant"):
    content: str | list[_Text | _Refusal] | None = None
    tool_calls: list[_FunctionCall | _CustomCall] | None = None
    reasoning_content: str | None = None
    """Not OpenAI's: the reasoning that OpenAI-compatible servers (SGLang, vLLM) return and
    harnesses send back."""
    name: str | None = None
    refusal: str | None = None


class _Tool(Struct, tag_field="role", tag="tool"):
    content: str | list[_Text]
    tool_call_id: str


class _FunctionMessage(Struct, tag_field="role", tag="function"):
    name: str
    content: str | None = None


class _FunctionDef(Struct):
    name: str
    description: str | None = None
    parameters: Obj | None = None
    strict: bool | None = None


class _FunctionTool(Struct, tag_field="type", tag="function"):
    function: _FunctionDef


_CustomTool = _tagged("type", "_CustomTool", "custom", [("custom", Obj)])


class _Named(Struct):
    name: str


class _ChoiceFunction(Struct, tag_field="type", tag="function"):
    function: _Named


class _ChoiceCustom(Struct, tag_field="type", tag="custom"):
    custom: _Named


class _ChoiceAllowed(Struct, tag_field="type", tag="allowed_tools"):
    allowed_tools: Obj


class _StreamOptions(Struct):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class _ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Obj | None = None


class ChatRequest(Struct):
    """``POST /v1/chat/completions``."""

    messages: list[_System | _Developer | _User | _Assistant | _Tool | _FunctionMessage]
    model: str | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    tools: list[_FunctionTool | _CustomTool] | None = None
    tool_choice: (
        Literal["none", "auto", "required"]
        | _ChoiceFunction
        | _ChoiceCustom
        | _ChoiceAllowed
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: _ResponseFormat | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: Obj | None = None
    prediction: Obj | None = None
    web_search_options: Obj | None = None
    functions: list[Obj] | None = None
    function_call: str | Obj | None = None


# ---------------------------------------------------------------------------------------------
# Anthropic messages
# ---------------------------------------------------------------------------------------------


class _AText(Struct, tag_field="type", tag="text"):
    text: str
    citations: list[Obj] | None = None


_AImage = _tagged("type", "_AImage", "image", [("source", Obj)])
_ADocument = _tagged("type", "_ADocument", "document", [("source", Obj)])
_ASearchResult = _tagged("type", "_ASearchResult", "search_result")
_AToolReference = _tagged("type", "_AToolReference", "tool_reference")


class _AThinking(Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class _ARedacted(Struct, tag_field="type", tag="redacted_thinking"):
    data: str


class _AToolUse(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Obj


class _AToolResult(Struct, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[_AText | _AImage | _ADocument | _ASearchResult | _AToolReference] | None = (
        None
    )
    is_error: bool | None = None


_SERVER_BLOCKS = (
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
)
"""Blocks of Anthropic's server-side tools: accepted in a history, carry nothing for us."""
_AServer = tuple(_tagged("type", f"_A_{t}", t) for t in _SERVER_BLOCKS)

_ABlock: Any = (
    _AText | _AImage | _ADocument | _ASearchResult | _AThinking | _ARedacted | _AToolUse
    | _AToolResult
)  # fmt: skip
for _t in _AServer:
    _ABlock = _ABlock | _t


class _AMessage(Struct):
    role: Literal["user", "assistant", "system"]
    """``system`` is not Anthropic's (which takes it at the top level); some harnesses send it
    in the list, and it is read as a system message."""
    content: str | list[_ABlock]


class _ATool(Struct):
    name: str
    type: str | None = None
    """None or ``custom``: a client tool; anything else names a server tool (left out)."""
    description: str | None = None
    input_schema: Obj | None = None
    defer_loading: bool | None = None


class _AChoiceAuto(Struct, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool | None = None


class _AChoiceAny(Struct, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool | None = None


class _AChoiceTool(Struct, tag_field="type", tag="tool"):
    name: str
    disable_parallel_tool_use: bool | None = None


class _AChoiceNone(Struct, tag_field="type", tag="none"):
    pass


class _AEnabled(Struct, tag_field="type", tag="enabled"):
    budget_tokens: int


class _ADisabled(Struct, tag_field="type", tag="disabled"):
    pass


class _AAdaptive(Struct, tag_field="type", tag="adaptive"):
    display: str | None = None


class _AMetadata(Struct):
    user_id: str | None = None


class MessagesRequest(Struct):
    """``POST /v1/messages``."""

    messages: list[_AMessage]
    max_tokens: int
    model: str | None = None
    system: str | list[_AText] | None = None
    stream: bool | None = None
    tools: list[_ATool] | None = None
    tool_choice: _AChoiceAuto | _AChoiceAny | _AChoiceTool | _AChoiceNone | None = None
    thinking: _AEnabled | _ADisabled | _AAdaptive | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: _AMetadata | None = None
    service_tier: str | None = None
    container: str | Obj | None = None
    mcp_servers: list[Obj] | None = None
    context_management: Obj | None = None
    output_config: Obj | None = None
    output_format: Obj | None = None


# ---------------------------------------------------------------------------------------------
# OpenAI responses
# ---------------------------------------------------------------------------------------------


class _RInputText(Struct, tag_field="type", tag="input_text"):
    text: str


class _ROutputText(Struct, tag_field="type", tag="output_text"):
    text: str


class _RTextPart(Struct, tag_field="type", tag="text"):
    """Not in OpenAI's schema; read as ``input_text``, as the conversion always did."""

    text: str


_RImage = _tagged("type", "_RImage", "input_image")
_RFile = _tagged("type", "_RFile", "input_file")
_RAudio = _tagged("type", "_RAudio", "input_audio")


class _RRefusal(Struct, tag_field="type", tag="refusal"):
    refusal: str


_RPart = _RInputText | _ROutputText | _RTextPart | _RImage | _RFile | _RAudio | _RRefusal


class _RMessage(Struct, tag_field="type", tag="message"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_RPart]


class _RSummary(Struct):
    text: str
    type: str | None = None


class _RReasoning(Struct, tag_field="type", tag="reasoning"):
    summary: list[_RSummary] | None = None
    encrypted_content: str | None = None
    content: list[Obj] | None = None


class _RFunctionCall(Struct, tag_field="type", tag="function_call"):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class _RFunctionOutput(Struct, tag_field="type", tag="function_call_output"):
    call_id: str
    output: str | list[_RPart]


_R_OTHER_ITEMS = (
    "custom_tool_call",
    "custom_tool_call_output",
    "web_search_call",
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "item_reference",
    "compaction",
)
"""Input items a text model cannot see (hosted tools' calls and the like): accepted, skipped."""
_ROther = tuple(_tagged("type", f"_R_{t}", t) for t in _R_OTHER_ITEMS)
_RItem: Any = _RMessage | _RReasoning | _RFunctionCall | _RFunctionOutput
for _t in _ROther:
    _RItem = _RItem | _t


class _RFunctionDef(Struct):
    name: str
    description: str | None = None
    parameters: Obj | None = None
    strict: bool | None = None


class _RFunctionTool(_RFunctionDef, tag_field="type", tag="function"):
    pass


class _RNamespaceTool(Struct, tag_field="type", tag="namespace"):
    """Codex's group of function tools (``<namespace>.<name>``)."""

    name: str
    tools: list[_RFunctionDef]


_R_HOSTED_TOOLS = (
    "custom",
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer_use_preview",
    "mcp",
    "code_interpreter",
    "image_generation",
    "local_shell",
    "shell",
    "apply_patch",
)
"""Tools the proxy leaves out of the prompt (the model cannot call them here)."""
_RHosted = tuple(_tagged("type", f"_RT_{t}", t) for t in _R_HOSTED_TOOLS)
_RToolT: Any = _RFunctionTool | _RNamespaceTool
for _t in _RHosted:
    _RToolT = _RToolT | _t


class _RChoiceFunction(Struct, tag_field="type", tag="function"):
    name: str


_RChoiceAllowed = _tagged("type", "_RChoiceAllowed", "allowed_tools", [("tools", list[Obj])])
_RChoiceOther = tuple(_tagged("type", f"_RC_{t}", t) for t in _R_HOSTED_TOOLS)
_RChoice: Any = Literal["none", "auto", "required"] | _RChoiceFunction | _RChoiceAllowed
for _t in _RChoiceOther:
    _RChoice = _RChoice | _t


class _RReasoningOptions(Struct):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Struct):
    """``POST /v1/responses``."""

    input: str | list[_RItem]
    model: str | None = None
    instructions: str | None = None
    stream: bool | None = None
    store: bool | None = None
    tools: list[_RToolT] | None = None
    tool_choice: _RChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: _RReasoningOptions | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    conversation: str | Obj | None = None
    prompt: Obj | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    text: Obj | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    background: bool | None = None
    stream_options: Obj | None = None


# ---------------------------------------------------------------------------------------------
# checking
# ---------------------------------------------------------------------------------------------

APIS: dict[str, type[Struct]] = {
    "chat": ChatRequest,
    "messages": MessagesRequest,
    "responses": ResponsesRequest,
}
"""The request schema of each API, by the name ``CallRequest.api`` uses."""

_KNOWN = {api: frozenset(f.encode_name for f in mi.type_info(s).fields) for api, s in APIS.items()}


@dataclass
class SchemaError(Exception):
    """A request that does not match its API's schema."""

    path: tuple[str | int, ...]
    """Where: field names and list indices from the body's root."""
    kind: Literal["type", "value", "missing"]
    """A value of the wrong type, a value outside a closed set, or a missing field."""
    expected: tuple[str, ...]
    """The types (``string``, ``array``…) or, for ``value``, the supported values."""
    got: str = ""
    """The type of the value sent (``type``) or the value itself (``value``)."""

    def __str__(self) -> str:
        return self.openai_message()

    @property
    def code(self) -> str:
        """OpenAI's error ``code`` for it."""
        return {"type": "invalid_type", "value": "invalid_value"}.get(
            self.kind, "missing_required_parameter"
        )

    def openai_message(self) -> str:
        """As OpenAI words it: ``Invalid type for 'stream': expected a boolean, but got a
        string instead.``"""
        param = openai_param(self.path) or "body"
        if self.kind == "missing":
            return f"Missing required parameter: '{param}'."
        if self.kind == "type":
            return (
                f"Invalid type for '{param}': expected {_one_of(self.expected)}, but got "
                f"{_a(self.got)} instead."
            )
        if not self.expected:
            return f"Invalid value for '{param}': {self.got}."
        values = ", ".join(f"'{v}'" for v in self.expected)
        return f"Invalid value for '{param}': {self.got}. Supported values are: {values}."

    def anthropic_message(self) -> str:
        """As Anthropic words it: ``stream: Input should be a valid boolean``."""
        where = anthropic_path(self.path) or "body"
        if self.kind == "missing":
            return f"{where}: Field required"
        if self.kind == "type":
            return f"{where}: Input should be {_one_of(self.expected)} (got {_a(self.got)})"
        if not self.expected:
            return f"{where}: {self.got}"
        values = ", ".join(f"'{v}'" for v in self.expected)
        return f"{where}: Input {self.got} should be one of {values}"


def _a(kind: str) -> str:
    return ("an " if kind[:1] in "aeiou" else "a ") + kind


def _one_of(kinds: tuple[str, ...]) -> str:
    kinds = tuple(k for k in kinds if k != "null") or kinds
    if len(kinds) == 1:
        return _a(kinds[0])
    return "one of " + " or ".join(_a(k) for k in kinds)


def check(api: str, body: Any) -> list[str]:
    """Validate ``body`` against ``api``'s schema (raise `SchemaError`); the unknown top-level
    field names, which are ignored."""
    schema = APIS[api]
    if api == "responses" and isinstance(body, dict):
        body = _typed_items(body)
    try:
        msgspec.convert(body, schema)
    except msgspec.ValidationError as e:
        raise _error(schema, str(e)) from None
    return [k for k in body if k not in _KNOWN[api]]


def _typed_items(body: dict[str, Any]) -> dict[str, Any]:
    """Responses input items may leave out ``type: message`` when they have a role."""
    items = body.get("input")
    if not isinstance(items, list) or all(
        not isinstance(it, dict) or "type" in it or "role" not in it for it in items
    ):
        return body
    typed = [
        {**it, "type": "message"} if isinstance(it, dict) and "type" not in it and "role" in it
        else it
        for it in items
    ]  # fmt: skip
    return {**body, "input": typed}


def openai_param(path: tuple[str | int, ...]) -> str:
    """``messages[0].content``: a path as OpenAI's ``param`` names it."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def anthropic_path(path: tuple[str | int, ...]) -> str:
    """``messages.0.content``: a path as Anthropic's errors name it."""
    return ".".join(str(p) for p in path)


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_TYPE_NAMES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "null": "null",
    "array": "array",
    "object": "object",
}


def _error(schema: type, message: str) -> SchemaError:
    m = _AT.match(message)
    what, raw = (m["what"], m["path"] or "") if m else (message, "")
    path: tuple[str | int, ...] = tuple(s[0] if s[0] else int(s[1]) for s in _SEGMENT.findall(raw))
    if mm := re.match(r"Object missing required field `(.+)`", what):
        return SchemaError((*path, mm[1]), "missing", ())
    if mm := re.match(r"Expected `(.+?)`, got `(.+?)`", what):
        expected = tuple(
            _TYPE_NAMES.get(t.strip(), t.strip()) for t in mm[1].split("|") if "`" not in t
        )
        expected = tuple(dict.fromkeys(t.split(" ")[0] for t in expected))
        return SchemaError(path, "type", expected, _TYPE_NAMES.get(mm[2], mm[2]))
    if mm := re.match(r"Invalid (?:enum )?value (.+)", what):
        return SchemaError(path, "value", tuple(_allowed(schema, path)), mm[1])
    return SchemaError(path, "value", (), what)


def _allowed(schema: type, path: tuple[str | int, ...]) -> list[str]:
    """The values the schema allows at ``path`` (a literal or a union's tag), sorted."""
    infos: list[Any] = [mi.type_info(schema)]
    for i, seg in enumerate(path):
        last = i == len(path) - 1
        nxt: list[Any] = []
        for info in _members(infos):
            if isinstance(seg, int) and isinstance(info, mi.ListType):
                nxt.append(info.item_type)
            elif isinstance(info, mi.StructType) and isinstance(seg, str):
                if last and info.tag_field == seg:
                    nxt.append(mi.LiteralType((info.tag,)))
                nxt += [f.type for f in info.fields if f.encode_name == seg]
        infos = nxt
    values = {
        str(v) for info in _members(infos) if isinstance(info, mi.LiteralType) for v in info.values
    }
    return sorted(values)


def _members(infos: list[Any]) -> list[Any]:
    out = []
    for info in infos:
        out += list(info.types) if isinstance(info, mi.UnionType) else [info]
    return out

"""The tiny models' chat template, and rendering any chat template without transformers.

Owns ``CHAT_TEMPLATE`` (also written into every tiny tokenizer folder and part of the tiny
recipe, so of the cache keys) and ``render_chat``, which must render exactly as
``transformers`` ``apply_chat_template(tokenize=False)`` does (same Jinja sandbox, same
``tojson``). jinja2 is imported only on first render.

Chat template format (exact)
----------------------------
ChatML / Qwen3 style. Every turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.

* System turn: the first message if its role is ``system``. With ``tools``, the system turn is::

      <|im_start|>system\\n{system content}\\n\\n# Tools\\n\\nYou may call one or more functions to
      assist with the user query.\\n\\nYou are provided with function signatures within
      <tools></tools> XML tags:\\n<tools>\\n{tool 1 json}\\n{tool 2 json}\\n</tools>\\n\\nFor each
      function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments":
      <args-json-object>}\\n</tool_call><|im_end|>\\n

  (without a system message the ``{system content}\\n\\n`` part is absent). Tools are rendered
  as given (``json.dumps(tool, ensure_ascii=False)``); pass them in OpenAI form
  ``{"type": "function", "function": {...}}``.
* ``content`` may be a string, ``None``, or a list of parts; parts of type ``text`` (or bare
  strings) are concatenated with nothing between them, other parts are dropped.
* Assistant turn::

      <|im_start|>assistant\\n[<think>\\n{reasoning}\\n</think>\\n\\n]{content}[\\n]<tool_call>\\n
      {"name": "{name}", "arguments": {arguments}}\\n</tool_call>[\\n<tool_call>...]<|im_end|>\\n

  The think block appears iff the message has ``reasoning_content`` (or ``reasoning`` /
  ``thinking``) that is a string, even an empty one (``None`` or absent: no block). Reasoning
  and content are NOT stripped. The ``\\n`` before the first ``<tool_call>`` is written only
  when content is non-empty; consecutive tool calls are joined by ``\\n``. ``arguments`` that is a
  string is inserted verbatim, a dict is ``json.dumps(args, ensure_ascii=False)`` (``", "`` and
  ``": "`` separators, key order kept); ``name`` is JSON-quoted. A ``{"function": {...}}``
  wrapper (OpenAI form) is unwrapped.
* DEVIATION FROM QWEN3: the reasoning of EVERY assistant turn is rendered (Qwen3 drops it
  before the last user query), so that re-rendering a history reproduces what was sampled.
* Tool results: consecutive ``tool`` messages form ONE user turn::

      <|im_start|>user\\n<tool_response>\\n{result 1}\\n</tool_response>\\n<tool_response>\\n
      {result 2}\\n</tool_response><|im_end|>\\n

  (so a history ending in a tool message is NOT a prefix of the same history plus another tool
  message; it is for histories ending with an assistant turn).
* Any other role (``user``, a later ``system``, ...) renders as a plain turn.
* ``add_generation_prompt=True`` appends ``<|im_start|>assistant\\n`` (and, with
  ``enable_thinking=False``, an empty ``<think>\\n\\n</think>\\n\\n``).

Parsing model output (the proxy): the completion after the generation prompt is
``[<think>\\n{reasoning}\\n</think>\\n\\n]{content}[\\n<tool_call>\\n{json}\\n</tool_call>...]``
followed by the stop token ``<|im_end|>``; the template writes ``\\n`` after ``<|im_end|>``
which the engine does not generate. Invariant, tested here: for output in that canonical form,
``render(msgs, add_generation_prompt=True) + output + "<|im_end|>\\n" ==
render(msgs + [parsed assistant message])`` when the parsed message keeps ``content`` without
the single ``\\n`` before the first ``<tool_call>``, the reasoning unstripped, and the arguments
as the raw JSON text. Output not in canonical form cannot be reproduced by rendering (TITO uses
the sampled ids instead).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- text_of(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text_of(message.content) %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif message.reasoning is string %}
            {%- set reasoning = message.reasoning %}
        {%- elif message.thinking is string %}
            {%- set reasoning = message.thinking %}
        {%- else %}
            {%- set reasoning = none %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if reasoning is not none %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": ' + (tool_call.name | tojson) + ', "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- elif tool_call.arguments is defined and tool_call.arguments is not none %}
                    {{- tool_call.arguments | tojson }}
                {%- else %}
                    {{- '{}' }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

_TEMPLATE_CACHE: dict[str, Any] = {}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _compile_template(template: str) -> Any:
    compiled = _TEMPLATE_CACHE.get(template)
    if compiled is not None:
        return compiled
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(template)
    _TEMPLATE_CACHE[template] = compiled
    return compiled


def render_chat(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template: str | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with a chat template (default: :data:`CHAT_TEMPLATE`) exactly like
    ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...)`` in
    transformers, but without importing it (same Jinja environment and ``tojson``)."""
    chat = []
    for message in messages:
        m = dict(message)
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    return _compile_template(template or CHAT_TEMPLATE).render(
        messages=chat,
        tools=list(tools) if tools is not None else None,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )

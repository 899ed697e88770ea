"""Model and tokenizer factory.

Loads any Hugging Face causal LM and tokenizer from a local folder, and builds, offline and
deterministically, the project's tiny default models (``tiny-1m``, ``tiny-8m``, ``tiny-30m``):
a byte-level BPE tokenizer (8192 ids) trained on a corpus generated here, plus a randomly
initialised Qwen3 model. Nothing is downloaded; importing this module does not import torch.

Public API
----------
* ``resolve_model(spec, cache_dir=None) -> Path``: a local folder, or ``tiny`` (= ``tiny-8m``),
  ``tiny-1m``, ``tiny-8m``, ``tiny-30m``, each optionally ``@seedN``. Tiny models are built on
  first use into ``<cache>/models/tiny-8m-s0-<hash>`` (cache = ``cache_dir``, else
  ``$HARNESSRL_CACHE``, else ``~/.cache/harnessrl``), atomically (temp dir + rename).
* ``load_tokenizer(path)``, ``load_model(path, dtype="float32", device="cpu")``.
* ``model_info(path) -> dict`` (reads config/safetensors headers only, no weights).
* ``eos_token_ids(tokenizer)``, ``special_token_ids(tokenizer)``.
* ``render_chat(messages, tools=None, add_generation_prompt=False, ...)``: renders a chat
  template exactly as ``transformers`` ``apply_chat_template(tokenize=False)`` does, without
  importing torch or transformers.
* ``CHAT_TEMPLATE``: the tiny models' template (also usable with any ChatML-style vocabulary).

Special tokens of the tiny tokenizer
------------------------------------
``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos) are special
(dropped by ``skip_special_tokens``). ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
``</tool_response>``, ``<think>``, ``</think>`` (ids 8186..8191) are added tokens that are NOT
special: each is always one id, and they survive ``skip_special_tokens=True``. The tokenizer adds
no BOS/EOS when encoding. The engine should stop on ``eos_token_ids(tok)`` =
``[<|im_end|>, <|endoftext|>]``.

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

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_SIZES",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "default_cache_dir",
    "eos_token_ids",
    "load_model",
    "load_tokenizer",
    "model_info",
    "parse_tiny_spec",
    "render_chat",
    "resolve_model",
    "special_token_ids",
]

# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
VOCAB_SIZE = 8192
MAX_POSITION_EMBEDDINGS = 32768

# Bump when the corpus generator, the tokenizer pipeline or the model builder changes in a way
# the hashed recipe below does not capture; it invalidates every cached tiny model.
RECIPE_VERSION = 1

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

# Tiny model shapes. Parameter counts (tied embeddings, vocab 8192) are checked by the tests.
TINY_SIZES: dict[str, dict[str, int]] = {
    "tiny-1m": dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "tiny-8m": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "tiny-30m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
TINY_ALIASES = {"tiny": "tiny-8m"}
ROPE_THETA = 1_000_000.0

_TINY_RE = re.compile(r"^(tiny(?:-(?:1m|8m|30m))?)(?:@seed(\d+))?$")

# --------------------------------------------------------------------------------------------
# Corpus for the tiny tokenizer (generated, deterministic, ~2 MB)
# --------------------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return text.split()


_FUNCTION_WORDS = _words("""the a an this that these those some any each every no all both either
neither one two three few many much more most other another such what which who whom whose
where when why how and or but so yet for nor if then else than because although though while
unless until since after before once as to of in on at by with from into onto over under about
above below between through during without within along across behind beyond near around up
down out off again further here there now just also only very too quite rather almost already
still even ever never always often sometimes usually not I you he she it we they me him her us
them my your his its our their mine yours ours theirs myself yourself itself ourselves
themselves is are was were be been being am have has had having do does did doing will would
shall should can could may might must let lets it's don't doesn't didn't isn't aren't wasn't
can't won't I'm you're we're they're that's there's here's let's I've we've you'll we'll""")

_NOUNS = _words("""time year people way day man woman child world life hand part place case week
company system program question work government number night point home water room mother
area money story fact month lot right study book eye job word business issue side kind head
house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment air
teacher force education foot boy age policy process music market sense nation plan college
interest death experience effect use class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view
relationship town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site
project activity star table need court oil situation cost industry figure street image phone
data picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population site file folder directory path error bug fix feature request response
server client user password token key value list array string number object function method
class module package library framework version release branch commit merge build deploy test
suite case assertion output input stream buffer queue cache memory disk network socket port
address host container image volume job task worker thread process signal message event log
metric trace span database table column row index query schema record field type struct
interface protocol handler callback promise future result option config setting parameter
argument flag variable constant expression statement loop condition exception stack frame
heap pointer reference byte bit character line word page chapter section paragraph document
note comment issue ticket review change patch diff status state step stage pipeline model
tokenizer dataset batch epoch gradient loss reward policy agent environment tool call harness
sandbox proxy engine learner rollout sample trajectory episode prompt completion context
window weight checkpoint""")

_VERBS = _words("""be have do say go get make know think take see come want look use find give tell
work call try ask need feel become leave put mean keep let begin seem help talk turn start show
hear play run move like live believe hold bring happen write provide sit stand lose pay meet
include continue set learn change lead understand watch follow stop create speak read allow
add spend grow open walk win offer remember love consider appear buy wait serve die send
expect build stay fall cut reach kill remain suggest raise pass sell require report decide
pull return explain hope develop carry break receive agree support hit produce eat cover catch
draw choose install update upgrade configure compile parse load save store fetch push pull
merge rebase deploy restart stop kill check verify validate test debug trace log print format
render encode decode serialize convert compute measure count sort filter map reduce split join
replace remove delete insert append extend clear reset flush sync wrap handle raise throw retry
schedule launch spawn connect listen bind accept close read write open seek copy move rename
create edit patch apply revert commit clone search match resolve import export define declare
assign return yield await generate sample train evaluate""")

_ADJECTIVES = _words("""good new first last long great little own other old right big high different
small large next early young important few public bad same able local sure free better true
whole real best full special easy clear recent certain personal open red difficult available
likely short single medical current wrong private past foreign fine common poor natural
significant similar hot dead central happy serious ready simple left physical general
environmental financial blue democratic dark various entire close legal religious cold final
main green nice huge popular traditional cultural empty invalid valid missing default optional
required internal external remote unknown fast slow safe unsafe stable broken temporary
permanent global static dynamic async synchronous parallel sequential random deterministic
binary numeric empty nested raw clean dirty active idle pending running failed successful
complete partial tiny quick lazy bright quiet careful strange useful""")

_ADVERBS = _words("""quickly slowly carefully really probably actually finally simply exactly
directly clearly easily recently currently usually generally certainly suddenly immediately
quietly correctly properly automatically manually eventually fortunately unfortunately
together instead otherwise therefore however meanwhile""")

_NAMES = _words("""Alice Bob Carol David Emma Frank Grace Henry Isabel Jack Karen Liam Maria Noah
Olivia Paul Quinn Rachel Sam Tina Uma Victor Wendy Xavier Yara Zoe Smith Johnson Williams Brown
Jones Garcia Miller Davis Martinez Lee Chen Wang Kim Patel London Paris Berlin Tokyo Boston
Seattle Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April
June July August September October November December Python Linux GitHub JSON HTTP API URL CPU
GPU Docker Kubernetes Ubuntu""")

_EXTS = _words("py js ts json md txt csv yaml yml toml sh cfg ini log rs go c h cpp html css sql")
_DIRS = _words("""src lib tests test docs bin scripts config data tmp build dist app core utils common
api models services cmd internal pkg examples assets static templates home user var etc usr
local share opt work repo project""")
_SHELL_CMDS = [
    "ls -la {d}",
    "cd {d}",
    "cat {f}",
    "head -n {n} {f}",
    "tail -f {f}",
    'grep -rn "{w}" {d}',
    'find {d} -name "*.{e}"',
    "mkdir -p {d}",
    "rm -rf {d}",
    "cp {f} {f2}",
    "mv {f} {f2}",
    "python {f} --{w} {n}",
    "python -m pytest {d} -q",
    "pip install {w}",
    "git status",
    "git diff {f}",
    'git add {f} && git commit -m "{s}"',
    "git log --oneline -n {n}",
    "git checkout -b {w}-{w2}",
    'echo "{s}" > {f}',
    "wc -l {f}",
    "sed -i 's/{w}/{w2}/g' {f}",
    "curl -s http://localhost:{p}/{w}",
    "docker run --rm -it {w}:{n}",
    "make {w}",
    "npm install {w}",
    "chmod +x {f}",
    "export {W}={n}",
    "tar -xzf {w}.tar.gz",
    "ps aux | grep {w}",
    "du -sh {d}",
]
_KEYS = _words("""id name type value status message error code data result items count total
path file content text title description created_at updated_at user_id email version
enabled timeout retries limit offset page size tags labels metadata config options url
method headers body query role model temperature max_tokens tool arguments command input
output stdout stderr exit_code duration score reward""")


def _corpus_documents(total_chars: int = 2_000_000, seed: int = 20240601) -> Iterator[str]:
    """Yield a deterministic, varied text corpus: prose, JSON, code, shell, CSV, markdown."""
    rng = random.Random(seed)
    ch = rng.choice
    nouns, verbs, adjs, advs, fw = _NOUNS, _VERBS, _ADJECTIVES, _ADVERBS, _FUNCTION_WORDS
    all_words = nouns + verbs + adjs + advs + fw

    def word() -> str:
        return ch(all_words)

    def ident() -> str:
        return "_".join(ch(nouns + verbs + adjs).lower() for _ in range(rng.randint(1, 3)))

    def camel() -> str:
        return "".join(ch(nouns + adjs).capitalize() for _ in range(rng.randint(1, 3)))

    def inflect(v: str) -> str:
        r = rng.random()
        if r < 0.35:
            return v
        if r < 0.55:
            return v + ("es" if v.endswith(("s", "sh", "ch", "x")) else "s")
        if r < 0.8:
            return (v[:-1] if v.endswith("e") else v) + "ed"
        return (v[:-1] if v.endswith("e") and len(v) > 2 else v) + "ing"

    def plural(n: str) -> str:
        if rng.random() < 0.7:
            return n
        if n.endswith(("s", "sh", "ch", "x")):
            return n + "es"
        if n.endswith("y") and n[-2:-1] not in "aeiou":
            return n[:-1] + "ies"
        return n + "s"

    def noun_phrase() -> str:
        parts = [
            ch(
                [
                    "the",
                    "a",
                    "this",
                    "that",
                    "my",
                    "your",
                    "our",
                    "their",
                    "each",
                    "every",
                    "some",
                    "no",
                    "the",
                    "the",
                ]
            )
        ]
        if rng.random() < 0.5:
            parts.append(ch(adjs))
        parts.append(plural(ch(nouns)))
        if rng.random() < 0.2:
            parts += [
                ch(["of", "in", "on", "with", "for", "from"]),
                ch(["the", "a", "our"]),
                ch(nouns),
            ]
        return " ".join(parts)

    def sentence() -> str:
        r = rng.random()
        subj = ch(
            [
                noun_phrase(),
                noun_phrase(),
                ch(_NAMES[:26]),
                ch(["I", "you", "we", "they", "he", "she", "it"]),
            ]
        )
        parts = [subj]
        if rng.random() < 0.2:
            parts.append(ch(advs))
        if rng.random() < 0.25:
            parts.append(
                ch(
                    [
                        "will",
                        "can",
                        "should",
                        "must",
                        "might",
                        "would",
                        "could",
                        "did not",
                        "does not",
                        "will not",
                        "has",
                        "had",
                        "is",
                    ]
                )
            )
            parts.append(ch(verbs))
        else:
            parts.append(inflect(ch(verbs)))
        parts.append(noun_phrase())
        if rng.random() < 0.4:
            parts += [
                ch(
                    [
                        "because",
                        "when",
                        "if",
                        "after",
                        "before",
                        "while",
                        "so",
                        "but",
                        "and",
                        "until",
                        "since",
                    ]
                ),
                noun_phrase(),
                inflect(ch(verbs)),
            ]
        if rng.random() < 0.3:
            parts += [
                ch(["in", "on", "at", "for", "with", "by", "from", "into", "about"]),
                noun_phrase(),
            ]
        if rng.random() < 0.1:
            parts.append(
                ch(
                    [
                        str(rng.randint(0, 100)),
                        str(rng.randint(1900, 2030)),
                        f"{rng.randint(1, 99)}%",
                        ch(_NAMES[26:]),
                    ]
                )
            )
        s = " ".join(parts)
        s = s[0].upper() + s[1:]
        if rng.random() < 0.15:
            i = s.find(" ", len(s) // 2)
            if i > 0:
                s = s[:i] + "," + s[i:]
        end = "?" if r < 0.12 else ("!" if r < 0.16 else ".")
        return s + end

    def paragraph() -> str:
        return " ".join(sentence() for _ in range(rng.randint(2, 7)))

    def scalar() -> Any:
        r = rng.random()
        if r < 0.3:
            return " ".join(word() for _ in range(rng.randint(1, 6)))
        if r < 0.5:
            return rng.randint(-5, 100000) if rng.random() < 0.5 else rng.randint(0, 100)
        if r < 0.6:
            return round(rng.uniform(-100, 100), rng.randint(1, 4))
        if r < 0.7:
            return ch([True, False, None])
        if r < 0.8:
            return fpath()
        if r < 0.9:
            return f"{rng.randint(2019, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        return ident()

    def jvalue(depth: int) -> Any:
        r = rng.random()
        if depth < 3 and r < 0.2:
            return {ch(_KEYS): jvalue(depth + 1) for _ in range(rng.randint(1, 5))}
        if depth < 3 and r < 0.3:
            return [jvalue(depth + 1) for _ in range(rng.randint(0, 4))]
        return scalar()

    def json_doc() -> str:
        obj = {ch(_KEYS): jvalue(0) for _ in range(rng.randint(1, 7))}
        r = rng.random()
        if r < 0.5:
            return json.dumps(obj, ensure_ascii=False)
        if r < 0.85:
            return json.dumps(obj, indent=2, ensure_ascii=False)
        return json.dumps(obj, separators=(",", ":"))

    def fpath() -> str:
        parts = [ch(_DIRS) for _ in range(rng.randint(0, 4))]
        name = f"{ident()}.{ch(_EXTS)}"
        lead = ch(["", "/", "./", "~/", "/home/user/", "/work/"])
        return lead + "/".join([*parts, name])

    def dpath() -> str:
        return ch(["", "/", "./", "~/"]) + "/".join(ch(_DIRS) for _ in range(rng.randint(1, 4)))

    def shell() -> str:
        lines = []
        for _ in range(rng.randint(1, 6)):
            cmd = ch(_SHELL_CMDS).format(
                d=dpath(),
                f=fpath(),
                f2=fpath(),
                n=rng.randint(1, 500),
                w=ch(nouns),
                w2=ch(verbs),
                W=ident().upper(),
                s=sentence(),
                e=ch(_EXTS),
                p=ch([80, 8000, 8080, 3000, 5000, 4222]),
            )
            lines.append(ch(["$ ", "", "", "# " + sentence() + "\n"]) + cmd)
            if rng.random() < 0.3:
                lines.append(
                    ch(
                        [
                            fpath(),
                            f"{rng.randint(1, 9999)} {fpath()}",
                            "OK",
                            f"error: {sentence().lower()}",
                            f"Done in {rng.random():.2f}s",
                        ]
                    )
                )
        return "\n".join(lines)

    def py_expr() -> str:
        r = rng.random()
        if r < 0.2:
            return f"{ident()}({', '.join(ident() for _ in range(rng.randint(0, 3)))})"
        if r < 0.35:
            return f"{ident()}.{ident()}({ident()})"
        if r < 0.5:
            return f"{ident()} {ch(['+', '-', '*', '/', '==', '!=', '<', '>=', 'and', 'or', 'in'])} {rng.randint(0, 100)}"
        if r < 0.6:
            return repr(" ".join(word() for _ in range(rng.randint(1, 4))))
        if r < 0.7:
            return f"[{ident()} for {ident()} in {ident()}]"
        if r < 0.8:
            return f'f"{{{ident()}}} {word()}"'
        if r < 0.9:
            return f"{ident()}[{ch([str(rng.randint(0, 9)), repr(ch(_KEYS)), '-1', '1:'])}]"
        return ch(["None", "True", "False", "self", "[]", "{}", "0", "1", "len(x)"])

    def py_block(indent: str, depth: int) -> list[str]:
        out = []
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            if depth < 2 and r < 0.15:
                out.append(f"{indent}if {py_expr()}:")
                out += py_block(indent + "    ", depth + 1)
                if rng.random() < 0.3:
                    out.append(f"{indent}else:")
                    out += py_block(indent + "    ", depth + 1)
            elif depth < 2 and r < 0.25:
                out.append(f"{indent}for {ident()} in {py_expr()}:")
                out += py_block(indent + "    ", depth + 1)
            elif depth < 2 and r < 0.3:
                out.append(f"{indent}try:")
                out += py_block(indent + "    ", depth + 1)
                out.append(
                    f"{indent}except {ch(['ValueError', 'KeyError', 'OSError', 'Exception', 'TypeError'])} as e:"
                )
                out.append(f'{indent}    raise RuntimeError(f"{sentence()} {{e}}") from e')
            elif r < 0.5:
                out.append(f"{indent}{ident()} = {py_expr()}")
            elif r < 0.6:
                out.append(f"{indent}# {sentence()}")
            elif r < 0.7:
                out.append(f"{indent}self.{ident()} = {py_expr()}")
            elif r < 0.8:
                out.append(f'{indent}logger.{ch(["info", "debug", "warning"])}("{sentence()}")')
            else:
                out.append(f"{indent}{py_expr()}")
        if rng.random() < 0.4:
            out.append(f"{indent}return {py_expr()}")
        return out

    def python() -> str:
        lines = []
        if rng.random() < 0.4:
            lines += [
                f"import {ch(['os', 'sys', 'json', 're', 'time', 'asyncio', 'logging', 'torch', 'numpy as np'])}",
                f"from {ch(['pathlib', 'typing', 'collections', 'dataclasses'])} import {camel()}",
                "",
            ]
        if rng.random() < 0.35:
            lines.append(f"class {camel()}({ch(['', 'object', 'Exception', 'BaseModel'])}):")
            lines.append(f'    """{sentence()}"""')
            lines.append("")
            for _ in range(rng.randint(1, 3)):
                args = ", ".join(["self"] + [ident() for _ in range(rng.randint(0, 3))])
                lines.append(
                    f"    def {ident()}({args}) -> {ch(['None', 'int', 'str', 'bool', 'dict', 'list[str]'])}:"
                )
                if rng.random() < 0.5:
                    lines.append(f'        """{sentence()}"""')
                lines += py_block("        ", 0)
                lines.append("")
        else:
            args = ", ".join(
                f"{ident()}: {ch(['int', 'str', 'float', 'bool', 'Path', 'dict[str, Any]'])}"
                for _ in range(rng.randint(0, 3))
            )
            lines.append(f"{ch(['def', 'def', 'async def'])} {ident()}({args}):")
            if rng.random() < 0.5:
                lines.append(f'    """{sentence()}"""')
            lines += py_block("    ", 0)
        return "\n".join(lines)

    def js() -> str:
        name = camel()
        return "\n".join(
            [
                f"const {name[0].lower() + name[1:]} = async ({ident()}) => {{",
                f"  const {ident()} = await fetch(`/api/{ch(nouns)}/${{{ident()}}}`);",
                f'  if (!{ident()}) {{ throw new Error("{sentence()}"); }}',
                f"  return {{ {ch(_KEYS)}: {ident()}, {ch(_KEYS)}: {rng.randint(0, 99)} }};",
                "};",
            ]
        )

    def csv() -> str:
        cols = [ch(_KEYS) for _ in range(rng.randint(2, 7))]
        rows = [",".join(cols)]
        for _ in range(rng.randint(2, 12)):
            cells = []
            for _c in cols:
                v = scalar()
                cells.append(f'"{v}"' if isinstance(v, str) and " " in v else str(v))
            rows.append(",".join(cells))
        return "\n".join(rows)

    def tool_schema() -> dict[str, Any]:
        props = {
            ch(_KEYS): {
                "type": ch(["string", "integer", "boolean", "number", "array"]),
                "description": sentence(),
            }
            for _ in range(rng.randint(1, 4))
        }
        return {
            "type": "function",
            "function": {
                "name": ident(),
                "description": sentence(),
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": list(props)[: rng.randint(0, len(props))],
                },
            },
        }

    def tool_call() -> str:
        r = rng.random()
        if r < 0.4:
            name, args = (
                "bash",
                {
                    "command": ch(_SHELL_CMDS).format(
                        d=dpath(),
                        f=fpath(),
                        f2=fpath(),
                        n=rng.randint(1, 99),
                        w=ch(nouns),
                        w2=ch(verbs),
                        W="X",
                        s=sentence(),
                        e=ch(_EXTS),
                        p=8080,
                    )
                },
            )
        elif r < 0.6:
            name, args = ch(["read_file", "Read", "view"]), {"path": fpath()}
        elif r < 0.8:
            name, args = (
                ch(["write_file", "Write", "edit", "str_replace"]),
                {"path": fpath(), "old_str": py_expr(), "new_str": py_expr()},
            )
        else:
            name, args = ident(), {ch(_KEYS): scalar() for _ in range(rng.randint(1, 3))}
        call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        if rng.random() < 0.3:
            return json.dumps(tool_schema(), ensure_ascii=False)
        return call

    def markdown() -> str:
        lines = [f"{'#' * rng.randint(1, 3)} {sentence().rstrip('.?!')}", "", paragraph(), ""]
        for _ in range(rng.randint(0, 5)):
            lines.append(
                f"{ch(['-', '*', '1.', '2.'])} {ch(['', '**' + word() + '**: ', '`' + ident() + '`: '])}{sentence()}"
            )
        if rng.random() < 0.4:
            lines += [
                "",
                f"```{ch(['python', 'bash', 'json', ''])}",
                python() if rng.random() < 0.5 else shell(),
                "```",
            ]
        if rng.random() < 0.3:
            cols = [ch(_KEYS) for _ in range(3)]
            lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * 3]
            for _ in range(rng.randint(1, 4)):
                lines.append("| " + " | ".join(str(scalar()) for _ in cols) + " |")
        return "\n".join(lines)

    def logs() -> str:
        out = []
        for _ in range(rng.randint(1, 8)):
            ts = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
            out.append(f"{ts} {ch(['INFO', 'DEBUG', 'WARNING', 'ERROR'])} {ident()}: {sentence()}")
        if rng.random() < 0.3:
            out += [
                "Traceback (most recent call last):",
                f'  File "{fpath()}", line {rng.randint(1, 999)}, in {ident()}',
                f"    {py_expr()}",
                f"{ch(['ValueError', 'KeyError', 'FileNotFoundError', 'AssertionError'])}: {sentence()}",
            ]
        return "\n".join(out)

    def diff() -> str:
        f = fpath().lstrip("/~.")
        out = [
            f"diff --git a/{f} b/{f}",
            f"--- a/{f}",
            f"+++ b/{f}",
            f"@@ -{rng.randint(1, 200)},{rng.randint(1, 9)} +{rng.randint(1, 200)},{rng.randint(1, 9)} @@",
        ]
        for line in python().split("\n")[:8]:
            out.append(ch([" ", " ", "+", "-"]) + line)
        return "\n".join(out)

    kinds = [
        (paragraph, 30),
        (json_doc, 14),
        (python, 14),
        (shell, 8),
        (csv, 4),
        (tool_call, 8),
        (markdown, 10),
        (logs, 5),
        (diff, 3),
        (js, 2),
        (fpath, 2),
    ]
    gens = [g for g, w in kinds for _ in range(w)]
    produced = 0
    while produced < total_chars:
        doc = ch(gens)()
        produced += len(doc)
        yield doc


# --------------------------------------------------------------------------------------------
# Recipes and cache
# --------------------------------------------------------------------------------------------

# Qwen2/Qwen3 pre-tokenizer split: single digits, words with one leading non-letter, runs of
# punctuation, newlines with the indentation before them kept apart from the code after them.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS_CHARS = 3_000_000
_CORPUS_SEED = 20240601


def _tokenizer_recipe() -> dict[str, Any]:
    return {
        "recipe_version": RECIPE_VERSION,
        "kind": "byte-level-bpe",
        "vocab_size": VOCAB_SIZE,
        "special_tokens": list(SPECIAL_TOKENS),
        "added_tokens": list(ADDED_TOKENS),
        "split_pattern": _SPLIT_PATTERN,
        "corpus": {"chars": _CORPUS_CHARS, "seed": _CORPUS_SEED},
        "word_lists": hashlib.sha256(
            json.dumps(
                [
                    _FUNCTION_WORDS,
                    _NOUNS,
                    _VERBS,
                    _ADJECTIVES,
                    _ADVERBS,
                    _NAMES,
                    _EXTS,
                    _DIRS,
                    _SHELL_CMDS,
                    _KEYS,
                ]
            ).encode()
        ).hexdigest(),
        "chat_template": CHAT_TEMPLATE,
    }


def _model_recipe(size: str) -> dict[str, Any]:
    return {
        "tokenizer": _tokenizer_recipe(),
        "architecture": "Qwen3ForCausalLM",
        "shape": TINY_SIZES[size],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_theta": ROPE_THETA,
        "dtype": "float32",
    }


def _recipe_hash(recipe: dict[str, Any]) -> str:
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def default_cache_dir() -> Path:
    """``$HARNESSRL_CACHE`` or ``~/.cache/harnessrl``."""
    env = os.environ.get("HARNESSRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "harnessrl"


def parse_tiny_spec(spec: str) -> tuple[str, int] | None:
    """``"tiny-8m@seed3"`` -> ``("tiny-8m", 3)``; ``"tiny"`` -> ``("tiny-8m", 0)``; else None."""
    m = _TINY_RE.match(spec.strip())
    if not m:
        return None
    size = TINY_ALIASES.get(m.group(1), m.group(1))
    return size, int(m.group(2) or 0)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Best-effort inter-process lock (only avoids duplicate work; correctness comes from the
    atomic rename)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_atomically(final: Path, build: Any) -> Path:
    """Run ``build(tmp_dir)`` in a temporary sibling folder and rename it to ``final``. If another
    process got there first, keep theirs."""
    if (final / ".complete").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / ".complete").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            # mkdtemp makes a private folder; the cache is meant to be shared (and read-only).
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / ".complete").exists():
                    # A stale, incomplete folder (should not happen: we only ever rename
                    # complete ones). Replace it.
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# Tiny tokenizer
# --------------------------------------------------------------------------------------------


def _train_tokenizer() -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    docs = list(_corpus_documents(_CORPUS_CHARS, _CORPUS_SEED))
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, "
            f"expected {VOCAB_SIZE} (corpus too small for the vocabulary?)"
        )
    return tok


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def _write_tokenizer_files(tok: Any, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out / "special_tokens_map.json",
        {
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def build_tiny_tokenizer(cache_dir: Path | str | None = None) -> Path:
    """Train (once, cached) the tiny byte-level BPE tokenizer; returns its folder."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "tokenizers" / f"tiny-bpe-{_recipe_hash(_tokenizer_recipe())}"
    return _build_atomically(final, lambda tmp: _write_tokenizer_files(_train_tokenizer(), tmp))


# --------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------


def _tiny_config(size: str, vocab_size: int = VOCAB_SIZE, ids: dict[str, int] | None = None) -> Any:
    from transformers import Qwen3Config

    ids = ids or {ENDOFTEXT: 0, IM_START: 1, IM_END: 2}
    return Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        use_cache=True,
        **TINY_SIZES[size],
    )


def _build_model_into(size: str, seed: int, tok_dir: Path, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    for name in _TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out / name)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    vocab_size = len(vocab["model"]["vocab"]) + sum(
        1 for t in vocab["added_tokens"] if t["content"] not in vocab["model"]["vocab"]
    )
    config = _tiny_config(size, vocab_size, ids)
    config.architectures = ["Qwen3ForCausalLM"]
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev_dtype)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _write_json(
        out / "harnessrl_recipe.json",
        {"size": size, "seed": seed, "recipe": _model_recipe(size)},
    )


def build_tiny_model(
    size: str = "tiny-8m", seed: int = 0, cache_dir: Path | str | None = None
) -> Path:
    """Build (once, cached) a tiny randomly initialised Qwen3 model plus tokenizer."""
    size = TINY_ALIASES.get(size, size)
    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose from {sorted(TINY_SIZES)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "models" / f"{size}-s{seed}-{_recipe_hash(_model_recipe(size))}"
    if (final / ".complete").exists():
        return final
    tok_dir = build_tiny_tokenizer(root)
    return _build_atomically(final, lambda tmp: _build_model_into(size, seed, tok_dir, tmp))


def resolve_model(spec: str | os.PathLike[str], cache_dir: Path | str | None = None) -> Path:
    """Turn a model spec into a local folder holding a Hugging Face model + tokenizer.

    ``spec`` is ``tiny`` / ``tiny-1m`` / ``tiny-8m`` / ``tiny-30m`` (optionally ``@seedN``; built on
    first use into the cache) or a path to an existing local model folder. Raises ValueError for
    anything else. A folder whose name starts with ``tiny`` must be given with a path separator
    (``./tiny-foo``). The tiny cache key is a hash of the build recipe (shapes, vocabulary,
    corpus parameters, word lists, chat template, :data:`RECIPE_VERSION`).
    """
    if isinstance(spec, str):
        tiny = parse_tiny_spec(spec)
        if tiny is not None:
            return build_tiny_model(tiny[0], tiny[1], cache_dir)
        if not spec.strip():
            raise ValueError("empty model spec")
        if spec.strip().startswith("tiny") and os.sep not in spec:
            raise ValueError(
                f"unknown tiny model spec {spec!r}: expected tiny, tiny-1m, tiny-8m or tiny-30m, "
                "optionally followed by @seedN (e.g. tiny-8m@seed3)"
            )
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {str(spec)!r} is neither a tiny model spec (tiny, tiny-1m, tiny-8m, tiny-30m"
            "[@seedN]) nor an existing local folder (nothing can be downloaded)"
        )
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a folder")
    if not (path / "config.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ValueError(
            f"model folder {str(path)!r} has no config.json or tokenizer_config.json: "
            "not a Hugging Face model folder"
        )
    return path.resolve()


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A ``transformers`` fast tokenizer from a local folder (or a tiny spec)."""
    from transformers import AutoTokenizer

    folder = resolve_model(path)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(
            dtype, dtype
        )
        value = getattr(torch, name.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"unknown dtype {dtype!r}")


def load_model(path: str | os.PathLike[str], dtype: Any = "float32", device: Any = "cpu") -> Any:
    """A ``transformers`` causal LM from a local folder (or a tiny spec), in eval mode.

    ``dtype`` is a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"``, ``"bf16"``...).
    """
    import transformers
    from transformers import AutoModelForCausalLM

    folder = resolve_model(path)
    td = _torch_dtype(dtype)
    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype": td} if major >= 5 else {"torch_dtype": td}
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kw)
    model.to(device)
    model.eval()
    return model


def _safetensors_numels(files: Sequence[Path]) -> tuple[int, str | None]:
    total = 0
    dtype = None
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in meta["shape"]:
                numel *= d
            total += numel
            dtype = dtype or meta.get("dtype")
    return total, dtype


def model_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Facts about a model folder without loading its weights: ``n_params`` (from safetensors
    headers; ``None`` if there are none), ``vocab_size``, ``max_position_embeddings``,
    ``eos_token_ids``, ``model_type``, ``hidden_size``, ``num_hidden_layers``,
    ``tie_word_embeddings``, ``weights_dtype``, ``path``."""
    folder = resolve_model(path)
    config = json.loads((folder / "config.json").read_text())
    text_config = config.get("text_config") or config
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    n_params, wdtype = _safetensors_numels(files) if files else (None, None)
    eos: Any = None
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = text_config.get("eos_token_id")
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {
        "path": str(folder),
        "model_type": config.get("model_type"),
        "n_params": n_params,
        "vocab_size": text_config.get("vocab_size"),
        "max_position_embeddings": text_config.get("max_position_embeddings"),
        "hidden_size": text_config.get("hidden_size"),
        "num_hidden_layers": text_config.get("num_hidden_layers"),
        "tie_word_embeddings": config.get(
            "tie_word_embeddings", text_config.get("tie_word_embeddings")
        ),
        "eos_token_ids": eos_list,
        "weights_dtype": wdtype,
    }


# --------------------------------------------------------------------------------------------
# Token helpers
# --------------------------------------------------------------------------------------------


def _token_id(tokenizer: Any, token: str) -> int | None:
    """Id of ``token`` if it is a single token of ``tokenizer`` (transformers or tokenizers)."""
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "convert_tokens_to_ids"):
        vocab = tokenizer.get_vocab()
        return vocab.get(token)
    if hasattr(tokenizer, "token_to_id"):
        return tokenizer.token_to_id(token)
    raise TypeError(f"not a tokenizer: {type(tokenizer).__name__}")


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """``{token: id}`` for each ChatML/tool/think token the tokenizer has as a single id."""
    out: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        i = _token_id(tokenizer, token)
        if i is not None:
            out[token] = int(i)
    return out


def eos_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end a generation: ``<|im_end|>`` and ``<|endoftext|>`` where present, else the
    tokenizer's own ``eos_token_id``."""
    ids = [i for t in (IM_END, ENDOFTEXT) if (i := _token_id(tokenizer, t)) is not None]
    own = getattr(tokenizer, "eos_token_id", None)
    if own is not None and own not in ids:
        ids.append(int(own))
    return [int(i) for i in ids]


# --------------------------------------------------------------------------------------------
# Chat template rendering without transformers
# --------------------------------------------------------------------------------------------

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

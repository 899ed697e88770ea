"""The teacher's tool vocabulary, read from each real harness's captured request.

Each fixture is the request a real harness sent (``tests/fixtures/harness_requests``). It goes
through the proxy's own API conversion and the chat template, exactly as the teacher engine
receives it, and the vocabulary is read back from the rendered prompt."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from harnessrl.common.models import load_tokenizer, render_chat
from harnessrl.common.tasks import load_task
from harnessrl.common.tasks.teacher import TOOLS, family_of, style_for, teacher_step
from harnessrl.common.tasks.vocabulary import (
    Vocabulary,
    VocabularyError,
    declared_functions,
    prompt_text,
    submit_command,
    tools_in_prompt,
)
from harnessrl.proxy.engine.teacher import Teacher, parse_prompt
from harnessrl.proxy.messages_api import messages_request
from harnessrl.proxy.responses_api import responses_request
from harnessrl.proxy.server import chat_request

TOK = load_tokenizer("tiny-1m")
FIXTURES = Path(__file__).parent / "fixtures" / "harness_requests"
CONVERT = {"chat": chat_request, "messages": messages_request, "responses": responses_request}
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

# fixture, API, run tool and its command parameter, finish, write tool (None: through the shell)
HARNESSES = {
    "mini-swe-agent": ("mini_swe_agent_first_request", "chat", "bash", "command", "command", None),
    "claude-code": ("claude_code_first_request", "messages", "Bash", "command", "answer", None),
    "codex": ("codex_first_request", "responses", "exec_command", "cmd", "answer", None),
    "openclaw": ("openclaw_first_request", "chat", "exec", "command", "answer", "write"),
    "opencode": ("opencode_second_request", "chat", "bash", "command", "answer", "write"),
}


def rendered_prompt(fixture: str, api: str) -> str:
    """The prompt the engine receives for a captured request: the proxy's conversion, the chat
    template, the tokenizer, decoded."""
    body = json.loads((FIXTURES / f"{fixture}.json").read_text())["body"]
    req = CONVERT[api](body, "r-0-1", {})
    text = render_chat(req.messages, tools=req.tools, add_generation_prompt=True)
    return TOK.decode(TOK.encode(text, add_special_tokens=False), skip_special_tokens=False)


def vocabulary_of(fixture: str, api: str) -> Vocabulary:
    prompt = rendered_prompt(fixture, api)
    return Vocabulary.from_request(tools_in_prompt(prompt), prompt_text(parse_prompt(prompt)))


@pytest.mark.unit
@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_vocabulary_from_each_harness_request(harness: str) -> None:
    """The run tool, its command parameter, the way to finish and the write tool, as the
    teacher engine reads them from the harness's own rendered request."""
    fixture, api, run, key, finish, write = HARNESSES[harness]
    v = vocabulary_of(fixture, api)
    assert (v.tools["run"].name, v.tools["run"].keys["cmd"]) == (run, key)
    assert v.finish == finish
    assert v.submit == (SUBMIT if finish == "command" else "")
    assert (v.tools["write_file"].name if "write_file" in v.tools else None) == write
    assert "read_file" not in v.tools and "list_dir" not in v.tools
    assert run in v.declared


@pytest.mark.unit
def test_tools_read_from_the_prompt_equal_the_declared_ones() -> None:
    """What the template's ``<tools>`` block gives back is the request's tool list, converted:
    every function tool the harness declared, in order (Codex's namespace tools included)."""
    for fixture, api, *_ in HARNESSES.values():
        body = json.loads((FIXTURES / f"{fixture}.json").read_text())["body"]
        names = [n for n, _, _ in declared_functions(body.get("tools") or [])]
        prompt = rendered_prompt(fixture, api)
        assert [n for n, _, _ in declared_functions(tools_in_prompt(prompt))] == names
        assert names == list(Vocabulary.from_request(tools_in_prompt(prompt)).declared)


@pytest.mark.unit
def test_reference_vocabulary() -> None:
    v = Vocabulary.from_request(TOOLS)
    assert {a: u.name for a, u in v.tools.items()} == {
        "run": "run",
        "write_file": "write_file",
        "read_file": "read_file",
        "list_dir": "list_dir",
        "finish": "finish",
    }
    assert v.finish == "tool" and v.has("read_file", "list_dir")


@pytest.mark.unit
def test_absolute_paths_where_the_tool_asks_for_them() -> None:
    """opencode's ``write`` wants an absolute ``filePath`` (its description says so): relative
    paths are put under the workspace mount, and read back relative; OpenClaw's takes either."""
    v = vocabulary_of("opencode_second_request", "chat")
    msg = v.message("write_file", path="out.txt", content="x\n")
    args = json.loads(msg["tool_calls"][0]["function"]["arguments"])
    assert args == {"filePath": "/workspace/out.txt", "content": "x\n"}
    assert v.action_of("write", args) == ("write_file", {"path": "out.txt", "content": "x\n"})
    w = vocabulary_of("openclaw_first_request", "chat")
    args = json.loads(
        w.message("write_file", path="out.txt", content="x")["tool_calls"][0]["function"][
            "arguments"
        ]
    )
    assert args == {"path": "out.txt", "content": "x"}


@pytest.mark.unit
@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_messages_read_back_as_the_same_actions(harness: str) -> None:
    fixture, api, run, key, *_ = HARNESSES[harness]
    v = vocabulary_of(fixture, api)
    msg = v.message("run", cmd="wc -l a.txt > out.txt", turn=0)
    (call,) = msg["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == run and args[key] == "wc -l a.txt > out.txt"
    assert v.action_of(run, args) == ("run", {"cmd": "wc -l a.txt > out.txt"})
    assert not v.is_final(msg)
    done = v.message("finish", summary="Wrote out.txt.")
    assert v.is_final(done)
    if v.finish == "command":  # mini-swe-agent: the submit command, alone, through bash
        (call,) = done["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {key: SUBMIT}
    else:
        assert not done.get("tool_calls") and done["content"] == "Wrote out.txt."


@pytest.mark.unit
def test_a_harness_with_no_usable_tool_is_a_clear_error() -> None:
    """Codex without ``exec_command`` declares nothing that runs a command or writes a file:
    the error says what is needed and lists what was declared."""
    body = json.loads((FIXTURES / "codex_first_request.json").read_text())["body"]
    tools = [t for t in body["tools"] if t.get("name") != "exec_command"]
    with pytest.raises(VocabularyError) as e:
        Vocabulary.from_request(tools)
    assert "'command' or 'cmd'" in str(e.value) and "write_stdin" in str(e.value)
    with pytest.raises(VocabularyError, match="no tools"):
        Vocabulary.from_request([])


@pytest.mark.unit
def test_tool_found_by_its_schema_not_its_name() -> None:
    """A shell tool of any name is found by its required command parameter; a tool whose
    command is optional (opencode's ``task``) or that needs a non-string is not one; a required
    string beside the command gets a description of the step."""
    tools = [
        {"type": "function", "function": {"name": "task", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"},
            "prompt": {"type": "string"}}, "required": ["prompt"]}}},
        {"type": "function", "function": {"name": "spawn", "parameters": {
            "type": "object", "properties": {"cmd": {"type": "string"},
            "env": {"type": "object"}}, "required": ["cmd", "env"]}}},
        {"type": "function", "function": {"name": "terminal_v2", "description": "Run in a shell",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"},
            "why": {"type": "string"}}, "required": ["command", "why"]}}},
    ]  # fmt: skip
    v = Vocabulary.from_request(tools)
    assert v.tools["run"].name == "terminal_v2"
    args = json.loads(v.message("run", "count", cmd="ls")["tool_calls"][0]["function"]["arguments"])
    assert args == {"command": "ls", "why": "count"}


@pytest.mark.unit
def test_submit_command_is_read_from_the_prompt() -> None:
    assert (
        submit_command("finish your work by issuing the following command: `echo DONE_X`.")
        == "echo DONE_X"
    )
    assert submit_command("Run `ls` to list files.") == ""


@pytest.mark.integration
def test_shell_write_writes_the_exact_content(tmp_path: Path) -> None:
    """Without a write tool, writing is a shell command that writes exactly the content (quotes,
    percent signs, newlines and a missing final newline kept)."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    v = vocabulary_of("mini_swe_agent_first_request", "chat")
    content = 'it\'s 100% "done"\n$HOME `x`\nno newline'
    msg = v.message("write_file", path="my out.txt", content=content)
    cmd = json.loads(msg["tool_calls"][0]["function"]["arguments"])["command"]
    subprocess.run(["bash", "-c", cmd], cwd=tmp_path, check=True)
    assert (tmp_path / "my out.txt").read_text() == content


@pytest.mark.unit
@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_teacher_steps_in_each_harness_vocabulary(harness: str) -> None:
    """The shell-style teacher runs the family's one-liner with the harness's run tool, then
    ends the harness's way; the edit style (which needs the reference harness's plain-text
    file tools) falls back to it."""
    fixture, api, run, key, finish, _ = HARNESSES[harness]
    v = vocabulary_of(fixture, api)
    task = load_task("toy", "copy_01")
    fam, params = family_of(task)
    msgs: list[dict] = [{"role": "user", "content": task.instruction}]
    for style in ("shell", "edit"):
        first = teacher_step(task, msgs, style, v)
        (call,) = first["tool_calls"]
        assert call["function"]["name"] == run
        assert json.loads(call["function"]["arguments"])[key] == fam.command(params)
    result = {"role": "tool", "tool_call_id": call["id"], "content": "ok"}
    second = teacher_step(task, [*msgs, first, result], "shell", v)
    assert v.is_final(second)
    assert bool(second.get("tool_calls")) == (finish == "command")


@pytest.mark.unit
def test_teacher_engine_speaks_the_harness_of_the_prompt() -> None:
    """The engine's reply to mini-swe-agent's rendered request (with a toy task pasted in as
    the user's issue) is a ``bash`` call of the one-liner, rendered exactly as the template
    would; a harness with no usable tool gets a plain answer, counted."""
    body = json.loads((FIXTURES / "mini_swe_agent_first_request.json").read_text())["body"]
    task = load_task("toy", "copy_01")
    body["messages"][1]["content"] = body["messages"][1]["content"].replace(
        "Create hello.txt containing a greeting.", task.instruction
    )
    req = chat_request(body, "r-0-1", {})
    prompt = render_chat(req.messages, tools=req.tools, add_generation_prompt=True)
    teacher = Teacher(TOK, ["toy"], style="shell")
    reply = teacher.reply_text(prompt)
    cmd = json.dumps({"command": family_of(task)[0].command(family_of(task)[1])})
    assert reply == f'<tool_call>\n{{"name": "bash", "arguments": {cmd}}}\n</tool_call><|im_end|>'
    no_tools = [{"type": "function", "function": {"name": "view_image", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]  # fmt: skip
    prompt = render_chat(req.messages, tools=no_tools, add_generation_prompt=True)
    reply = teacher.reply_text(prompt)
    assert "<tool_call>" not in reply and "no tool that runs a shell command" in reply
    assert teacher.unusable == 1


@pytest.mark.unit
def test_style_for_is_a_stable_share_of_instructions() -> None:
    instructions = [f"Copy file{i}.txt to out.txt" for i in range(2000)]
    styles = [style_for(i, "shell", 0.3, seed=0) for i in instructions]
    assert 0.25 < styles.count("near_miss") / len(styles) < 0.35
    assert styles == [style_for(i, "shell", 0.3, seed=0) for i in instructions]
    assert styles != [style_for(i, "shell", 0.3, seed=1) for i in instructions]
    assert {style_for(i, "edit", 0.9) for i in instructions} == {"edit"}


@pytest.mark.unit
def test_teacher_finds_the_task_in_a_later_user_message() -> None:
    """Codex sends its environment context as the first user message and the task after it:
    the teacher finds the task in whichever user message holds it, and answers with
    ``exec_command``."""
    body = json.loads((FIXTURES / "codex_first_request.json").read_text())["body"]
    task = load_task("toy", "count_word_02")
    body["input"][-1]["content"][0]["text"] = task.instruction
    req = responses_request(body, "r-0-1", {})
    prompt = render_chat(req.messages, tools=req.tools, add_generation_prompt=True)
    teacher = Teacher(TOK, ["toy"], style="shell")
    reply = teacher.reply_text(prompt)
    fam, params = family_of(task)
    cmd = json.dumps({"cmd": fam.command(params)})
    assert (
        reply
        == f'<tool_call>\n{{"name": "exec_command", "arguments": {cmd}}}\n</tool_call><|im_end|>'
    )
    assert teacher.unknown == 0

"""A proxy in front of a scripted engine, recording on an in-memory bus, driven by the OpenAI
SDK: the tokenizer, renderer, rollout token and messages the proxy tests share."""

from __future__ import annotations

import contextlib

import openai

from harnessrl.common.bus import connect
from harnessrl.common.models import load_tokenizer
from harnessrl.proxy.calls import ModelCaller
from harnessrl.proxy.parsers import HermesParser
from harnessrl.proxy.recorder import Recorder
from harnessrl.proxy.scripted import ScriptedEngine
from harnessrl.proxy.server import ProxyServer
from harnessrl.proxy.sglang import EngineClient
from harnessrl.proxy.tito import ChatRenderer

TOK = load_tokenizer("tiny-1m")
R = ChatRenderer(TOK)
TOKEN, ROLLOUT = "sk-rollout-token", "g-0-1"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List files."}]
TOOL_REPLY = (
    "<think>\nuse ls\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
)


@contextlib.asynccontextmanager
async def proxy(run_name: str, script, grace: float = 0.1, **kw):
    bus = await connect(f"memory://{run_name}", run_name)
    async with (
        ScriptedEngine(TOK, script) as eng,
        EngineClient(eng.url) as client,
        Recorder(bus) as rec,
    ):
        caller = ModelCaller(client, R, HermesParser(), rec, **kw)
        async with ProxyServer(caller, {TOKEN: ROLLOUT}, ping_s=0.05, stream_grace_s=grace) as srv:
            sdk = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0)
            yield sdk, srv, eng, rec, bus
            await sdk.close()

"""``python -m harnessrl.proxy.proxy_cmd``: the proxy as its own process, between an engine and NATS."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from harnessrl.common.bus import connect
from harnessrl.common.config import undocumented_fields
from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import CallRecord
from harnessrl.proxy.proxy_config import ProxyConfig
from harnessrl.proxy.scripted import ScriptedEngine

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_config_is_documented_and_checked() -> None:
    """Every field documented; a token needs its rollout id, which must be a subject token."""
    assert undocumented_fields(ProxyConfig) == []
    assert ProxyConfig(token="t", rollout_id="g-0-1").token_map() == {"t": "g-0-1"}
    with pytest.raises(ValueError, match="together"):
        ProxyConfig(token="t")
    with pytest.raises(ValueError, match="rollout_id"):
        ProxyConfig(tokens={"t": "bad id"})


@pytest.mark.integration
async def test_proxy_process_serves_records_and_flushes(nats_url: str, run_name: str) -> None:
    """Start the proxy, make a call with the OpenAI SDK, SIGTERM it: exit 0, record stored,
    carrying the harness identity the proxy was started with."""
    tok = load_tokenizer("tiny-1m")
    async with ScriptedEngine(tok, ["Hello from the engine."]) as eng:
        eng.model_path = "scripted"
        argv = [
            sys.executable, "-m", "harnessrl.proxy.proxy_cmd",
            "--nats", nats_url, "--run", run_name, "--engines", eng.url,
            "--model", "tiny-1m", "--token", "secret", "--rollout-id", "g-9-1",
            "--max-context", "4096", "--metrics-port", "-1",
            "--harness", "opencode", "--harness-version", "0.15.2",
        ]  # fmt: skip
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line.startswith("proxy ready: http://127.0.0.1:"), line
            url = line.split()[2]
            sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
            out = await sdk.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}]
            )
            await sdk.close()
            assert out.choices[0].message.content == "Hello from the engine."
        finally:
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
    assert code == 0
    bus = await connect(nats_url, run_name)
    try:
        (record,) = await bus.read_subject(bus.subjects.calls("g-9-1"), CallRecord)
    finally:
        await bus.close()
    assert (record.api, record.status, record.sampling.max_new_tokens) == (
        "chat",
        "ok",
        4096 - record.input_len,
    )
    assert (record.harness, record.harness_version) == ("opencode", "0.15.2")


@pytest.mark.slow
async def test_proxy_stops_at_once_when_nats_is_down(nats_server_fn, run_name, tmp_path) -> None:
    """NATS gone before a call's record could be stored: SIGTERM ends the proxy within seconds
    (nothing can be flushed to a server that is away), exit 1 with the reason and no
    traceback, instead of waiting out ``flush_timeout_s``."""
    tok = load_tokenizer("tiny-1m")
    log = tmp_path / "proxy.log"
    async with ScriptedEngine(tok, ["Hello from the engine."]) as eng:
        argv = [
            sys.executable, "-m", "harnessrl.proxy.proxy_cmd",
            "--nats", nats_server_fn.url, "--run", run_name, "--engines", eng.url,
            "--model", "tiny-1m", "--token", "secret", "--rollout-id", "g-9-1",
            "--max-context", "4096", "--metrics-port", "-1", "--flush-timeout-s", "120",
        ]  # fmt: skip
        with open(log, "wb") as err:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line.startswith("proxy ready: "), log.read_text()
            nats_server_fn.kill()
            sdk = openai.AsyncOpenAI(base_url=line.split()[2] + "/v1", api_key="secret")
            await sdk.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}]
            )
            await sdk.close()
            await asyncio.sleep(1.0)  # the proxy saw the connection go
            t0 = asyncio.get_running_loop().time()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 150)
            took = asyncio.get_running_loop().time() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert code == 1 and "call records not all stored" in text, text[-3000:]
    assert "Traceback" not in text and took < 20, (took, text[-3000:])

"""The engines' API key (SGLang's ``--api-key``): every endpoint but ``/health*`` and
``/metrics`` answers 401 without ``Authorization: Bearer KEY``; the proxy's engine client, the
weight updater and the learner's distributed publisher send it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from harnessrl.common.files import write_secret
from harnessrl.common.models import resolve_model
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine import EngineServer
from harnessrl.proxy.scripted import ScriptedEngine
from harnessrl.proxy.sglang import EngineClient, EngineError

pytestmark = pytest.mark.integration

KEY = "k3y-for-tests"
ROOT = Path(__file__).resolve().parent.parent

PROTECTED = [
    ("POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/init_weights_update_group", {"group_name": "g"}),
    ("POST", "/update_weights_from_distributed", {"group_name": "g"}),
    ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"rid": "x"}),
    ("POST", "/flush_cache", {}),
    ("GET", "/flush_cache", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/get_weight_version", None),
]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_secret(tmp_path_factory.mktemp("key") / "engine-api-key", KEY)


async def call(url: str, method: str, path: str, body, key: str | None) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url + path, json=body, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


async def test_engine_refuses_every_admin_endpoint_without_the_key(key_file: Path) -> None:
    """401 without the key or with a wrong one, and nothing happens; /health and /metrics
    stay open; with the key, generation and the admin endpoints work."""
    cfg = EngineConfig(model="tiny-1m", port=0, threads=1, api_key_file=str(key_file))
    async with EngineServer(cfg) as srv:
        for method, path, body in PROTECTED:
            for key in (None, "wrong", KEY + "x"):
                status, reply = await call(srv.url, method, path, body, key)
                assert status == 401, (method, path, key, reply)
                assert reply == {"error": "Unauthorized"}
        assert srv.engine.version == "0"  # the refused update did not run
        for path in ("/health", "/health_generate", "/metrics"):
            async with aiohttp.ClientSession() as http, http.get(srv.url + path) as r:
                assert r.status == 200, path
        status, reply = await call(srv.url, *PROTECTED[0], KEY)
        assert status == 200 and len(reply["output_ids"]) == 2  # type: ignore[index]
        for method, path, body in PROTECTED[5:9]:
            status, reply = await call(srv.url, method, path, body, KEY)
            assert status == 200, (path, reply)


async def test_engine_client_sends_the_key(key_file: Path) -> None:
    """The proxy's engine client generates with the key; without it the error says why."""
    cfg = EngineConfig(model="tiny-1m", port=0, threads=1, api_key_file=str(key_file))
    async with (
        EngineServer(cfg) as srv,
        EngineClient(srv.url, api_key=KEY) as good,
        EngineClient(srv.url) as bare,
    ):
        res = await good.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0})
        assert len(res.output_ids) == 3 and len(res.logprobs) == 3
        assert await good.weight_version() == 0
        assert await bare.health()  # /health is open
        with pytest.raises(EngineError) as e:
            await bare.generate([5, 6, 7], {"max_new_tokens": 3})
        assert e.value.status == 401 and "requires an API key" in str(e.value)


def test_engine_refuses_an_unreadable_key_file(tmp_path: Path) -> None:
    """``harnessrl engine --api-key-file MISSING`` exits 1 with one line naming the file."""
    missing = tmp_path / "nope"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "harnessrl.common.cli",
            "engine",
            "--model",
            "tiny-1m",
            "--port",
            "0",
        ]
        + ["--api-key-file", str(missing)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and str(missing) in res.stderr, res.stderr


async def test_weights_sync_load_sends_the_key(key_file: Path) -> None:
    """``harnessrl weights-sync --load`` with ``--engine-api-key-file`` updates a keyed engine;
    without the key the engine refuses and the command says so in one line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    new = resolve_model("tiny-1m@seed1")

    def weights_sync(*flags: str) -> subprocess.CompletedProcess:
        argv = [
            sys.executable,
            "-m",
            "harnessrl.proxy.weights_sync_cmd",
            "--metrics-port",
            "-1",
            *flags,
        ]
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    cfg = EngineConfig(model="tiny-1m", port=0, threads=1, api_key_file=str(key_file))
    async with EngineServer(cfg) as srv:
        bare = await asyncio.to_thread(
            weights_sync, "--engine", srv.url, "--load", str(new), "--load-version", "3"
        )
        assert bare.returncode == 1 and "401" in bare.stderr, bare.stderr
        assert srv.engine.version == "0"
        ok = await asyncio.to_thread(
            weights_sync,
            *("--engine", srv.url, "--load", str(new), "--load-version", "3"),
            *("--engine-api-key-file", str(key_file)),
        )
        assert ok.returncode == 0, ok.stderr
        assert srv.engine.version == "3"


async def test_learner_distributed_publisher_sends_the_key(key_file: Path) -> None:
    """The learner's engine calls (pause/continue around an update) carry the key."""
    from harnessrl.common.bus import MemoryBus
    from harnessrl.learner.config import BroadcastConfig
    from harnessrl.learner.weights import make_publisher

    cfg = EngineConfig(model="tiny-1m", port=0, threads=1, api_key_file=str(key_file))
    async with EngineServer(cfg) as srv:
        for key_path, ok in ((str(key_file), True), ("", False)):
            bc = BroadcastConfig(
                transport="distributed", engines=[srv.url], engine_api_key_file=key_path
            )
            pub = make_publisher(
                bc,
                MemoryBus("t"),
                model_dir=None,
                config_json="{}",
                dtype="float32",
                default_disk_dir=Path(),
            )
            pub.session = aiohttp.ClientSession(headers=pub.headers)  # type: ignore[union-attr]
            try:
                if ok:
                    await pub._post_all("/pause_generation", {"mode": "in_place"})  # type: ignore[union-attr]
                    await pub._post_all("/continue_generation", {})  # type: ignore[union-attr]
                else:
                    with pytest.raises(RuntimeError, match="HTTP 401"):
                        await pub._post_all("/pause_generation", {"mode": "in_place"})  # type: ignore[union-attr]
            finally:
                await pub.session.close()  # type: ignore[union-attr]


async def test_scripted_and_teacher_engines_take_the_key_too() -> None:
    """The scripted engine (behind ``harnessrl engine --kind teacher``) guards the same way."""
    async with ScriptedEngine(None, default="hi", api_key=KEY) as eng:
        status, _ = await call(eng.url, "POST", "/update_weights_from_disk", {}, None)
        assert status == 401
        status, _ = await call(eng.url, "GET", "/get_weight_version", None, KEY)
        assert status == 200
        async with aiohttp.ClientSession() as http, http.get(eng.url + "/health") as r:
            assert r.status == 200

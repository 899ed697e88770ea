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
    ("GET", "/model_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/server_info", None),
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


def engine_cmd(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``harnessrl engine --kind teacher`` (the same key handling as the torch engine, without
    loading a model) with ``$HARNESSRL_CACHE`` in ``tmp_path``; (process, ready line)."""
    from harnessrl.proxy.engine_cmd import spawn_engine

    env = {"HARNESSRL_CACHE": str(tmp_path / "cache")}
    argv = ["--kind", "teacher", "--suites", "toy", "--model", "tiny-1m", "--port", "0", *flags]
    proc, _ = spawn_engine(argv, env=env)
    line = next(ln for ln in proc.output_lines if ln.startswith("engine ready"))  # type: ignore[attr-defined]
    return proc, line


def test_engine_is_closed_by_default(tmp_path: Path) -> None:
    """``harnessrl engine`` with no key option makes one (``$HARNESSRL_CACHE/engine-api-key``,
    0600, reused by the next engine), names it on its ready line, and answers 401 to weight
    loads and pauses without it; the torch engine alike."""
    default = tmp_path / "cache" / "engine-api-key"
    for kind in ("teacher", "engine"):
        if kind == "teacher":
            proc, line = engine_cmd(tmp_path)
        else:
            from harnessrl.proxy.engine_cmd import spawn_engine

            env = {"HARNESSRL_CACHE": str(tmp_path / "cache")}
            proc, _ = spawn_engine(["--model", "tiny-1m", "--port", "0", "--threads", "1"], env=env)
            line = proc.output_lines[-1]  # type: ignore[attr-defined]
        try:
            url = line.split()[2]
            assert f"API key required (in {default})" in line, line
            assert (default.stat().st_mode & 0o777) == 0o600
            key = default.read_text().strip()
            assert len(key) >= 32
            for path, body in (
                ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
                ("/pause_generation", {"mode": "abort"}),
            ):
                status, _ = asyncio.run(call(url, "POST", path, body, None))
                assert status == 401, (kind, path)
            status, _ = asyncio.run(call(url, "POST", "/continue_generation", {}, key))
            assert status == 200
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
        assert default.read_text().strip() == key  # the second engine reused it


def test_engine_key_file_is_made_where_named_and_insecure_is_explicit(tmp_path: Path) -> None:
    """``--api-key-file FILE``: a missing file is made there (0600, like the NATS credentials)
    and reused; ``--insecure`` serves without a key and says so on stderr."""
    named = tmp_path / "keys" / "engine.key"
    proc, line = engine_cmd(tmp_path, "--api-key-file", str(named))
    try:
        assert f"API key required (in {named})" in line
        assert (named.stat().st_mode & 0o777) == 0o600
        url = line.split()[2]
        assert asyncio.run(call(url, "POST", "/pause_generation", {}, None))[0] == 401
        key = named.read_text().strip()
        assert asyncio.run(call(url, "POST", "/continue_generation", {}, key))[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)
    proc, line = engine_cmd(tmp_path, "--insecure")
    try:
        assert "no API key" in line
        url = line.split()[2]
        assert asyncio.run(call(url, "POST", "/continue_generation", {}, None))[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)
    assert any("--insecure" in ln and "anyone" in ln for ln in proc.output_lines)  # type: ignore[attr-defined]
    assert not (tmp_path / "cache" / "engine-api-key").exists()


def test_engine_help_says_it_is_closed_by_default() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "harnessrl.common.cli", "engine", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    text = " ".join(res.stdout.split())
    assert "--insecure" in text and "$HARNESSRL_CACHE/engine-api-key" in text, text


def test_engine_refuses_an_unreadable_key_file(tmp_path: Path) -> None:
    """``harnessrl engine --api-key-file FILE`` exits 1 with one line naming a file it cannot
    read (here: a folder)."""
    missing = tmp_path / "a-folder"
    missing.mkdir()
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


def test_a_client_finds_the_default_engine_key_of_its_machine(tmp_path, monkeypatch):
    """A client given no key file sends the key a ``harnessrl engine`` of the same user serves
    with by default, when that file exists (else none); a named file always wins."""
    from harnessrl.proxy.engine.auth import client_key, default_key_file, serving_key

    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path / "cache"))
    assert client_key("") == ""
    key, where = serving_key()  # what `harnessrl engine` does with no key option
    assert where == str(default_key_file()) and client_key("") == key
    other = tmp_path / "other.key"
    other.write_text("another-key\n")
    assert client_key(str(other)) == "another-key"

"""CLI and config: instant --help, every command with its help, strict typed configs."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from harnessrl.common import cli
from harnessrl.common.config import (
    ConfigError,
    HrlModel,
    NatsServerConfig,
    ServiceConfig,
    dump_toml,
    load_config,
    undocumented_fields,
)
from harnessrl.common.procs import pid_alive
from tests.helpers.wait import wait_until

HRL = [sys.executable, "-m", "harnessrl.common.cli"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*HRL, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration
def test_help_is_fast_and_imports_no_heavy_library() -> None:
    code = (
        "import sys, time; t=time.perf_counter(); from harnessrl.common import cli\n"
        "try: cli.main(['--help'])\nexcept SystemExit: pass\n"
        "heavy=[m for m in ('torch','deepspeed','transformers') if m in sys.modules]\n"
        "print('ELAPSED', time.perf_counter()-t, 'HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = out.stdout.strip().splitlines()[-1]
    assert "HEAVY []" in line, line
    assert float(line.split()[1]) < 1.0, line


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_subcommand_has_help(name: str) -> None:
    res = run_cli(name, "--help")
    assert res.returncode == 0, res.stderr
    assert " ".join(cli.COMMANDS[name].help.split()) in " ".join(res.stdout.split())


def all_config_models() -> list[type[BaseModel]]:
    """Every CONFIG of a landed subcommand plus the shared models."""
    models: list[type[BaseModel]] = [ServiceConfig, NatsServerConfig]
    for c in cli.COMMANDS.values():
        if c.module:
            cfg = getattr(importlib.import_module(c.module), "CONFIG", None)
            if cfg is not None:
                models.append(cfg)
    return models


def _subparser(name: str):
    parser = cli.build_parser([name])
    (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, subs.choices[name]


@pytest.mark.unit
@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_no_parser_takes_abbreviations(name: str) -> None:
    """Every parser refuses abbreviated flags, so a flag added later can never turn an old
    command line into an "ambiguous option": here, a valued flag cut short is refused."""
    parser, sub = _subparser(name)
    assert parser.allow_abbrev is False and sub.allow_abbrev is False
    taken = sub._option_string_actions
    valued = [o for o, a in taken.items() if o.startswith("--") and a.nargs != 0]
    for flag in valued:
        if flag[:-1] not in taken and not any(o != flag and o.startswith(flag[:-1]) for o in taken):
            with pytest.raises(SystemExit):
                parser.parse_args([name, flag[:-1], "1"])
            break


@pytest.mark.unit
@pytest.mark.parametrize("name", ["proxy", "actor", "rollout", "run", "demo"])
def test_engines_take_one_flag_everywhere(name: str) -> None:
    """``--engine URL`` (repeated) and ``--engines URL`` are the same flag in every command
    with engines; the old ``harnessrl proxy --engine URL`` works again."""
    parser, _ = _subparser(name)
    args = parser.parse_args([name, "--engine", "http://a:1", "--engines", "http://b:2"])
    assert args.cfg__engines == ["http://a:1", "http://b:2"]


@pytest.mark.unit
@pytest.mark.parametrize("model", all_config_models(), ids=lambda m: m.__name__)
def test_every_config_field_is_documented_and_strict(model: type[HrlModel]) -> None:
    assert undocumented_fields(model) == []
    assert model.model_config.get("extra") == "forbid"


@pytest.mark.unit
def test_unknown_and_illtyped_fields_name_the_field(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('port = 1\nstore_dirr = "x"\n')
    with pytest.raises(ConfigError, match="'store_dirr': unknown field"):
        load_config(NatsServerConfig, f)
    f.write_text('port = "many"\n')
    with pytest.raises(ConfigError, match="'port'"):
        load_config(NatsServerConfig, f)
    with pytest.raises(ConfigError, match="'port'.*less than or equal"):
        load_config(NatsServerConfig, None, {"port": 70000})
    with pytest.raises(ConfigError, match="'run'"):
        load_config(ServiceConfig, None, {"run": "has.dot"})
    f.write_text("port = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(NatsServerConfig, f)


@pytest.mark.unit
def test_precedence_defaults_toml_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('port = 5000\nhost = "0.0.0.0"\n')
    cfg = load_config(NatsServerConfig, f, {"port": "6000"})
    assert (cfg.port, cfg.host, cfg.max_payload_mb) == (6000, "0.0.0.0", 8)
    assert load_config(NatsServerConfig, None, {}).port == 4222


@pytest.mark.integration
def test_print_config_roundtrips(tmp_path: Path) -> None:
    res = run_cli("nats", "--port", "1234", "--max-payload-mb", "16", "--print-config")
    assert res.returncode == 0, res.stderr
    assert "port = 1234" in res.stdout and "max_payload_mb = 16" in res.stdout
    f = tmp_path / "resolved.toml"
    f.write_text(res.stdout)
    assert load_config(NatsServerConfig, f) == load_config(
        NatsServerConfig, None, {"port": 1234, "max_payload_mb": 16}
    )
    assert dump_toml(load_config(NatsServerConfig, f)) == res.stdout


@pytest.mark.integration
def test_cli_rejects_bad_flag_value_naming_it() -> None:
    res = run_cli("nats", "--port", "-5", "--print-config")
    assert res.returncode == 2
    assert "'port'" in res.stderr


@pytest.mark.integration
def test_nats_command_serves_until_sigterm_and_leaves_nothing(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*HRL, "nats", "--port", "0", "--store-dir", str(tmp_path / "store"), "--insecure"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert "nats-server ready: nats://127.0.0.1:" in line, line + proc.stderr.read()  # type: ignore[union-attr]
    server_pid = int(line.split("pid ")[1].split(")")[0])
    assert pid_alive(server_pid)
    url = line.split("ready: ")[1].split()[0]
    import asyncio

    import nats

    async def check() -> None:
        nc = await nats.connect(url)
        info = await nc.jetstream().account_info()
        assert info is not None
        assert nc.max_payload == 8 * 1024 * 1024
        await nc.close()

    asyncio.run(check())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    wait_until(lambda: not pid_alive(server_pid), 5, "nats-server to exit with harnessrl nats")


@pytest.mark.integration
def test_nats_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """Even SIGKILL of `harnessrl nats` leaves no nats-server behind (PDEATHSIG)."""
    proc = subprocess.Popen(
        [*HRL, "nats", "--port", "0", "--store-dir", str(tmp_path / "s")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    server_pid = int(line.split("pid ")[1].split(")")[0])
    proc.kill()
    proc.wait()
    wait_until(lambda: not pid_alive(server_pid), 5, "nats-server to exit")

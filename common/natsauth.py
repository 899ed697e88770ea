"""Trust on the bus: per-role NATS credentials, server permissions, TLS, and the client side.

``harnessrl nats`` (``harnessrl.common.natsd``) writes, into its auth folder (``<store>/auth`` by default):

* ``<role>.cred`` (0600) for every role in `ROLES`: one line ``user:password``; the user is the
  role's name. Existing files are reused, so a restarted server accepts the clients it had.
* ``actors/actor-<i>.cred`` (0600): one credential *per actor* (``actors`` of them, ``--actors``
  of ``harnessrl nats``; user ``actor-<i>``). Actors do not share a credential: each may
  publish only under its own name (below), so the server itself binds every rollout's calls
  and result to the actor that ran it. Any ``actor-NAME.cred`` file added to the folder by hand
  (``ensure_actor_credentials``) is a user too; a running ``harnessrl nats`` picks new ones up
  within seconds (it reloads the server's configuration).
* ``route.cred`` (0600): the credential cluster nodes present to each other's route listener
  (``ROUTE_USER``; never a client user).
* ``tls/`` : ``ca.pem`` (the self-signed CA clients verify the server with, public),
  ``ca-key.pem`` (0600), ``server.pem`` / ``server-key.pem`` (0600), made on demand with the
  ``cryptography`` package when installed, else the ``openssl`` command. The server certificate
  serves clients and, in a cluster, routes: nats-server verifies routes both ways, so it is
  valid for server and client authentication.

The nodes of one cluster share one auth folder (copied to each machine, CA key included; each
node remakes its own server certificate for its ``tls_hosts`` from that CA): clients then hold
one credential and one CA for every node, and the nodes accept each other's routes.

Clients take *file paths* only (``nats_creds``, ``nats_ca`` in every config; never a secret on a
command line, which ``harnessrl run`` writes to ``commands.sh``). A credential file is either
that ``user:password`` line or a NATS ``.creds`` file (JWT + nkey seed) for operator-mode
deployments. `client_options` turns the paths into ``nats.connect`` options; the inbox prefix
is ``_INBOX.<user>``, so one role cannot subscribe to another role's replies and deliveries.

Least privilege, enforced by the server (`role_permissions`; ``R`` is a run name the server
was started for, ``S(K)`` the stream ``HRL_R_K``; every role may also subscribe to its own
``_INBOX.<role>.>`` and read ``$JS.API.STREAM.INFO`` of the run's streams)::

    role          publishes                      consumes (JetStream consumer API + acks)
    actor-A       hrl.R.calls.actor-A.>,         S(TASKS) durable "actors": info, fetch, ack
    (each actor)  hrl.R.rollouts.actor-A,        (never create or change it)
                  hrl.R.dead.tasks
    proxy         hrl.R.calls.proxy.>            -
    assembler     hrl.R.samples,                 S(ROLLOUTS) durable "assembler";
                  hrl.R.dead.rollouts,           S(CALLS) ephemeral readers (create/next/delete);
                  hrl.R.dead.calls               $JS.API.STREAM.MSG.GET.S(KEYS) (the claim key)
    learner       hrl.R.tasks, hrl.R.weights.>   S(SAMPLES) durable "learner";
                  hrl.R.dead.samples,            $JS.API.STREAM.PURGE.S(WEIGHTS) (old versions);
                  hrl.R.keys.claims (the run's   $JS.API.STREAM.MSG.GET.S(TASKS|ROLLOUTS|KEYS)
                  claim key, made once)          (read-only: what a resumed feeder re-issues,
                                                 the claim key);
                                                 S(TASKS) durable "actors": create, change,
                                                 info (the feeder owns it)
    weights_sync  hrl.R.dead.weights             S(WEIGHTS): durables and ephemeral readers
    admin         everything (">")               everything: creates, updates, deletes streams

Consumer API grants are per stream and per consumer name: ``$JS.API.CONSUMER.{DURABLE.CREATE,
CREATE,INFO,MSG.NEXT}.S.NAME`` and ``$JS.ACK.S.NAME.>``; nobody but admin may create, update or
delete streams. Creating a consumer also updates an existing one's settings, so a consumer
shared by many processes of one role (the actors' task consumer) is created by the side that
owns its stream, never by its users: an actor that could create it could send back its config
with another filter or ``max_ack_pending: 1`` and stall every actor of the run. Deleting
consumers is granted only for the per-subject readers, on the one stream whose consumers all
belong to that role (CALLS: assembler; WEIGHTS: weights_sync), so no role can delete another
role's consumer. A refused publish or API call reaches the client
as an asynchronous ``Permissions Violation`` (``harnessrl.common.bus_nats`` turns it into
``PermissionDenied`` for the call that caused it).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.common.files import SecretFileError, atomic_write, read_secret

ROLES = ("admin", "learner", "assembler", "proxy", "weights_sync")
"""Roles with their own credential file (``<auth_dir>/<role>.cred``). Actors have one each
(``<auth_dir>/actors/actor-<name>.cred``)."""

ACTOR_PREFIX = "actor-"
"""User names of actor credentials: ``actor-<name>``; the user is the actor's subject token."""
ACTORS_DIR = "actors"
"""Folder of the per-actor credentials in an auth folder."""
DEFAULT_ACTORS = 16
"""Actor credentials ``harnessrl nats`` makes by default (``--actors``)."""

ROUTE_USER = "route"
"""User of the cluster routes (``<auth_dir>/route.cred``)."""

JWT_CREDS_MARK = "-----BEGIN NATS USER JWT-----"

# durable consumer names (the services' own constants; a test checks they agree)
ACTOR_DURABLE = "actors"
ASSEMBLER_DURABLE = "assembler"
LEARNER_DURABLE = "learner"


class AuthError(SecretFileError):
    """Credentials or TLS files are missing, unreadable or malformed; the message names the file."""


# ---------------------------------------------------------------------------------------------
# permissions
# ---------------------------------------------------------------------------------------------


def _stream(run: str, kind: str) -> str:
    return f"HRL_{run}_{kind}"


def _consumer(
    run: str, kind: str, name: str, *, ack: bool = True, create: bool = True, use: bool = True
) -> list[str]:
    """JS API subjects to create (``create``: creating also updates an existing one's
    settings), bind to and pull from (``use``), and ack (``ack``) consumer ``name`` of a
    stream; ``name`` may be ``*`` (any consumer of that stream)."""
    s = _stream(run, kind)
    api = "$JS.API.CONSUMER"
    out = [f"{api}.INFO.{s}.{name}"]
    if create:
        out += [
            f"{api}.DURABLE.CREATE.{s}.{name}",
            f"{api}.CREATE.{s}.{name}",
            f"{api}.CREATE.{s}.{name}.>",
        ]
    if use:
        out.append(f"{api}.MSG.NEXT.{s}.{name}")
    return [*out, f"$JS.ACK.{s}.{name}.>"] if use and ack else out


def _reader(run: str, kind: str) -> list[str]:
    """Ephemeral per-subject readers (``Bus.read_subject``): create, pull, delete any consumer
    of this one stream."""
    s = _stream(run, kind)
    return [*_consumer(run, kind, "*", ack=False), f"$JS.API.CONSUMER.DELETE.{s}.*"]


def _run_grants(role: str, run: str) -> list[str]:
    p = f"hrl.{run}"
    info = [f"$JS.API.STREAM.INFO.{_stream(run, k)}" for k in STREAM_KINDS]
    keys = f"$JS.API.STREAM.MSG.GET.{_stream(run, 'KEYS')}"
    if role.startswith(ACTOR_PREFIX):
        # its own calls and results only: the server binds each rollout to the actor that ran it
        own = [f"{p}.calls.{role}.>", f"{p}.rollouts.{role}", f"{p}.dead.tasks"]
        # the shared task consumer is the learner's: an actor may not create or change it
        return [*info, *own, *_consumer(run, "TASKS", ACTOR_DURABLE, create=False)]
    if role == "proxy":
        return [*info, f"{p}.calls.proxy.>"]
    if role == "assembler":
        own = [f"{p}.samples", f"{p}.dead.rollouts", f"{p}.dead.calls", keys]
        return [*info, *own, *_consumer(run, "ROLLOUTS", ASSEMBLER_DURABLE), *_reader(run, "CALLS")]
    if role == "learner":
        own = [f"{p}.tasks", f"{p}.weights.>", f"{p}.dead.samples", f"{p}.keys.claims"]
        purge = f"$JS.API.STREAM.PURGE.{_stream(run, 'WEIGHTS')}"
        read = [f"$JS.API.STREAM.MSG.GET.{_stream(run, k)}" for k in ("TASKS", "ROLLOUTS", "KEYS")]
        tasks = _consumer(run, "TASKS", ACTOR_DURABLE, use=False)  # it owns the actors' consumer
        own += [purge, *read, *tasks]
        return [*info, *own, *_consumer(run, "SAMPLES", LEARNER_DURABLE)]
    if role == "weights_sync":
        own = [f"{p}.dead.weights"]
        return [*info, *own, *_consumer(run, "WEIGHTS", "*"), *_reader(run, "WEIGHTS")]
    raise AuthError(f"unknown role {role!r} (roles: {', '.join(ROLES)}, {ACTOR_PREFIX}NAME)")


STREAM_KINDS = ("TASKS", "CALLS", "ROLLOUTS", "SAMPLES", "WEIGHTS", "DEAD", "KEYS")
"""The stream kinds of ``harnessrl.common.bus.STREAMS`` (a test checks they agree)."""


def inbox_prefix(user: str) -> str:
    """The reply/delivery subject prefix of a user: ``_INBOX.<user>``."""
    return f"_INBOX.{user}"


def role_permissions(role: str, runs: list[str]) -> dict[str, Any]:
    """nats-server ``permissions`` of ``role`` (or actor user ``actor-NAME``) over ``runs``
    (see the module docstring)."""
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    pub: list[str] = []
    for run in runs:
        pub += _run_grants(role, run)
    return {"publish": {"allow": pub}, "subscribe": {"allow": [inbox_prefix(role) + ".>"]}}


# ---------------------------------------------------------------------------------------------
# server side: credentials, authorization block, TLS files
# ---------------------------------------------------------------------------------------------


@dataclass
class ServerAuth:
    """What ``harnessrl.common.natsd.NatsServer`` needs to require credentials (and TLS)."""

    auth_dir: Path
    """Folder of ``<role>.cred`` files (and ``tls/`` when generated)."""
    runs: list[str]
    """Runs the role permissions cover."""
    passwords: dict[str, str]
    """Role -> password."""
    actors: dict[str, str] = field(default_factory=dict)
    """Actor user (``actor-NAME``) -> password."""
    tls_cert: Path | None = None
    """Server certificate (PEM); None serves plain TCP."""
    tls_key: Path | None = None
    """Its private key (PEM)."""
    ca: Path | None = None
    """CA file clients verify the server with (None: the certificate is publicly trusted)."""

    def creds(self, role: str) -> Path:
        """Credential file of ``role`` (or of ``ROUTE_USER``, or of actor ``actor-NAME``)."""
        if role.startswith(ACTOR_PREFIX):
            return self.auth_dir / ACTORS_DIR / f"{role}.cred"
        return self.auth_dir / f"{role}.cred"

    def refresh_actors(self) -> bool:
        """Re-read the actor credentials of the folder; whether they changed."""
        now = read_actor_credentials(self.auth_dir)
        changed, self.actors = now != self.actors, now
        return changed

    def route_url(self, hostport: str) -> str:
        """The route URL of a cluster node, with the route credential in it."""
        return f"nats-route://{ROUTE_USER}:{self.passwords[ROUTE_USER]}@{hostport}"

    def route_block(self) -> str:
        """The ``authorization`` (and ``tls``) lines of the ``cluster`` block: a node accepts
        routes that present the route credential, over TLS verified both ways with ``ca``."""
        auth = {"user": ROUTE_USER, "password": self.passwords[ROUTE_USER], "timeout": 5}
        text = f"  authorization: {json.dumps(auth)}\n"
        if self.tls_cert is not None:
            text += f"  tls {{\n{self._tls_files('    ', ca=True)}  }}\n"
        return text

    def _tls_files(self, indent: str, *, ca: bool) -> str:
        text = (
            f"{indent}cert_file: {json.dumps(str(self.tls_cert))}\n"
            f"{indent}key_file: {json.dumps(str(self.tls_key))}\n"
        )
        if ca and self.ca is not None:
            text += f"{indent}ca_file: {json.dumps(str(self.ca))}\n"
        return text + f"{indent}timeout: 5\n"

    def conf_block(self) -> str:
        """The ``authorization`` (and ``tls``) blocks of the server's config file."""
        users = []
        for role, password in [*((r, self.passwords[r]) for r in ROLES), *self.actors.items()]:
            users.append(
                {
                    "user": role,
                    "password": password,
                    "permissions": role_permissions(role, self.runs),
                }
            )
        # nats-server's config syntax accepts JSON values
        text = f"authorization {{\n  users: {json.dumps(users, indent=2)}\n}}\n"
        if self.tls_cert is not None:
            text += f"tls {{\n{self._tls_files('  ', ca=False)}}}\n"
        return text


def ensure_credentials(auth_dir: Path | str) -> dict[str, str]:
    """One ``<role>.cred`` per role in ``auth_dir`` (0700), and ``route.cred``, made once and
    reused; user -> password."""
    d = Path(auth_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    out = {}
    for role in (*ROLES, ROUTE_USER):
        path = d / f"{role}.cred"
        if path.exists():
            user, password = parse_userpass(path)
            if user != role:
                raise AuthError(f"{path}: user {user!r} is not the role {role!r}")
        else:
            password = secrets.token_urlsafe(24)
            atomic_write(path, f"{role}:{password}\n", mode=0o600)
        out[role] = password
    return out


def ensure_actor_credentials(
    auth_dir: Path | str, count: int = 0, names: list[str] | tuple[str, ...] = ()
) -> dict[str, str]:
    """Make ``actors/actor-<i>.cred`` for ``i < count`` and ``actors/actor-<name>.cred`` for
    each of ``names`` where missing (0600, the folder 0700); return every actor credential of
    the folder (user -> password), those already there included."""
    d = Path(auth_dir) / ACTORS_DIR
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in [*(str(i) for i in range(count)), *names]:
        user = name if name.startswith(ACTOR_PREFIX) else ACTOR_PREFIX + name
        _check_actor_user(user)
        path = d / f"{user}.cred"
        if not path.exists():
            atomic_write(path, f"{user}:{secrets.token_urlsafe(24)}\n", mode=0o600)
    return read_actor_credentials(auth_dir)


def read_actor_credentials(auth_dir: Path | str) -> dict[str, str]:
    """Every ``actors/actor-NAME.cred`` of an auth folder: user -> password (the user must be
    the file's name)."""
    d = Path(auth_dir) / ACTORS_DIR
    out = {}
    for path in sorted(d.glob(f"{ACTOR_PREFIX}*.cred")) if d.is_dir() else []:
        user, password = parse_userpass(path)
        if user != path.stem:
            raise AuthError(f"{path}: user {user!r} is not the file's name {path.stem!r}")
        _check_actor_user(user)
        out[user] = password
    return out


def _check_actor_user(user: str) -> None:
    name = user.removeprefix(ACTOR_PREFIX)
    if not name or any(not (c.isascii() and (c.isalnum() or c in "-_")) for c in name):
        raise AuthError(f"actor credential name {user!r}: use letters, digits, '-' and '_'")


_claimed: dict[str, Any] = {}
"""Credential pool folder -> (open lock file, claimed path), for the life of the process."""


def claim_credential(pool: Path | str) -> Path:
    """One credential of a pool folder (an auth folder's ``actors/``, shared by the actors of a
    machine or a compose service) that no other process holds: an exclusive lock on it is
    taken and kept for the life of this process (freed when it exits, however it exits). The
    same folder claimed again in this process gives the same credential."""
    import fcntl

    key = str(Path(pool).resolve())
    if key in _claimed:
        return _claimed[key][1]
    files = sorted(Path(pool).glob("*.cred"))
    if not files:
        raise AuthError(f"NATS credentials folder {pool} holds no *.cred file")
    for path in files:
        f = open(path, "rb")  # noqa: SIM115 - held open: the lock lives as long as the process
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        _claimed[key] = (f, path)
        return path
    raise AuthError(
        f"every credential in {pool} ({len(files)}) is held by another process: make more "
        "(harnessrl nats --actors N, or ensure_actor_credentials)"
    )


def parse_userpass(path: Path | str) -> tuple[str, str]:
    """``(user, password)`` of a ``user:password`` credential file."""
    text = read_secret(path, "NATS credentials file")
    user, sep, password = text.partition(":")
    if not sep or not user or not password or "\n" in text:
        raise AuthError(f"NATS credentials file {path}: expected one line 'user:password'")
    return user, password


def default_tls_hosts(host: str) -> list[str]:
    """Names and addresses a generated server certificate covers: loopback, this machine's
    name, and ``host`` when it is a specific address."""
    hosts = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    if host and host not in ("0.0.0.0", "::", ""):
        hosts.append(host)
    return list(dict.fromkeys(hosts))


def ensure_tls(tls_dir: Path | str, hosts: list[str]) -> tuple[Path, Path, Path]:
    """``(ca.pem, server.pem, server-key.pem)`` in ``tls_dir``: a self-signed CA made once and
    a certificate for ``hosts`` (remade when the hosts change), valid for server and client
    authentication (clients see the server side; cluster routes verify both sides)."""
    d = Path(tls_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    ca, ca_key = d / "ca.pem", d / "ca-key.pem"
    cert, key, meta = d / "server.pem", d / "server-key.pem", d / "server-hosts.json"
    make = _make_with_cryptography if _has_cryptography() else _make_with_openssl
    if not (ca.exists() and ca_key.exists()):
        make(d, hosts, ca_only=True)
    # what the certificate is for: remade when either changes (certificates made before routes
    # existed were for server authentication only)
    want = {"hosts": sorted(hosts), "usage": ["serverAuth", "clientAuth"]}
    have = json.loads(meta.read_text()) if meta.exists() else None
    if have != want or not (cert.exists() and key.exists()):
        make(d, hosts, ca_only=False)
        atomic_write(meta, json.dumps(want))
    os.chmod(ca, 0o644)
    return ca, cert, key


def _has_cryptography() -> bool:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return False
    return True


def _san_entries(hosts: list[str]) -> list[tuple[str, str]]:
    out = []
    for h in hosts:
        try:
            out.append(("IP", str(ipaddress.ip_address(h))))
        except ValueError:
            out.append(("DNS", h))
    return out


def _make_with_openssl(d: Path, hosts: list[str], *, ca_only: bool) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise AuthError(
            "cannot make TLS certificates: neither the `cryptography` package nor the `openssl` "
            "command is installed (install one, or pass --tls-cert/--tls-key)"
        )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    old = os.umask(0o077)
    try:
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            t = Path(tmp)
            if ca_only:
                _openssl(
                    exe,
                    "req", "-x509", *ec, "-keyout", str(t / "ca-key.pem"),
                    "-out", str(t / "ca.pem"), "-days", "3650",
                    "-subj", "/CN=harnessrl local NATS CA",
                    "-addext", "basicConstraints=critical,CA:TRUE",
                    "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                )  # fmt: skip
                os.replace(t / "ca-key.pem", d / "ca-key.pem")
                os.replace(t / "ca.pem", d / "ca.pem")
                return
            san = ",".join(f"{k}:{v}" for k, v in _san_entries(hosts))
            (t / "ext.cnf").write_text(
                f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth,clientAuth\nsubjectKeyIdentifier=hash\n"
                "authorityKeyIdentifier=keyid:always\n"
            )
            _openssl(
                exe, "req", *ec, "-keyout", str(t / "server-key.pem"),
                "-out", str(t / "server.csr"), "-subj", "/CN=harnessrl nats",
            )  # fmt: skip
            _openssl(
                exe, "x509", "-req", "-in", str(t / "server.csr"), "-CA", str(d / "ca.pem"),
                "-CAkey", str(d / "ca-key.pem"), "-CAcreateserial", "-out", str(t / "server.pem"),
                "-days", "825", "-extfile", str(t / "ext.cnf"),
            )  # fmt: skip
            os.replace(t / "server-key.pem", d / "server-key.pem")
            os.replace(t / "server.pem", d / "server.pem")
    finally:
        os.umask(old)


def _openssl(*argv: str) -> None:
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise AuthError(f"openssl {argv[1]} failed: {p.stderr.strip()[-500:]}")


def _make_with_cryptography(d: Path, hosts: list[str], *, ca_only: bool) -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(k: Any) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    now = datetime.datetime.now(datetime.UTC)
    if ca_only:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "harnessrl local NATS CA")])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        atomic_write(d / "ca-key.pem", pem_key(key), mode=0o600)
        atomic_write(d / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        return
    ca_key = serialization.load_pem_private_key((d / "ca-key.pem").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address(v)) if k == "IP" else x509.DNSName(v)
        for k, v in _san_entries(hosts)
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "harnessrl nats")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    atomic_write(d / "server-key.pem", pem_key(key), mode=0o600)
    atomic_write(d / "server.pem", cert.public_bytes(serialization.Encoding.PEM), mode=0o644)


def prepare_server_auth(
    auth_dir: Path | str,
    runs: list[str],
    *,
    tls: bool = True,
    host: str = "127.0.0.1",
    tls_hosts: list[str] | None = None,
    tls_cert: str = "",
    tls_key: str = "",
    tls_ca: str = "",
    actors: int = DEFAULT_ACTORS,
) -> ServerAuth:
    """Credentials (made or reused: one per role, ``actors`` per-actor ones) and TLS files for
    a server: the user's certificate and key when given, else a self-signed CA and server
    certificate in ``<auth_dir>/tls``."""
    auth_dir = Path(auth_dir).resolve()
    passwords = ensure_credentials(auth_dir)
    sa = ServerAuth(auth_dir, list(runs), passwords, ensure_actor_credentials(auth_dir, actors))
    if not tls:
        return sa
    if bool(tls_cert) != bool(tls_key):
        raise AuthError("tls_cert and tls_key go together")
    if tls_cert:
        for p in (tls_cert, tls_key, tls_ca):
            if p and not os.access(p, os.R_OK):
                raise AuthError(f"TLS file {p} is missing or unreadable")
        sa.tls_cert, sa.tls_key = Path(tls_cert).resolve(), Path(tls_key).resolve()
        sa.ca = Path(tls_ca).resolve() if tls_ca else None
        return sa
    hosts = list(dict.fromkeys([*default_tls_hosts(host), *(tls_hosts or [])]))
    sa.ca, sa.tls_cert, sa.tls_key = ensure_tls(auth_dir / "tls", hosts)
    return sa


# ---------------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------------


def tls_context(ca_file: str = "") -> ssl.SSLContext:
    """A client TLS context that verifies the server with ``ca_file`` (empty: system CAs)."""
    if ca_file and not os.access(ca_file, os.R_OK):
        raise AuthError(f"NATS CA file {ca_file} is missing or unreadable")
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except ssl.SSLError as e:
        raise AuthError(f"NATS CA file {ca_file}: not a PEM certificate ({e})") from None


def client_options(creds: str = "", ca: str = "", url: str = "") -> dict[str, Any]:
    """``nats.connect`` keyword options for a credential file and a CA file (either may be
    empty): user/password or ``user_credentials``, the user's inbox prefix, a TLS context when
    ``ca`` is set or the URL says ``tls://``. ``creds`` may be a folder of credentials (the
    per-actor ones): one no other process holds is claimed (`claim_credential`)."""
    out: dict[str, Any] = {}
    if creds and Path(creds).is_dir():  # a pool of per-actor credentials: take a free one
        creds = str(claim_credential(creds))
    if creds:
        text = read_secret(creds, "NATS credentials file")
        if JWT_CREDS_MARK in text:
            out["user_credentials"] = str(creds)
        else:
            user, password = parse_userpass(creds)
            out.update(user=user, password=password, inbox_prefix=inbox_prefix(user))
    if ca or url.startswith("tls://"):
        out["tls"] = tls_context(ca)
    return out

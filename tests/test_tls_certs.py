"""The TLS certificates ``harnessrl nats`` makes, by either maker (the ``cryptography`` package
or the ``openssl`` command): a client that trusts the CA completes a handshake with a server
holding the certificate, for every host name it was made for, and refuses another name."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest

from harnessrl.common import natsauth

pytestmark = pytest.mark.integration

MAKERS = ["cryptography", "openssl"]


def handshake(ca: Path, cert: Path, key: Path, host: str) -> None:
    """A TLS 1.2+ handshake in memory: server with ``cert``/``key``, client verifying ``host``
    against ``ca``. Raises ``ssl.SSLError`` (``SSLCertVerificationError``) when it fails."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=host)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for name, end, out, peer_in in (
            ("client", client, c_out, s_in),
            ("server", server, s_out, c_in),
        ):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            if out.pending:
                peer_in.write(out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


@pytest.fixture(params=MAKERS)
def maker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cryptography":
        pytest.importorskip("cryptography")
        monkeypatch.setattr(natsauth, "_has_cryptography", lambda: True)
    else:
        if shutil.which("openssl") is None:
            pytest.skip("no openssl command")
        monkeypatch.setattr(natsauth, "_has_cryptography", lambda: False)
    return request.param


def test_certificates_verify_for_their_hosts(tmp_path: Path, maker: str):
    ca, cert, key = natsauth.ensure_tls(tmp_path / "tls", ["localhost", "127.0.0.1", "nats-0"])
    for host in ("localhost", "127.0.0.1", "nats-0"):
        handshake(ca, cert, key, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(ca, cert, key, "elsewhere.example")
    assert (tmp_path / "tls" / "server-key.pem").stat().st_mode & 0o077 == 0


def test_new_hosts_remake_the_certificate_not_the_ca(tmp_path: Path, maker: str):
    ca, cert, key = natsauth.ensure_tls(tmp_path / "tls", ["localhost"])
    ca_before = ca.read_bytes()
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(ca, cert, key, "nats-1")
    ca, cert, key = natsauth.ensure_tls(tmp_path / "tls", ["localhost", "nats-1"])
    handshake(ca, cert, key, "nats-1")
    assert ca.read_bytes() == ca_before

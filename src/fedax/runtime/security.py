"""TLS credentials from files, client tokens, and a throwaway PKI for trying things out.

Every connection is TLS (grpcio's ``ssl_server_credentials`` /
``ssl_channel_credentials``); the server never opens a plaintext port, so a plaintext
client fails its handshake. Clients authenticate with a bearer token sent as gRPC metadata
on every call (``fedax-client-id``, ``fedax-token``), over that TLS channel. The server
keeps a registry file mapping each client id to the SHA-256 of its token and a ``revoked``
flag; an unknown id, a wrong token or a revoked client is refused with
``UNAUTHENTICATED`` before anything else happens. (Flower's SuperNode authentication signs a
timestamp with an EC key registered at the SuperLink instead; docs/references.md, deployment
runtime. A token is the simpler of the two the issue allows, and the registry stores no secret.)

``make_dev_pki`` writes a CA, a server certificate for the given host names and a token per
client with ``cryptography``; use it for tests and for a first run on one machine, and a
real CA for deployments (docs/deployment.md).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedax.io import write_atomic, write_json

CLIENT_ID_KEY = "fedax-client-id"
TOKEN_KEY = "fedax-token"


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read the {what} {str(path)!r} ({err.strerror}); pass an "
                         "existing PEM file (fedax server init writes a test set)") from None


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and private key (PEM files)."""

    cert: str
    key: str

    def credentials(self):
        import grpc

        return grpc.ssl_server_credentials(
            [(_read(self.key, "server key"), _read(self.cert, "server certificate"))])


@dataclass(frozen=True)
class ClientTLS:
    """The CA certificate (PEM) a client checks the server's certificate against, and
    optionally the host name to expect in it (default: the address's host)."""

    ca: str
    server_name: str | None = None

    def credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "CA certificate"))


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Registry:
    """Registered clients: id -> (SHA-256 of the token, revoked)."""

    clients: Mapping[int, tuple[str, bool]]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Registry:
        """Read ``{"clients": {"<id>": {"sha256": "...", "revoked": false}}}``."""
        try:
            data = json.loads(_read(path, "client registry"))
            clients = {int(k): (str(v["sha256"]), bool(v.get("revoked", False)))
                       for k, v in data["clients"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"client registry {str(path)!r} is not valid ({err}); expected "
                             '{"clients": {"0": {"sha256": ..., "revoked": false}}}') from None
        return cls(clients)

    @classmethod
    def of_tokens(cls, tokens: Mapping[int, str], revoked: Iterable[int] = ()) -> Registry:
        revoked = set(revoked)
        return cls({int(k): (token_hash(t), int(k) in revoked) for k, t in tokens.items()})

    def save(self, path: str | os.PathLike[str]) -> None:
        data = {"clients": {str(k): {"sha256": h, "revoked": r}
                            for k, (h, r) in sorted(self.clients.items())}}
        write_json(path, data, indent=1)

    def check(self, client_id: str | None, token: str | None) -> tuple[int | None, str]:
        """``(client id, "")`` if the credentials are good, else ``(None, reason)``."""
        cid = None  # ASCII digits only (int() would also take "٠" for 0), not too many
        if (client_id is not None and client_id.isascii() and client_id.isdigit()
                and len(client_id) <= 18):
            cid = int(client_id)
        if cid is None or token is None:
            return None, "no client id or token"
        entry = self.clients.get(cid)
        if entry is None:
            return None, f"unknown client {cid}"
        if not hmac.compare_digest(entry[0], token_hash(token)):
            return None, f"wrong token for client {cid}"
        if entry[1]:
            return None, f"client {cid} is revoked"
        return cid, ""


def key_words(material: bytes) -> np.ndarray:
    """Threefry key data (two uint32 words) from secret ``material``: the first 8 bytes of
    its SHA-256. JAX's key holds 64 bits; the secret behind it may hold more."""
    return np.frombuffer(hashlib.sha256(material).digest()[:8], np.uint32).copy()


def train_key(secret: bytes, t: int) -> np.ndarray:
    """Raw threefry key data for round t from a client's secret: the first 8 bytes of
    SHA-256(secret ‖ t as 8 bytes)."""
    return key_words(secret + int(t).to_bytes(8, "little"))


def load_or_make_secret(path: Path) -> bytes:
    """The 32-byte secret in ``path`` (64 hex digits), made with ``os.urandom`` and written
    atomically with mode 0600 if the file does not exist yet."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".client_seed.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(32).hex())
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # fails if another process made it first: keep theirs
        except FileExistsError:
            pass
        finally:
            Path(tmp).unlink(missing_ok=True)
    text = path.read_text().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != 32:
        raise ValueError(f"{path} does not hold a 256-bit secret (64 hex digits); delete it "
                         "to draw a new one")
    return secret


def metadata(client_id: int, token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a client."""
    return ((CLIENT_ID_KEY, str(int(client_id))), (TOKEN_KEY, token))


def new_token() -> str:
    return secrets.token_urlsafe(32)


def make_dev_pki(directory: str | os.PathLike[str], num_clients: int,
                 hosts: Iterable[str] = ("localhost", "127.0.0.1"),
                 days: int = 30) -> dict[str, Any]:
    """A throwaway CA, a server certificate for ``hosts`` signed by it, and a token per
    client, written to ``directory``: ``ca.pem``, ``server.pem``, ``server.key``,
    ``registry.json`` and ``tokens/<id>.token``; and each client's SecAgg+ identity key
    (``identities/<id>.key``) with the ``roster.json`` of their verification keys (in a
    deployment each client makes its own, ``fedax client --new-identity``, and the operator
    gathers the public halves). Returns the paths (and the tokens).

    Keys are EC P-256; the CA key is not kept (nothing more can be signed with it).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(directory)
    (out / "tokens").mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedax test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            import ipaddress

            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    hosts = list(hosts)
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
                   .issuer_name(ca_name).public_key(server_key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    write_atomic(out / "ca.pem", ca_cert.public_bytes(pem))
    write_atomic(out / "server.pem", server_cert.public_bytes(pem))
    write_atomic(out / "server.key", server_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), mode=0o600)
    tokens = {k: new_token() for k in range(int(num_clients))}
    for k, token in tokens.items():
        write_atomic(out / "tokens" / f"{k}.token", token.encode(), mode=0o600)
    from fedax.runtime.secagg.identity import IdentityKey, Roster

    (out / "identities").mkdir(exist_ok=True)
    identities = {k: IdentityKey.generate() for k in tokens}
    for k, identity in identities.items():
        identity.save(out / "identities" / f"{k}.key")
    Roster.of(identities).save(out / "roster.json")
    Registry.of_tokens(tokens).save(out / "registry.json")
    return {"ca": str(out / "ca.pem"), "cert": str(out / "server.pem"),
            "key": str(out / "server.key"), "registry": str(out / "registry.json"),
            "roster": str(out / "roster.json"), "tokens": tokens}


# A failed connection's (cause, what to do, worth retrying); see ``probe``.
Problem = tuple[str, str, bool]

_PROXY_VARS = ("grpc_proxy", "https_proxy", "http_proxy")


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a plain ``host:port`` / ``[v6]:port`` address; ``None`` for
    anything else gRPC accepts (``dns:///...``, ``unix:...``, no port)."""
    if "/" in address or address.startswith(("unix:", "ipv4:", "ipv6:", "vsock:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None
    return host, int(port)


def probe(address: str, tls: ClientTLS, timeout_s: float = 5.0) -> Problem | None:
    """Why a client cannot reach a TLS server at ``address``, or ``None`` if it can.

    A plain TCP connection and a TLS handshake (Python's ``ssl``, ALPN h2) verified against
    ``tls.ca`` and ``tls.server_name`` (else the address's host), as gRPC verifies it; it
    tells apart an unknown host, a refused connection, no answer, and a certificate that is
    not signed by the CA or not valid for the name, which gRPC reports only as
    ``UNAVAILABLE`` (after logging the handshake from its C core). Returns ``(cause, what
    to do, worth retrying)``. ``None`` too when the address is not a plain ``host:port``
    or a proxy is configured (gRPC would connect through it): the caller then relies on
    gRPC's own error."""
    import socket
    import ssl

    parts = split_address(address)
    if parts is None or any(os.environ.get(v) or os.environ.get(v.upper())
                            for v in _PROXY_VARS):
        return None
    host, port = parts
    ca = _read(tls.ca, "CA certificate")
    try:
        context = ssl.create_default_context(cadata=ca.decode())
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"the CA certificate {tls.ca!r} is not a PEM certificate ({err}); "
                         "pass the ca.pem of the server's setup") from None
    context.set_alpn_protocols(["h2"])
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as err:
        return (f"unknown host {host!r} ({err.strerror})",
                "check the host name in the server address (--server)", True)
    except ConnectionRefusedError:
        return ("connection refused",
                f"check that the server runs and listens on port {port}", True)
    except TimeoutError:
        return (f"no answer within {timeout_s:g} s",
                f"check the address and that no firewall blocks port {port}", True)
    except OSError as err:
        return ((err.strerror or str(err)).lower(), "check the address and the network", True)
    name = tls.server_name or host
    with sock:
        try:
            with context.wrap_socket(sock, server_hostname=name):
                pass
        except ssl.SSLCertVerificationError as err:
            if err.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_
                return (f"TLS verification failed: the server's certificate is not valid "
                        f"for {name!r}", "connect by a name the certificate lists (fedax "
                        "server init --hosts) or pass that name with --server-name", False)
            if err.verify_code in (9, 10):  # X509_V_ERR_CERT_NOT_YET_VALID, _HAS_EXPIRED
                return (f"TLS verification failed: {err.verify_message}",
                        "renew the server's certificate (or check this machine's clock)",
                        False)
            return (f"TLS verification failed: {err.verify_message} (the server's "
                    f"certificate is not signed by the CA in {str(tls.ca)!r})",
                    "pass the CA that signed the server's certificate with --ca (fedax "
                    "server init writes it as ca.pem)", False)
        except (ssl.SSLError, OSError) as err:
            reason = getattr(err, "reason", None) or err.strerror or str(err) or type(
                err).__name__
            return (f"TLS handshake failed ({str(reason).lower()})",
                    f"check that {address} is a fedax server's port (it speaks TLS only)",
                    True)
    return None


def read_token(path: str | os.PathLike[str]) -> str:
    token = _read(path, "client token").decode().strip()
    if not token:
        raise ValueError(f"the token file {str(path)!r} is empty; use the file fedax server "
                         "init wrote for this client")
    return token

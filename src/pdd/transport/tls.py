"""Mutual TLS for the links that cross datacenters: the deployment CA,
certificates bound to instance names, SSL contexts, and where TLS applies.

Trust model: one CA per deployment. Every instance and the router hold a
certificate whose only subjectAltName is their name (DNS type), signed by
that CA. A client checks that the server's certificate names the instance it
meant to reach (`server_hostname`, even though the address is the WAN
relay's); a server checks that the client's certificate names a peer that may
call it (the router on the HTTP API, a prefill instance on the KV port). A
certificate from another CA, or from this CA for another name, is refused.
TLS 1.3 only: AEAD records (AES-GCM / ChaCha20-Poly1305), so a byte altered
on the wire fails its MAC and the connection dies; the shared-secret
challenge-response still runs inside (defence in depth, and the only check
where TLS is off).

Files in one directory (`pdd up` creates it as RUN_DIR/tls with a fresh CA
unless the deployment file's `[tls] dir` names the operator's own):
    ca.crt                the trust anchor, read by every process
    ca.key                only where certificates are issued; no server reads it
    NAME.crt, NAME.key    one pair per instance, and `router`

Placement (`http_tls`, `kv_tls`) is pure over the spec, so a client and the
server it calls always agree on whether a port speaks TLS.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

from pdd.deploy.spec import ROUTER_CERT_NAME, DeploymentSpec, InstanceSpec, Role, TlsMode

CERT_VALIDITY = datetime.timedelta(days=365)


class TlsError(RuntimeError):
    pass


# -- where TLS applies (pure) ----------------------------------------------------
def http_tls(spec: DeploymentSpec, inst: InstanceSpec) -> bool:
    """The instance's HTTP API speaks TLS: its only internal client, the router, sits across the WAN."""
    if spec.tls.mode == TlsMode.ALL:
        return True
    return spec.tls.mode == TlsMode.WAN and inst.datacenter != spec.router_datacenter


def kv_tls(spec: DeploymentSpec, inst: InstanceSpec) -> bool:
    """The instance's KV port speaks TLS: some prefill instance sends to it across the WAN.
    One port cannot speak both, so a local sender then uses TLS too."""
    if not inst.role.decodes or spec.tls.mode == TlsMode.OFF:
        return False
    if spec.tls.mode == TlsMode.ALL:
        return True
    return any(p.datacenter != inst.datacenter for p in spec.by_role(Role.PREFILL))


def kv_senders(spec: DeploymentSpec) -> frozenset[str]:
    """Certificate names a KV receiver accepts: the prefill instances."""
    return frozenset(p.name for p in spec.by_role(Role.PREFILL))


def uses_tls(spec: DeploymentSpec) -> bool:
    return any(http_tls(spec, i) or kv_tls(spec, i) for i in spec.instances)


def cert_names(spec: DeploymentSpec) -> list[str]:
    return [i.name for i in spec.instances] + [ROUTER_CERT_NAME]


# -- files ------------------------------------------------------------------------
@dataclass(frozen=True)
class TlsFiles:
    """One process's view of the deployment's certificate directory."""
    dir: Path
    name: str               # whose certificate this process presents

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def cert(self) -> Path:
        return self.dir / f"{self.name}.crt"

    @property
    def key(self) -> Path:
        return self.dir / f"{self.name}.key"

    def check(self) -> None:
        missing = [str(p) for p in (self.ca, self.cert, self.key) if not p.is_file()]
        if missing:
            raise TlsError(f"TLS is on but certificate files are missing: {', '.join(missing)}")


def ensure_certs(spec: DeploymentSpec, run_dir: Path) -> Path | None:
    """The certificate directory of a deployment about to start (None: TLS off).
    The operator's directory must already hold every file; else a fresh CA
    and certificates are made under run_dir (a new CA on every `pdd up`, so a
    key of an earlier run is worth nothing)."""
    if not uses_tls(spec):
        return None
    if spec.tls.dir is not None:
        for name in cert_names(spec):
            TlsFiles(spec.tls.dir, name).check()
        return spec.tls.dir
    cert_dir = run_dir / "tls"
    issue_deployment_certs(cert_dir, cert_names(spec), ca_name=f"PDD deployment CA ({spec.name})")
    return cert_dir


def issue_deployment_certs(cert_dir: Path, names: list[str], ca_name: str = "PDD deployment CA") -> None:
    """Write a new CA and one certificate per name into cert_dir (keys 0600)."""
    ca_key, ca_cert = make_ca(ca_name)
    cert_dir.mkdir(parents=True, exist_ok=True)
    _write_pair(cert_dir, "ca", ca_key, ca_cert)
    for name in names:
        key, cert = issue_cert(ca_key, ca_cert, name)
        _write_pair(cert_dir, name, key, cert)


# -- certificates (the `cryptography` package; imported lazily: only `pdd up` needs it) --
def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    # P-256: the handshake's signature costs ~0.1 ms, an RSA-3072 one ~2 ms.
    return ec.generate_private_key(ec.SECP256R1())


def make_ca(common_name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + CERT_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue_cert(ca_key, ca_cert, name: str):
    """A certificate for `name` (its only SAN), for both ends of mutual TLS."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + CERT_VALIDITY)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _write_pair(cert_dir: Path, name: str, key, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    key_path = cert_dir / f"{name}.key"
    key_path.touch(mode=0o600)
    key_path.chmod(0o600)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    (cert_dir / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


# -- contexts ---------------------------------------------------------------------
def _context(purpose: ssl.Purpose, files: TlsFiles) -> ssl.SSLContext:
    files.check()
    ctx = ssl.create_default_context(purpose, cafile=str(files.ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(files.cert), str(files.key))
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """Verifies the server against the deployment CA and its name (pass server_hostname)."""
    ctx = _context(ssl.Purpose.SERVER_AUTH, files)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def server_context(files: TlsFiles, require_client_cert: bool = True) -> ssl.SSLContext:
    """require_client_cert=False (the HTTP API): /health and /metrics stay open to
    probes without a certificate; a certificate that is presented must still
    verify, and /internal/ calls check the client's name."""
    ctx = _context(ssl.Purpose.CLIENT_AUTH, files)
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def peer_names(transport) -> frozenset[str]:
    """DNS names of the verified peer certificate of an SSL transport or stream writer (empty: none)."""
    cert = transport.get_extra_info("peercert") if transport is not None else None
    return frozenset(v for k, v in (cert or {}).get("subjectAltName", ()) if k == "DNS")


@dataclass(frozen=True)
class TlsPeer:
    """How to reach one TLS server: the context, and the name its certificate must carry."""
    context: ssl.SSLContext
    name: str


def router_peers(spec: DeploymentSpec, files: TlsFiles) -> dict[str, TlsPeer]:
    """The router's TLS peers, keyed by the base URL it addresses each instance by."""
    from pdd.deploy.topology import address

    ctx = client_context(files)
    return {address(spec, i, spec.router_datacenter).url: TlsPeer(ctx, i.name)
            for i in spec.instances if http_tls(spec, i)}


def kv_peers(spec: DeploymentSpec, sender: InstanceSpec, files: TlsFiles) -> dict[tuple[str, int], TlsPeer]:
    """A prefill instance's TLS peers, keyed by the (host, kv_port) it reaches each decoder at."""
    from pdd.deploy.topology import address

    ctx = client_context(files)
    out = {}
    for i in spec.instances:
        if kv_tls(spec, i):
            a = address(spec, i, sender.datacenter)
            out[(a.host, a.kv_port)] = TlsPeer(ctx, i.name)
    return out

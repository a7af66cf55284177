"""A real TLS terminator for the tests and benchmarks: stunnel (Debian's stunnel4) on 127.0.0.1
in front of a plain HTTP server, with a CA and a server certificate generated for the run.

Its log (debug level) has one "TLS state (accept): SSLv3/TLS read finished" line per TLS
handshake it completed (the client's Finished message read: the handshake is done).
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

HANDSHAKE_DONE = "TLS state (accept): SSLv3/TLS read finished"


def stunnel_binary() -> str | None:
    return shutil.which("stunnel4") or shutil.which("stunnel")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_ca(directory: Path, name: str = "gpubench test CA") -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key) PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


def make_server_cert(directory: Path, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost signed by `ca`: (certificate, key) PEM files."""
    ca_cert = x509.load_pem_x509_certificate(ca[0].read_bytes())
    ca_key = serialization.load_pem_private_key(ca[1].read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.pem", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


@dataclass
class Stunnel:
    url: str
    ca_file: Path
    log_path: Path
    process: subprocess.Popen[bytes]

    def handshakes(self) -> int:
        """TLS handshakes stunnel completed so far (from its debug log)."""
        if not self.log_path.exists():
            return 0
        # stunnel writes its log from its own threads: read until two reads agree.
        count = -1
        while True:
            latest = self.log_path.read_text(errors="replace").count(HANDSHAKE_DONE)
            if latest == count:
                return count
            count = latest
            time.sleep(0.05)

    def connections(self) -> int:
        """Client connections stunnel accepted so far."""
        if not self.log_path.exists():
            return 0
        return self.log_path.read_text(errors="replace").count("accepted connection from")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def stunnel(upstream_url: str, directory: Path) -> Iterator[Stunnel]:
    """stunnel accepting TLS on 127.0.0.1:<port> for the plain `upstream_url` (http://host:port),
    with a fresh CA; stopped on exit."""
    binary = stunnel_binary()
    if binary is None:
        raise RuntimeError("stunnel4 is not installed (scripts/setup-system.sh installs it)")
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory)
    cert, key = make_server_cert(directory, ca)
    host_port = upstream_url.split("://", 1)[-1].rstrip("/")
    port = _free_port()
    log_path = directory / "stunnel.log"
    config = directory / "stunnel.conf"
    config.write_text(
        "foreground = yes\n"
        "pid =\n"
        "debug = 7\n"
        f"output = {log_path}\n"
        "[gpubench]\n"
        f"accept = 127.0.0.1:{port}\n"
        f"connect = {host_port}\n"
        f"cert = {cert}\n"
        f"key = {key}\n"
    )
    process = subprocess.Popen(
        [binary, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"stunnel did not start: {log_path}") from None
                time.sleep(0.02)
        yield Stunnel(f"https://127.0.0.1:{port}", ca[0], log_path, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

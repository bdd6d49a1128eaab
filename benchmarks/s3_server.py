"""A real S3-compatible server for the tests and benchmarks: moto's S3 backend served over HTTPS by werkzeug, in a
thread of the test process, with a certificate authority made for the session.

litdata's object-store client speaks HTTPS only, so the server does too; the clients trust it
through the environment (``SSL_CERT_FILE`` for litdata's obstore client, ``AWS_CA_BUNDLE`` for
boto3) and find it through the standard ``AWS_ENDPOINT_URL``: :meth:`S3Server.environment` is
what a process (the test's own, or one it starts) needs. The server counts every request and
every body byte it sends (:attr:`S3Server.served`), so a test can say what one epoch fetched.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def write_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate it signs for 127.0.0.1 and localhost: ``(ca, certificate, key)`` files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(days=1), not_valid_after=now + datetime.timedelta(days=2))
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shortcutlab test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    names = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    certificate = (x509.CertificateBuilder().issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
                   .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
                   .add_extension(names, critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class Counted:
    """The requests a WSGI app answered: ``(method, path, body bytes sent)`` each, in order."""

    def __init__(self, app: Callable) -> None:
        self.app, self.lock = app, threading.Lock()
        self.answered: list[tuple[str, str, int]] = []

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        body = list(self.app(environ, start_response))
        with self.lock:
            self.answered.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], sum(len(part) for part in body)))
        return body

    def gets(self, prefix: str) -> list[tuple[str, int]]:
        """``(path, bytes)`` of every GET of an object under ``prefix`` (``/bucket/key...``)."""
        with self.lock:
            return [(path, size) for method, path, size in self.answered if method == "GET" and path.startswith(prefix)]

    def reset(self) -> None:
        with self.lock:
            self.answered = []


class S3Server:
    """moto's S3 on ``https://127.0.0.1:<free port>``, started by :meth:`start`, stopped by :meth:`stop`."""

    def __init__(self, folder: Path) -> None:
        from moto.server import create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line a request
        self.ca, certificate, key = write_certificates(folder)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.served = Counted(create_backend_app("s3"))
        self._server = make_server("127.0.0.1", self.port, self.served, threaded=True,
                                   ssl_context=(str(certificate), str(key)))
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        """What a client process needs to reach this server with litdata and boto3."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint, "AWS_CA_BUNDLE": str(self.ca),
                "SSL_CERT_FILE": str(self.ca)}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, verify=str(self.ca), region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def start(self) -> "S3Server":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(10)

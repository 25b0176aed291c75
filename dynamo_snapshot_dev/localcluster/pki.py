"""Certificates for the local control plane, made with the openssl CLI (no Python crypto dependency)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class PkiError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")


def make_pki(directory: Path, sans: list[str]) -> Pki:
    """A CA, an apiserver serving cert for `sans`, an admin client cert (system:masters) and SA keys.

    Reused when already present so a restarted cluster keeps trusting existing kubeconfigs.
    """
    if shutil.which("openssl") is None:
        raise PkiError("openssl is missing: apt-get install openssl")
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=d / "ca.crt",
        ca_key=d / "ca.key",
        server_cert=d / "apiserver.crt",
        server_key=d / "apiserver.key",
        admin_cert=d / "admin.crt",
        admin_key=d / "admin.key",
        sa_key=d / "sa.key",
        sa_pub=d / "sa.pub",
    )
    if all(p.exists() for p in vars(pki).values()):
        return pki
    _openssl("genrsa", "-out", "ca.key", "2048", cwd=d)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-nodes",
        "-key",
        "ca.key",
        "-subj",
        "/CN=dynamo-snapshot-local-ca",
        "-days",
        "3650",
        "-out",
        "ca.crt",
        cwd=d,
    )
    alt = ",".join(f"IP:{s}" if s.replace(".", "").isdigit() else f"DNS:{s}" for s in sans)
    _issue(d, "apiserver", "/CN=kube-apiserver", f"subjectAltName={alt}\nextendedKeyUsage=serverAuth")
    _issue(d, "admin", "/O=system:masters/CN=admin", "extendedKeyUsage=clientAuth")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    return pki


def _issue(d: Path, name: str, subject: str, extensions: str) -> None:
    (d / f"{name}.ext").write_text(extensions + "\n")
    _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=d)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=d)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=d,
    )


@dataclass(frozen=True)
class NodeCerts:
    client_cert: Path
    client_key: Path
    serving_cert: Path
    serving_key: Path


def make_node_certs(pki: Pki, node: str, node_ip: str) -> NodeCerts:
    """Kubelet certificates signed by the cluster CA: a client cert the Node authorizer accepts
    (system:nodes / system:node:<node>, so no bootstrap or CSR flow is needed) and a serving cert for the
    node IP. Reused when present and issued for the same node and IP."""
    d = pki.ca_cert.parent
    client, serving = f"kubelet-{node}-client", f"kubelet-{node}-serving"
    certs = NodeCerts(
        client_cert=d / f"{client}.crt",
        client_key=d / f"{client}.key",
        serving_cert=d / f"{serving}.crt",
        serving_key=d / f"{serving}.key",
    )
    subject = f"/O=system:nodes/CN=system:node:{node}"
    serving_ext = f"subjectAltName=IP:{node_ip},IP:127.0.0.1,DNS:{node}\nextendedKeyUsage=serverAuth"
    stamp = d / f"{serving}.ext"
    if all(p.exists() for p in vars(certs).values()) and stamp.read_text() == serving_ext + "\n":
        return certs
    _issue(d, client, subject, "extendedKeyUsage=clientAuth")
    _issue(d, serving, subject, serving_ext)
    return certs

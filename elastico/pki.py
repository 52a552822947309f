"""A throwaway certificate authority for local clusters and tests: ``python -m elastico.pki init|issue``.

``make up`` and ``make demo`` create one under the run directory (``<run>/pki``) and issue every process its
certificate, so a local cluster runs the same mTLS as a deployed one. Each certificate's common name is the
process identity (``allocator``, ``node/node-1``...; see ``elastico.rpc.security``), valid for both server
and client authentication, with the host names it serves as subject alternative names. Keys are ECDSA
P-256 (a few milliseconds each) and written mode 0600. A production cluster uses its own CA (cert-manager
in the Kubernetes manifests); rotation is re-issuing into the same paths (the services reload them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elastico.files import replace_file

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Issued:
    cert_file: str
    key_file: str
    ca_file: str


def file_stem(name: str) -> str:
    """``node/node-1`` -> ``node.node-1`` (certificate names become file names)."""
    return name.replace("/", ".")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def init_ca(directory: str | Path, common_name: str = "elastico-local-ca", days: int = 365) -> Path:
    """Create ``ca.crt``/``ca.key`` in ``directory`` unless they exist; returns the CA certificate's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    if (d / "ca.crt").exists() and (d / "ca.key").exists():
        return d / "ca.crt"
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    replace_file(d / "ca.key", _key_pem(key), 0o600)
    replace_file(d / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return d / "ca.crt"


def issue(directory: str | Path, name: str, hosts: Sequence[str] = LOCAL_HOSTS, days: float = 90,
          not_before: dt.datetime | None = None) -> Issued:
    """Issue (or re-issue) ``name``'s certificate and key signed by the CA in ``directory``.

    ``hosts`` become DNS or IP subject alternative names (what clients verify the server against).
    ``not_before``/``days`` set the validity window (tests issue expired certificates with them).
    """
    d = Path(directory)
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               # key identifiers (RFC 5280): strict verifiers, Python >= 3.13's default context among them, refuse a
               # certificate without the authority's
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    stem = file_stem(name)
    replace_file(d / f"{stem}.key", _key_pem(key), 0o600)
    replace_file(d / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(str(d / f"{stem}.crt"), str(d / f"{stem}.key"), str(d / "ca.crt"))


def throwaway(directory: str | Path, names: Sequence[str]) -> dict[str, Issued]:
    """A CA in ``directory`` and a certificate for each of ``names`` (benches and tests on loopback)."""
    init_ca(directory)
    return {name: issue(directory, name) for name in names}


def tls_settings(issued: Issued) -> dict[str, str]:
    """``Settings.from_env`` overrides that make a server use ``issued``."""
    return {"tls_cert_file": issued.cert_file, "tls_key_file": issued.key_file, "tls_ca_file": issued.ca_file}


def tls_env(issued: Issued) -> dict[str, str]:
    """The ``ELASTICO_TLS_*`` variables that make a process use ``issued``."""
    return {"ELASTICO_TLS_CERT_FILE": issued.cert_file, "ELASTICO_TLS_KEY_FILE": issued.key_file,
            "ELASTICO_TLS_CA_FILE": issued.ca_file}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elastico.pki", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_init = sub.add_parser("init", help="create a CA in DIR (kept if present)")
    p_init.add_argument("dir")
    p_issue = sub.add_parser("issue", help="issue or re-issue NAME's certificate (rotation: the services reload it)")
    p_issue.add_argument("dir")
    p_issue.add_argument("name", help="identity: allocator, pricer, predictor, kube, operator or node/<node id>")
    p_issue.add_argument("--host", action="append", help="a DNS name or IP the process serves (repeatable; default: loopback)")
    p_issue.add_argument("--days", type=float, default=90)
    args = ap.parse_args(argv)
    if args.cmd == "init":
        print(init_ca(args.dir))
    else:
        if not (Path(args.dir) / "ca.key").exists():
            print(f"error: no CA in {args.dir} (python -m elastico.pki init {args.dir})", file=sys.stderr)
            return 2
        out = issue(args.dir, args.name, args.host or LOCAL_HOSTS, args.days)
        print(f"{out.cert_file}\n{out.key_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

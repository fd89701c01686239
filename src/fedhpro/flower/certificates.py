"""TLS certificates and SuperNode key pairs for a Flower deployment, in the formats Flower 1.42 reads.

Flower secures a deployment with two mechanisms of its own; this module only
creates their inputs (with the ``cryptography`` package, a Flower dependency):

- **TLS**: a certificate authority (``ca.crt``, ``ca.key``) and a server
  certificate for the SuperLink (``server.pem``, ``server.key``) signed by it,
  valid for every host name or IP address the nodes and the ``flwr`` CLI use
  to reach the SuperLink (one subjectAltName each). The SuperLink takes
  ``--ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile
  server.key``; SuperNodes take ``--root-certificates ca.crt``; the ``flwr``
  connection in ``config.toml`` takes ``root-certificates = "/abs/ca.crt"``.
- **SuperNode authentication** (SuperLink ``--enable-supernode-auth``): one
  EC P-384 key pair per node, the private key in OpenSSH format
  (``supernode-K.key``, given to ``flower-supernode
  --auth-supernode-private-key``) and the public key as an OpenSSH line
  (``supernode-K.pub``, given to ``flwr supernode register``), which is what
  ``ssh-keygen -t ecdsa -b 384`` writes and what Flower parses.

Private keys are written unencrypted with mode 0600 (readable by their owner
only), every file with fedhpro's atomic writer; existing files are never
replaced, since a new CA would silently invalidate the certificates and keys
already handed out.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedhpro.errors import ConfigError
from fedhpro.files import write_atomic_with

CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
#: the curve of the TLS keys (P-256: every TLS stack speaks it) and of the node keys (P-384, as Flower's guide)
TLS_CURVE, NODE_CURVE = ec.SECP256R1, ec.SECP384R1
PRIVATE_MODE = 0o600


def node_key_names(k: int) -> tuple[str, str]:
    """The private and public key file names of node ``k`` (1-based)."""
    return f"supernode-{k}.key", f"supernode-{k}.pub"


def subject_alternative_name(host: str) -> x509.GeneralName:
    """An IP address entry for an IPv4/IPv6 literal, a DNS name entry otherwise."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedhpro"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder, days: int) -> x509.CertificateBuilder:
    """From one hour ago (clocks of the machines may differ a little) for ``days`` days."""
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(
        now + datetime.timedelta(days=days))


def certificate_authority(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new CA key and its self-signed certificate (may sign server certificates only)."""
    key = ec.generate_private_key(TLS_CURVE())
    public = key.public_key()
    builder = (_validity(x509.CertificateBuilder(), days)
               .subject_name(_name("fedhpro Flower CA")).issuer_name(_name("fedhpro Flower CA"))
               .public_key(public).serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=True, crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False))
    return key, builder.sign(key, hashes.SHA256())


def server_certificate(hosts: Sequence[str], ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                       days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new server key and its certificate signed by the CA, valid for TLS servers at every name in ``hosts``."""
    key = ec.generate_private_key(TLS_CURVE())
    public = key.public_key()
    builder = (_validity(x509.CertificateBuilder(), days)
               .subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
               .public_key(public).serial_number(x509.random_serial_number())
               .add_extension(x509.SubjectAlternativeName([subject_alternative_name(h) for h in hosts]),
                              critical=False)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=True,
                                            key_cert_sign=False, crl_sign=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    return key, builder.sign(ca_key, hashes.SHA256())


def node_key_pair() -> tuple[bytes, bytes]:
    """A new SuperNode key pair: the private key in OpenSSH format, the public key as one OpenSSH line."""
    key = ec.generate_private_key(NODE_CURVE())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + b"\n"


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_file(path: Path, content: bytes, private: bool) -> None:
    """Write ``content`` atomically; a private file is made 0600 before any byte is in it."""
    def write(handle: BinaryIO) -> None:
        if private:
            os.fchmod(handle.fileno(), PRIVATE_MODE)
        handle.write(content)
    write_atomic_with(path, write)


def planned_files(nodes: int) -> list[str]:
    """The names :func:`create` writes for ``nodes`` SuperNode key pairs."""
    names = [CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY]
    for k in range(1, nodes + 1):
        names.extend(node_key_names(k))
    return names


def create(folder: str | os.PathLike, hosts: Sequence[str], nodes: int = 0, days: int = 365) -> list[Path]:
    """Write a CA, a SuperLink certificate for ``hosts`` and ``nodes`` SuperNode key pairs into ``folder``;
    returns the paths written. Refuses (ConfigError) without hosts, with a bad count, or when a file exists."""
    if not hosts:
        raise ConfigError("no --host given; name every address the nodes use to reach the SuperLink, "
                          "e.g. --host 127.0.0.1 --host superlink.example.org")
    if nodes < 0 or days < 1:
        raise ConfigError(f"--nodes {nodes} / --days {days} out of range; use --nodes 0 or more and --days 1 or more")
    folder = Path(folder)
    existing = [name for name in planned_files(nodes) if (folder / name).exists()]
    if existing:
        raise ConfigError(f"{folder / existing[0]} already exists; choose an empty folder (a new CA would "
                          "invalidate the certificates and keys already handed out)")
    ca_key, ca_cert = certificate_authority(days)
    server_key, server_cert = server_certificate(list(hosts), ca_key, ca_cert, days)
    contents = [(CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM), False),
                (CA_KEY, _pem_key(ca_key), True),
                (SERVER_CERT, server_cert.public_bytes(serialization.Encoding.PEM), False),
                (SERVER_KEY, _pem_key(server_key), True)]
    for k in range(1, nodes + 1):
        private, public = node_key_pair()
        private_name, public_name = node_key_names(k)
        contents += [(private_name, private, True), (public_name, public, False)]
    for name, content, secret in contents:
        write_file(folder / name, content, secret)
    return [folder / name for name, _, _ in contents]

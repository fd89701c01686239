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

- **the gate** (:mod:`fedhpro.deploy.gate`, nginx with mutual TLS in front of
  the SuperLink), with ``gate=True``: one client certificate per party, its
  role in the subject's OU (``operator.crt``/``operator.key``: ``OU=operator``,
  may use the Control API; ``supernode-K.crt``/``supernode-K-tls.key``:
  ``OU=node``, may use the Fleet API only), EKU clientAuth for the gate and
  serverAuth with subjectAltName 127.0.0.1 for the party's own local forwarder
  (Flower's clients cannot present a client certificate, so each party talks
  TLS to a forwarder on 127.0.0.1 that opens the mutual-TLS connection).
  :func:`issue_client` adds one more later (it needs ``ca.key``). The gate
  gives a role only to a subject of exactly this form, so names are refused
  here unless they hold letters, digits, ``.``, ``_`` and ``-`` only
  (:data:`CLIENT_NAME`): a ``,``, ``=``, ``+``, ``/``, ``\\``, quote or control
  character could make another attribute appear in the printed subject.

Private keys are written unencrypted with mode 0600 (readable by their owner
only), every file with fedhpro's atomic writer; existing files are never
replaced, since a new CA would silently invalidate the certificates and keys
already handed out.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
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
OPERATOR = "operator"
ROLES = ("operator", "node")
#: what a client certificate's name may hold (it goes into the subject and file names unescaped; the gate's
#: role rules, :func:`fedhpro.deploy.gate.role_rules`, accept exactly this)
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: a DNS name for the SuperLink's certificate: labels of letters, digits and '-', joined by '.'
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")
#: the curve of the TLS keys (P-256: every TLS stack speaks it) and of the node keys (P-384, as Flower's guide)
TLS_CURVE, NODE_CURVE = ec.SECP256R1, ec.SECP384R1
PRIVATE_MODE = 0o600


def node_key_names(k: int) -> tuple[str, str]:
    """The private and public key file names of node ``k`` (1-based)."""
    return f"supernode-{k}.key", f"supernode-{k}.pub"


def client_names(name: str) -> tuple[str, str]:
    """The certificate and TLS private key file names of a gate client (``operator`` or ``supernode-K``)."""
    return f"{name}.crt", (f"{name}.key" if name == OPERATOR else f"{name}-tls.key")


def subject_alternative_name(host: str) -> x509.GeneralName:
    """An IP address entry for an IPv4/IPv6 literal, a DNS name entry for a DNS name; a ConfigError otherwise
    (the first host is also the certificate's CN, where a ``,`` or ``=`` would forge attributes)."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not HOST_NAME.fullmatch(host):
        raise ConfigError(f"--host {host!r} is neither an IP address nor a DNS name; use letters, digits, '-' "
                          "and '.' (e.g. superlink.example.org)")
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
    """A new CA key and its self-signed certificate (pathlen 0: it signs leaf certificates only)."""
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


def _leaf_certificate(subject: x509.Name, names: list[x509.GeneralName], usages: list[x509.ObjectIdentifier],
                      ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                      days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new TLS key and its certificate signed by the CA: ``subject``, one subjectAltName per entry of
    ``names``, no CA, key usages for ECDHE/ECDSA and the extended key usages ``usages``."""
    key = ec.generate_private_key(TLS_CURVE())
    public = key.public_key()
    builder = (_validity(x509.CertificateBuilder(), days)
               .subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(public).serial_number(x509.random_serial_number())
               .add_extension(x509.SubjectAlternativeName(names), critical=False)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=True,
                                            key_cert_sign=False, crl_sign=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    return key, builder.sign(ca_key, hashes.SHA256())


def server_certificate(hosts: Sequence[str], ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                       days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new server key and its certificate signed by the CA, valid for TLS servers at every name in ``hosts``."""
    return _leaf_certificate(_name(hosts[0]), [subject_alternative_name(h) for h in hosts],
                             [ExtendedKeyUsageOID.SERVER_AUTH], ca_key, ca_cert, days)


def check_client(name: str, role: str) -> None:
    """A one-line ConfigError unless ``role`` is a role and ``name`` a :data:`CLIENT_NAME`."""
    if role not in ROLES:
        raise ConfigError(f"role {role!r} unknown; use one of {', '.join(ROLES)}")
    if not isinstance(name, str) or not CLIENT_NAME.fullmatch(name):
        raise ConfigError(f"client name {name!r} not allowed; use letters, digits, '.', '_' and '-' "
                          "(at most 63, starting with a letter or digit: the gate reads the role from the name's "
                          "certificate subject)")


def client_certificate(name: str, role: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                       days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A gate client's key and certificate: ``O=fedhpro, OU=<role>, CN=<name>``, clientAuth (for the gate)
    and serverAuth for 127.0.0.1 (the party's local forwarder listens with it)."""
    check_client(name, role)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedhpro"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return _leaf_certificate(subject, [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                             [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH], ca_key, ca_cert, days)


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


def planned_files(nodes: int, gate: bool = False) -> list[str]:
    """The names :func:`create` writes for ``nodes`` SuperNode key pairs (and, with ``gate``, client certificates)."""
    names = [CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY]
    if gate:
        names.extend(client_names(OPERATOR))
    for k in range(1, nodes + 1):
        names.extend(node_key_names(k))
        if gate:
            names.extend(client_names(f"supernode-{k}"))
    return names


def _client_contents(name: str, role: str, ca_key, ca_cert, days: int) -> list[tuple[str, bytes, bool]]:
    key, cert = client_certificate(name, role, ca_key, ca_cert, days)
    cert_name, key_name = client_names(name)
    return [(cert_name, cert.public_bytes(serialization.Encoding.PEM), False), (key_name, _pem_key(key), True)]


def issue_client(folder: str | os.PathLike, name: str, role: str, days: int = 365) -> list[Path]:
    """One more gate client certificate (``<name>.crt`` and its key) signed by ``folder``'s ``ca.key``."""
    folder = Path(folder)
    check_client(name, role)
    cert_name, key_name = client_names(name)
    existing = [n for n in (cert_name, key_name) if (folder / n).exists()]
    if existing:
        raise ConfigError(f"{folder / existing[0]} already exists; pick another name (files are never replaced)")
    try:
        ca_key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the CA in {folder} ({error}); it needs {CA_CERT} and {CA_KEY}") from None
    contents = _client_contents(name, role, ca_key, ca_cert, days)
    for file_name, content, secret in contents:
        write_file(folder / file_name, content, secret)
    return [folder / file_name for file_name, _, _ in contents]


def create(folder: str | os.PathLike, hosts: Sequence[str], nodes: int = 0, days: int = 365,
           gate: bool = False) -> list[Path]:
    """Write a CA, a SuperLink certificate for ``hosts`` and ``nodes`` SuperNode key pairs into ``folder``;
    with ``gate``, also the operator's and each node's client certificate for the gate (and 127.0.0.1 among
    the server certificate's names: the gate reaches the SuperLink there). Returns the paths written.
    Refuses (ConfigError) without hosts, with a bad count, or when a file exists."""
    if not hosts:
        raise ConfigError("no --host given; name every address the nodes use to reach the SuperLink, "
                          "e.g. --host 127.0.0.1 --host superlink.example.org")
    if nodes < 0 or days < 1:
        raise ConfigError(f"--nodes {nodes} / --days {days} out of range; use --nodes 0 or more and --days 1 or more")
    folder = Path(folder)
    hosts = list(hosts)
    for host in hosts:
        subject_alternative_name(host)  # refuses a name that is neither an IP address nor a DNS name
    if gate and "127.0.0.1" not in hosts:
        hosts.append("127.0.0.1")
    existing = [name for name in planned_files(nodes, gate) if (folder / name).exists()]
    if existing:
        raise ConfigError(f"{folder / existing[0]} already exists; choose an empty folder (a new CA would "
                          "invalidate the certificates and keys already handed out)")
    ca_key, ca_cert = certificate_authority(days)
    server_key, server_cert = server_certificate(hosts, ca_key, ca_cert, days)
    contents = [(CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM), False),
                (CA_KEY, _pem_key(ca_key), True),
                (SERVER_CERT, server_cert.public_bytes(serialization.Encoding.PEM), False),
                (SERVER_KEY, _pem_key(server_key), True)]
    if gate:
        contents += _client_contents(OPERATOR, "operator", ca_key, ca_cert, days)
    for k in range(1, nodes + 1):
        private, public = node_key_pair()
        private_name, public_name = node_key_names(k)
        contents += [(private_name, private, True), (public_name, public, False)]
        if gate:
            contents += _client_contents(f"supernode-{k}", "node", ca_key, ca_cert, days)
    for name, content, secret in contents:
        write_file(folder / name, content, secret)
    return [folder / name for name, _, _ in contents]

"""Roles at the gate that a certificate's name cannot forge.

The gate (nginx) reads a client certificate's role from ``$ssl_client_s_dn``, the subject in RFC 2253 form.
A rule that looked for ``OU=operator`` anywhere in that string gave the operator role to a node certificate
whose CN was ``site9,OU=operator`` (printed ``CN=site9\\,OU=operator,OU=node,O=fedhpro``). Here:

- the real nginx with the gate's config, and certificates signed by the deployment's CA: the escaped-comma
  certificate of the report (made with ``openssl req -subj``) and other forged subjects are refused the
  Control API (403, nginx's own page), while the CA's operator and node certificates pass to their API.
  No SuperLink runs: a request the gate lets through gets 502 (its upstream socket does not exist), one the
  role rule refuses gets 403, so the two outcomes tell the rule's decision apart;
- hypothesis over generated subjects: OpenSSL prints each subject as nginx does (``openssl x509 -nameopt
  RFC2253``, the same X509_NAME_print_ex flags), the rule from the written nginx.conf gives a role, and an
  exact X.509 parse (``cryptography``'s attributes) is the reference: the rule never gives a role the parse
  does not, and gives it to every subject ``certificates`` issues;
- issuing refuses the names that could carry another attribute.
"""

from __future__ import annotations

import datetime
import functools
import http.client
import re
import shutil
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedhpro.deploy import certificates, gate
from fedhpro.errors import ConfigError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
OPENSSL = shutil.which("openssl")
NGINX_PAGE = b"<center>nginx</center>"


def sign(subject: x509.Name, ca_key, ca_cert: x509.Certificate) -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    """A client certificate for ``subject`` signed by the CA (what a careless CA holder could issue)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(ca_cert.not_valid_before_utc).not_valid_after(ca_cert.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    return key, cert.public_bytes(serialization.Encoding.PEM)


def attribute(oid, value: str) -> x509.NameAttribute:
    return x509.NameAttribute(oid, value)


ORG, OU, CN = NameOID.ORGANIZATION_NAME, NameOID.ORGANIZATIONAL_UNIT_NAME, NameOID.COMMON_NAME
#: subjects a CA could be talked into signing, none of which is an operator certificate as issued
FORGED = {
    "cn-with-comma": x509.Name([attribute(ORG, "fedhpro"), attribute(OU, "node"), attribute(CN, "site9,OU=operator")]),
    "cn-with-plus": x509.Name([attribute(ORG, "fedhpro"), attribute(OU, "node"), attribute(CN, "site9+OU=operator")]),
    "cn-with-backslash": x509.Name([attribute(ORG, "fedhpro"), attribute(OU, "node"),
                                    attribute(CN, "site9\\,OU=operator")]),
    "two-units": x509.Name([attribute(ORG, "fedhpro"), attribute(OU, "operator"), attribute(OU, "node"),
                            attribute(CN, "site9")]),
    "multi-valued-rdn": x509.Name([x509.RelativeDistinguishedName([attribute(ORG, "fedhpro")]),
                                   x509.RelativeDistinguishedName([attribute(OU, "node"), attribute(OU, "operator")]),
                                   x509.RelativeDistinguishedName([attribute(CN, "site9")])]),
    "unit-with-comma": x509.Name([attribute(ORG, "fedhpro"), attribute(OU, "node,OU=operator"), attribute(CN, "s")]),
    "unit-with-space": x509.Name([attribute(ORG, "fedhpro"), attribute(OU, "operator "), attribute(CN, "site9")]),
    "organization-with-comma": x509.Name([attribute(ORG, "x,OU=operator,O=fedhpro"), attribute(OU, "node"),
                                          attribute(CN, "site9")]),
    "extra-attribute": x509.Name([attribute(NameOID.LOCALITY_NAME, "x"), attribute(ORG, "fedhpro"),
                                  attribute(OU, "operator"), attribute(CN, "site9")]),
    "no-organization": x509.Name([attribute(OU, "operator"), attribute(CN, "site9")]),
}


def request(port: int, path: str, ca: Path, cert: Path, key: Path) -> tuple[object, bytes]:
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False  # the gate's certificate is for localhost; only the client side is tested
    context.load_cert_chain(str(cert), str(key))
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
    try:
        connection.request("POST", path, body=b"", headers={"content-type": "application/protobuf"})
        response = connection.getresponse()
        return response.status, response.read()
    except (ssl.SSLError, OSError) as error:
        return type(error).__name__, b""
    finally:
        connection.close()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None or OPENSSL is None, reason="needs nginx and openssl")
def test_the_gate_refuses_forged_subjects_and_passes_issued_ones(tmp_path):
    certs = tmp_path / "certs"
    certificates.create(certs, ["localhost", "127.0.0.1"], nodes=1, gate=True)
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    # the report's certificate, made by hand with openssl as the old recipe allowed
    forged = tmp_path / "forged"
    forged.mkdir()
    made = subprocess.run(
        f"openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out {forged}/site9.key && "
        f"openssl req -new -key {forged}/site9.key -subj '/O=fedhpro/OU=node/CN=site9,OU=operator' "
        f"-out {forged}/site9.csr && openssl x509 -req -in {forged}/site9.csr -CA {certs}/ca.crt "
        f"-CAkey {certs}/ca.key -CAcreateserial -days 1 -sha256 -out {forged}/site9.crt",
        shell=True, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    clients = {"openssl-escaped-comma": (forged / "site9.crt", forged / "site9.key")}
    for name, subject in FORGED.items():
        key, pem = sign(subject, ca_key, ca_cert)
        (forged / f"{name}.crt").write_bytes(pem)
        certificates.write_file(forged / f"{name}.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), True)
        clients[name] = (forged / f"{name}.crt", forged / f"{name}.key")

    port = free_port()
    missing = tmp_path / "s" / "link.sock"  # no SuperLink: what passes the gate gets 502
    server = gate.server_config(tmp_path / "gate", certs, f"127.0.0.1:{port}", f"unix:{missing}")
    process = subprocess.Popen(server.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while request(port, "/health", certs / "ca.crt", certs / "operator.crt", certs / "operator.key")[0] in (
                "ConnectionRefusedError", "SSLError") and time.monotonic() < deadline:
            time.sleep(0.2)
        control, fleet = "/v1/control/list-runs", "/v1/fleet/get-run"
        operator = (certs / "operator.crt", certs / "operator.key")
        node = (certs / "supernode-1.crt", certs / "supernode-1-tls.key")
        outcomes = {(name, path): request(port, path, certs / "ca.crt", *pair)
                    for name, pair in {"operator": operator, "node": node, **clients}.items()
                    for path in (control, fleet)}
    finally:
        process.terminate()
        process.wait(timeout=30)
    for (name, path), (status, body) in outcomes.items():
        allowed = (name, path) in {("operator", control), ("node", fleet)}
        # 502: passed the role check to the (missing) SuperLink; 403: refused by the role rule
        assert status == (502 if allowed else 403) and NGINX_PAGE in body, (name, path, status)
    log = (tmp_path / "gate" / "access.log").read_text()
    assert r"CN=site9\x5C,OU=operator,OU=node,O=fedhpro" in log  # the subject as nginx saw it, escaped comma
    forged_lines = [line for line in log.splitlines() if "CN=operator," not in line and "CN=supernode-1," not in line]
    assert forged_lines and all("role= " in line for line in forged_lines), forged_lines


# ---------------------------------------------------------------------------- the rule against an exact parse
@functools.cache
def nginx_rules() -> dict[str, re.Pattern]:
    """The role map as written into the gate's nginx.conf (what nginx runs), as Python patterns (the rules use
    only anchors, classes and counted repeats, which PCRE and Python read alike)."""
    folder = Path(tempfile.mkdtemp(prefix="fedhpro-rules-"))
    try:
        certificates.create(folder / "certs", ["localhost"], gate=True)
        text = gate.server_config(folder / "gate", folder / "certs", "127.0.0.1:1",
                                  "unix:/tmp/x.sock").config.read_text()
    finally:
        shutil.rmtree(folder)
    block = text.split("map $ssl_client_s_dn $fedhpro_role {", 1)[1].split("}\n", 1)[0]
    rules = {role: re.compile(pattern) for pattern, role in re.findall(r'"~([^"]+)" (\w+);', block)}
    assert set(rules) == set(certificates.ROLES), block
    return rules


def printed_subject(pem: bytes) -> str:
    """The subject as nginx's ``$ssl_client_s_dn`` holds it: OpenSSL's RFC 2253 form."""
    done = subprocess.run([OPENSSL, "x509", "-noout", "-subject", "-nameopt", "RFC2253"], input=pem,
                          capture_output=True, check=True)
    line = done.stdout.decode("utf-8", "surrogateescape").rstrip("\n")
    assert line.startswith("subject=")
    return line[len("subject="):]


def gate_role(rules: dict[str, re.Pattern], printed: str) -> str | None:
    roles = [role for role, rule in rules.items() if rule.search(printed)]
    assert len(roles) <= 1, (printed, roles)
    return roles[0] if roles else None


def parsed_role(subject: x509.Name) -> str | None:
    """The reference: the role a subject states when parsed as X.509 (one OU attribute, holding a role)."""
    units = subject.get_attributes_for_oid(OU)
    return str(units[0].value) if len(units) == 1 and units[0].value in certificates.ROLES else None


def as_issued(subject: x509.Name) -> bool:
    """Whether ``subject`` is exactly what ``certificates`` issues: O=fedhpro, OU=<role>, CN=<name>, one
    attribute per RDN, and issuing accepts that name and role."""
    rdns = list(subject.rdns)
    if len(rdns) != 3 or any(len(rdn) != 1 for rdn in rdns):
        return False
    (o,), (ou,), (cn,) = (list(rdn) for rdn in rdns)
    if (o.oid, ou.oid, cn.oid) != (ORG, OU, CN) or o.value != "fedhpro":
        return False
    try:
        certificates.check_client(str(cn.value), str(ou.value))
    except ConfigError:
        return False
    return True


TRICKY = ",=+\\\"'<>;#/ \t\n\x00\x7f\u00e9\u0130\u200b"
values = st.one_of(st.sampled_from(["operator", "node", "fedhpro", "site9", "operator ", " operator", "OPERATOR"]),
                   st.text(alphabet=st.sampled_from(list("abOUCN=,+\\operatnd" + TRICKY)), min_size=1, max_size=24),
                   st.builds(lambda a, b: f"{a}{b}", st.sampled_from(["site9", "x", ""]),
                             st.sampled_from([",OU=operator", "\\,OU=operator", "+OU=operator", ",OU=node",
                                              "/OU=operator", "\nOU=operator", "\x00,OU=operator"])))
kinds = st.sampled_from([ORG, OU, CN, NameOID.LOCALITY_NAME])
rdn = st.lists(st.tuples(kinds, values), min_size=1, max_size=2)
subjects = st.lists(rdn, min_size=1, max_size=4)
KEY = ec.generate_private_key(ec.SECP256R1())


def self_signed(rdns: list[list[tuple]]) -> tuple[x509.Name, bytes] | None:
    """A certificate for the generated subject (who signs does not change how the subject prints), or None
    when X.509 itself refuses the value (e.g. a CN over 64 characters)."""
    try:
        name = x509.Name([x509.RelativeDistinguishedName([x509.NameAttribute(oid, value) for oid, value in rdn_])
                          for rdn_ in rdns])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(KEY.public_key())
                .serial_number(1).not_valid_before(START).not_valid_after(START + datetime.timedelta(days=1))
                .sign(KEY, hashes.SHA256()))
    except ValueError:
        return None
    return name, cert.public_bytes(serialization.Encoding.PEM)


START = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
CA_KEY, CA_CERT = certificates.certificate_authority(1)


@pytest.mark.slow
@pytest.mark.skipif(OPENSSL is None, reason="needs openssl (the reference printer of subjects)")
@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(rdns=subjects)
@example(rdns=[[(ORG, "fedhpro")], [(OU, "operator")], [(CN, "site9")]])  # as issued: the role must come through
@example(rdns=[[(ORG, "fedhpro")], [(OU, "node")], [(CN, "site9,OU=operator")]])  # the report's subject
def test_the_role_rule_agrees_with_an_exact_parse_of_generated_subjects(rdns):
    rules = nginx_rules()
    made = self_signed(rdns)
    if made is None:
        return
    name, pem = made
    role = gate_role(rules, printed_subject(pem))
    # never a role the certificate does not state, and every subject as issued gets its role
    assert role is None or role == parsed_role(name), (printed_subject(pem), role, parsed_role(name))
    if as_issued(name):
        assert role == parsed_role(name) is not None, printed_subject(pem)


@pytest.mark.slow
@pytest.mark.skipif(OPENSSL is None, reason="needs openssl (the reference printer of subjects)")
@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(name=st.one_of(st.from_regex(certificates.CLIENT_NAME, fullmatch=True),
                      st.text(alphabet=st.sampled_from(list("ab9.-_" + TRICKY)), min_size=1, max_size=70)),
       role=st.sampled_from([*certificates.ROLES, "admin", "operator,OU=node"]))
def test_issuing_either_refuses_a_name_or_the_gate_reads_its_role(name, role):
    rules = nginx_rules()
    try:
        _, cert = certificates.client_certificate(name, role, CA_KEY, CA_CERT, 1)
    except ConfigError as error:
        assert "\n" not in repr(str(error)) and ("not allowed" in str(error) or "unknown" in str(error))
        return
    assert gate_role(rules, printed_subject(cert.public_bytes(serialization.Encoding.PEM))) == role


@pytest.mark.parametrize("name", ["site9,OU=operator", "a=b", "a+b", "a/b", "a\\b", 'a"b', "a'b", "a\nb",
                                  "a\x00b", "a b", "a<b", "#a", "", "é", "a" * 64])
def test_issuing_refuses_names_that_could_carry_another_attribute(tmp_path, name):
    certificates.create(tmp_path, ["127.0.0.1"], gate=True)
    with pytest.raises(ConfigError, match="not allowed") as error:
        certificates.issue_client(tmp_path, name, "node")
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(certificates.planned_files(0, gate=True))


@pytest.mark.parametrize("host", ["a,OU=operator", "x=y", "a b", "a/b", "-a", "a..b", "a\nb", "é.example"])
def test_the_server_certificate_refuses_hosts_that_are_no_name(tmp_path, host):
    with pytest.raises(ConfigError, match="neither an IP address nor a DNS name") as error:
        certificates.create(tmp_path, ["localhost", host])
    assert "\n" not in str(error.value) and not any(tmp_path.iterdir())

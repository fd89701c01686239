"""Flower deployment secured with Flower's own mechanisms: TLS and registered (authenticated) SuperNodes.

The certificates and node keys come from ``python -m fedhpro.flower
certificates`` (:mod:`fedhpro.flower.certificates`); the unit tests check
them with an independent tool (``openssl``/``ssh-keygen`` where installed, else
the ``cryptography`` checks those tools make), the deployment test with
Flower itself: one SuperLink with TLS and ``--enable-supernode-auth`` on
127.0.0.1 serves three checks at once, to keep the wall time low:

- two SuperNodes whose public keys were registered with ``flwr supernode
  register`` run 2 rounds of fedhpro, with the simulator's numbers;
- a SuperNode with a valid but unregistered key is refused by the SuperLink
  (it exits, the SuperLink logs the refusal, it never gets a node id or a
  message, and no client beyond the two registered ones takes part);
- a SuperNode that does not trust the CA (no ``--root-certificates``, not
  ``--insecure``) fails the TLS handshake and exits.
"""

from __future__ import annotations

import shutil
import stat
import subprocess

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from test_flower import CORE_KEYS, assert_same_state, core, read_rows, reference, tiny_config  # noqa: E402
from test_flower_deployment import Loopback  # noqa: E402

from fedhpro.errors import ConfigError  # noqa: E402
from fedhpro.flower import certificates  # noqa: E402
from fedhpro.flower.__main__ import main  # noqa: E402


# ---------------------------------------------------------------------------- the files
def test_certificates_command_writes_a_ca_a_server_certificate_and_node_keys(tmp_path, capsys):
    folder = tmp_path / "certs"
    assert main(["certificates", str(folder), "--host", "127.0.0.1", "--host", "superlink.example.org",
                 "--nodes", "2"]) == 0
    names = {"ca.crt", "ca.key", "server.pem", "server.key", "supernode-1.key", "supernode-1.pub",
             "supernode-2.key", "supernode-2.pub"}
    assert {path.name for path in folder.iterdir()} == names  # no temporary file left behind
    for name in names:
        mode = stat.S_IMODE((folder / name).stat().st_mode)
        assert (mode == 0o600) if name.endswith(".key") else (mode & 0o044), (name, oct(mode))
    assert "--ssl-ca-certfile" in capsys.readouterr().out

    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)  # signed by the CA (raises otherwise)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names_in_certificate = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names_in_certificate.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names_in_certificate.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    key = serialization.load_pem_private_key((folder / "server.key").read_bytes(), password=None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()

    # the node keys: what flower-supernode and flwr supernode register parse, and one pair
    private = serialization.load_ssh_private_key((folder / "supernode-1.key").read_bytes(), password=None)
    public = serialization.load_ssh_public_key((folder / "supernode-1.pub").read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert private.public_key().public_numbers() == public.public_numbers()
    other = serialization.load_ssh_public_key((folder / "supernode-2.pub").read_bytes())
    assert other.public_numbers() != public.public_numbers()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_openssl_accepts_the_server_certificate_for_its_hosts_only(tmp_path):
    certificates.create(tmp_path, ["127.0.0.1", "localhost"])
    ca, server = str(tmp_path / "ca.crt"), str(tmp_path / "server.pem")

    def verify(*check: str) -> subprocess.CompletedProcess:
        return subprocess.run(["openssl", "verify", "-CAfile", ca, "-purpose", "sslserver", *check, server],
                              capture_output=True, text=True)

    assert verify().returncode == 0
    assert verify("-verify_ip", "127.0.0.1").returncode == 0
    assert verify("-verify_hostname", "localhost").returncode == 0
    assert verify("-verify_ip", "10.0.0.1").returncode != 0
    assert verify("-verify_hostname", "elsewhere.example.org").returncode != 0


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="ssh-keygen is not installed")
def test_ssh_keygen_reads_the_node_keys_as_ecdsa_384(tmp_path):
    certificates.create(tmp_path, ["127.0.0.1"], nodes=1)
    from_private = subprocess.run(["ssh-keygen", "-y", "-f", str(tmp_path / "supernode-1.key")],
                                  capture_output=True, text=True, check=True).stdout.split()[:2]
    assert from_private == (tmp_path / "supernode-1.pub").read_text().split()[:2]
    assert from_private[0] == "ecdsa-sha2-nistp384"


@pytest.mark.parametrize("hosts, nodes, words", [
    ([], 0, "no --host given"),
    (["127.0.0.1"], -1, "out of range"),
])
def test_bad_certificate_requests_are_one_line_config_errors(tmp_path, hosts, nodes, words):
    with pytest.raises(ConfigError, match=words) as error:
        certificates.create(tmp_path, hosts, nodes=nodes)
    assert "\n" not in str(error.value)


def test_existing_files_are_never_replaced(tmp_path, capsys):
    certificates.create(tmp_path, ["127.0.0.1"])
    before = (tmp_path / "ca.key").read_bytes()
    assert main(["certificates", str(tmp_path), "--host", "127.0.0.1", "--nodes", "1"]) == 2
    assert "ca.crt already exists; choose an empty folder" in capsys.readouterr().err
    assert (tmp_path / "ca.key").read_bytes() == before and not (tmp_path / "supernode-1.key").exists()


# ---------------------------------------------------------------------------- a deployment
def test_tls_and_registered_supernodes_run_fedhpro_and_refuse_the_others(digits_data_dir, tmp_path):
    keys = tmp_path / "certs"
    certificates.create(keys, ["127.0.0.1"], nodes=3)
    out = tmp_path / "out"
    settings = tiny_config(digits_data_dir)
    settings.pop("clients")
    with Loopback(tmp_path, certificates=keys) as net:
        net.start_superlink(["--enable-supernode-auth"])
        registered = {net.register(keys / f"supernode-{k}.pub") for k in (1, 2)}
        for k in range(2):
            net.start_supernode(f"node-{k}", f"partition-id={k} num-partitions=2",
                                ["--auth-supernode-private-key", str(keys / f"supernode-{k + 1}.key")], wait=False)
        # supernode-3's key is valid but was never registered: the SuperLink must refuse it
        net.start_supernode("intruder", "partition-id=0 num-partitions=2",
                            ["--auth-supernode-private-key", str(keys / "supernode-3.key")], wait=False)
        # a node that does not trust our CA must not even complete the TLS handshake
        net.start_supernode("untrusting", "partition-id=1 num-partitions=2",
                            ["--auth-supernode-private-key", str(keys / "supernode-3.key")], wait=False,
                            trust_ca=False)
        net.wait_connected("node-0", "node-1")

        if net.wait_exit("intruder") == 0:
            net.fail("the unregistered SuperNode exited with code 0")
        intruder_log = net.processes.latest_log("intruder")
        if "Failed to activate SuperNode" not in intruder_log or "SuperNode ID" in intruder_log:
            net.fail("the unregistered SuperNode was not refused at activation")
        if "No SuperNode found with the given public key" not in net.processes.latest_log("superlink"):
            net.fail("the SuperLink did not log the refusal of the unregistered key")
        if net.wait_exit("untrusting") == 0:
            net.fail("the SuperNode without the CA certificate exited with code 0")
        if "CERTIFICATE_VERIFY_FAILED" not in net.processes.latest_log("untrusting"):
            net.fail("the SuperNode without the CA certificate did not fail on the certificate")

        nodes = {int(node["node-id"]): node["status"] for node in net.supernodes()}
        if nodes != {node_id: "online" for node_id in registered}:
            net.fail(f"flwr supernode ls should list the two registered nodes online, not {nodes}")

        record = net.assert_completed(net.flwr_run({**settings, "out": str(out)}))
        assert record["network-traffic"]["total-bytes"] > 0

    rows = read_rows(out / "metrics.jsonl")
    assert len(rows) == 2 and all(row["participants"] == [0, 1] for row in rows)
    expected_rows, expected_state = reference({**settings, "clients": 2}, tmp_path / "reference")
    assert core(rows) == core(expected_rows), CORE_KEYS
    assert_same_state(torch.load(out / "server_state.pt", weights_only=True)["server"], expected_state)

"""The pieces of the secured deployment that need no running Flower: client certificates, nginx configs,
the flwr connection written by ``up`` (``python -m fedhpro.deploy``), and ``python -m fedhpro.flower run``'s
exit code.

The deployment itself (the gate refusing strangers and nodes, a secured run) is in test_flower_secure.py.
"""

from __future__ import annotations

import http.client
import re
import shutil
import ssl
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedhpro.deploy import certificates, gate, processes, up
from fedhpro.deploy.__main__ import main
from fedhpro.errors import ConfigError
from fedhpro.flower.__main__ import main as flower_main

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")



def post_status(port: int, ca: Path, path: str, authorization: str | None = None) -> object:
    """The HTTP status of an empty POST to ``path`` over TLS on 127.0.0.1:``port`` (the server checked against
    ``ca``), or the name of the connection error."""
    context = ssl.create_default_context(cafile=str(ca))
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
    try:
        connection.request("POST", path, body=b"", headers={"Authorization": authorization} if authorization else {})
        return connection.getresponse().status
    except OSError as error:
        return type(error).__name__
    finally:
        connection.close()

@pytest.mark.slow
def test_gate_certificates_carry_the_role_and_serve_both_ends(tmp_path, capsys):
    folder = tmp_path / "certs"
    assert main(["certificates", str(folder), "--host", "superlink.example.org", "--nodes", "2", "--gate"]) == 0
    assert "gate forward" in capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]  # the gate's upstream
    for name, key, role in (("operator", "operator.key", "operator"), ("supernode-1", "supernode-1-tls.key", "node"),
                            ("supernode-2", "supernode-2-tls.key", "node")):
        cert = x509.load_pem_x509_certificate((folder / f"{name}.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == role
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
        assert stat.S_IMODE((folder / key).stat().st_mode) == 0o600
        if shutil.which("openssl"):
            for purpose in (["-purpose", "sslclient"], ["-purpose", "sslserver", "-verify_ip", "127.0.0.1"]):
                subprocess.run(["openssl", "verify", "-CAfile", str(folder / "ca.crt"), *purpose,
                                str(folder / f"{name}.crt")], check=True, capture_output=True)


def test_one_more_client_certificate_never_replaces_a_file(tmp_path, capsys):
    certificates.create(tmp_path, ["127.0.0.1"], gate=True)
    assert main(["certificates", str(tmp_path), "--client", "supernode-9"]) == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "supernode-9.crt").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "node"
    before = (tmp_path / "operator.key").read_bytes()
    assert main(["certificates", str(tmp_path), "--client", "operator", "--role", "operator"]) == 2
    assert "already exists" in capsys.readouterr().err and (tmp_path / "operator.key").read_bytes() == before
    with pytest.raises(ConfigError, match="not allowed"):
        certificates.issue_client(tmp_path, "a,OU=operator", "node")


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx-light)")
def test_nginx_accepts_the_configs(tmp_path):
    certificates.create(tmp_path / "certs", ["gate.example.org"], nodes=1, gate=True)
    server = gate.server_config(tmp_path / "gate", tmp_path / "certs", "127.0.0.1:18000", "127.0.0.1:18001")
    # nginx resolves the gate's host name when it starts (localhost: /etc/hosts); the certificate's name may differ
    forward = gate.forward_config(tmp_path / "fwd", tmp_path / "certs", "supernode-1", "localhost:18000",
                                  "127.0.0.1:18003", gate_name="gate.example.org")
    text = server.config.read_text()
    for needed in ("ssl_verify_client on;", "underscores_in_headers on;", "proxy_buffering off;",
                   f"client_max_body_size {gate.MAX_BODY};", 'location / { return 403; }'):
        assert needed in text
    assert "proxy_ssl_server_name on;" in forward.config.read_text()  # SNI for a host name
    # nginx checks the SuperLink's certificate by DNS name (or CN), never by IP address: the gate names its DNS name
    assert "proxy_ssl_name gate.example.org;" in text
    assert gate.check_name(tmp_path / "certs" / "server.pem") == "gate.example.org"
    certificates.create(tmp_path / "ip-only", ["10.0.0.5"])
    assert gate.check_name(tmp_path / "ip-only" / "server.pem") == "10.0.0.5"  # no DNS name: the CN
    for written in (server, forward):
        command = written.command()
        test = subprocess.run([*command[:-2], "-t"], capture_output=True, text=True)
        assert test.returncode == 0, test.stderr
    with pytest.raises(ConfigError, match="loopback"):
        gate.forward_config(tmp_path / "f2", tmp_path / "certs", "operator", "gate.example.org:1", "0.0.0.0:18001")


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx-light)")
def test_bridge_local_socket_and_token_configs_pass_nginx_and_the_token_reaches_flwr(tmp_path, monkeypatch):
    """The pieces ``up`` adds for local users: the gate's Unix socket and bridge upstream, the bridge, and the
    operator's forwarder with a token that ``gate forward --token`` puts where ``flwr`` reads it."""
    certs = tmp_path / "certs"
    certificates.create(certs, ["localhost"], nodes=1, gate=True)
    sockets = tmp_path / "s"
    sockets.mkdir(mode=0o700)  # nginx -t binds the Unix sockets too
    server = gate.server_config(tmp_path / "gate", certs, "127.0.0.1:18000", f"unix:{sockets / 'link.sock'}",
                                local=f"unix:{sockets / 'gate.sock'}")
    text = server.config.read_text()
    assert f'listen "unix:{sockets / "gate.sock"}" ssl;' in text and "proxy_pass http://superlink;" in text
    bridge = gate.bridge_config(tmp_path / "bridge", certs, f"unix:{sockets / 'link.sock'}", "127.0.0.1:18001")
    assert "proxy_ssl_verify on;" in bridge.config.read_text()
    home = tmp_path / "home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    assert main(["gate", "forward", str(tmp_path / "fwd"), "--certs", str(certs), "--name", "operator",
                 "--gate", f"unix:{sockets / 'gate.sock'}", "--gate-name", "localhost",
                 "--listen", "127.0.0.1:18002", "--token"]) == 0
    forward = tmp_path / "fwd" / "nginx.conf"
    for secret in (forward, home / "credentials.yaml"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    found = re.search(r'"Bearer ([0-9a-f]{64})"', forward.read_text())
    assert found is not None
    token = found.group(1)
    from flwr.cli.auth_plugin import OidcCliPlugin
    from flwr.common.constant import ACCESS_TOKEN_KEY
    from flwr.supercore.credential_store.file_credential_store import FileCredentialStore

    plugin = OidcCliPlugin("127.0.0.1:18002")  # what flwr loads for a connection at that address
    plugin.store = FileCredentialStore(home / "credentials.yaml")
    plugin.load_tokens()
    assert dict(plugin.write_tokens_to_metadata([]))[ACCESS_TOKEN_KEY] == token
    for written in (server, bridge, gate.Gate(tmp_path / "fwd", forward)):
        command = written.command()
        test = subprocess.run([*command[:-2], "-t"], capture_output=True, text=True)
        assert test.returncode == 0, test.stderr
    with pytest.raises(ConfigError, match="--gate-name"):
        gate.forward_config(tmp_path / "f3", certs, "operator", f"unix:{sockets / 'gate.sock'}", "127.0.0.1:1")
    with pytest.raises(ConfigError, match="Unix socket only"):
        gate.bridge_config(tmp_path / "b2", certs, "127.0.0.1:1", "127.0.0.1:2")


def test_the_connection_is_added_next_to_the_others(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
                                      '[superlink.mine]\naddress = "10.0.0.1:9093"\ninsecure = true\n')
    ca = tmp_path / "ca.crt"
    up.write_connection(home, "secure", "127.0.0.1:18002", ca, {})
    up.write_connection(home, "secure", "127.0.0.1:18102", ca, {})  # again, another port: replaced, not doubled
    config = tomllib.loads((home / "config.toml").read_text())["superlink"]
    assert config["default"] == "local" and config["local"]["address"] == ":local:"
    assert config["mine"] == {"address": "10.0.0.1:9093", "insecure": True}
    assert config["secure"] == {"address": "127.0.0.1:18102", "root-certificates": str(ca)}
    assert (home / "config.toml").read_text().count("[superlink.secure]") == 1


FAKE_FLWR = """#!{python}
import json, sys
args = sys.argv[1:]
if args[0] == "run":
    print(json.dumps({{"success": True, "run-id": 7}}))
elif args[0] == "log":
    print("a log line")
elif args[0] == "ls":
    print(json.dumps({{"success": True, "runs": [{{"run-id": "7", "status": "{status}"}}]}}))
"""


@pytest.mark.parametrize("status, code", [("finished:completed", 0), ("finished:failed", 1)])
def test_run_exits_with_the_status_of_the_run(tmp_path, monkeypatch, capsys, status, code):
    fake = tmp_path / "flwr"
    fake.write_text(FAKE_FLWR.format(python=sys.executable, status=status))
    fake.chmod(0o755)
    monkeypatch.setattr(up, "flower_tool", lambda name: str(fake))
    assert flower_main(["run", "app", "secure", "--run-config", "rounds=1"]) == code
    captured = capsys.readouterr()
    assert ("finished:completed" in captured.out) if code == 0 else ("ended finished:failed" in captured.err)


@pytest.mark.parametrize("command", ["certificates", "gate", "up"])
def test_flower_names_where_the_deployment_commands_moved(capsys, command):
    assert flower_main([command, "anything", "--more"]) == 2
    assert capsys.readouterr().err == (f"fedhpro.flower: '{command}' moved: python -m fedhpro.deploy {command} ...\n")


def test_up_refuses_a_folder_without_sites(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no site folder"):
        up.Deployment(tmp_path / "empty", tmp_path / "state")
    assert Path(tmp_path / "state").exists() is False


def test_the_supervisor_ends_a_dead_node_s_processes_and_restarts_it(tmp_path, monkeypatch):
    """A child killed with SIGKILL: what it had started (in a session of its own, as flower-supernode starts
    flwr-clientapp) is ended, the child starts again after the backoff; a SuperNode refused with Flower's
    exit code 305 is reported once as such and retried."""
    import os
    import signal
    import time

    (tmp_path / "sites" / "site-a").mkdir(parents=True)
    deployment = up.Deployment(tmp_path / "sites", tmp_path / "state", out=open(os.devnull, "w"))  # noqa: SIM115
    (tmp_path / "state" / "run").mkdir(parents=True)
    (tmp_path / "state" / "logs").mkdir()
    monkeypatch.setattr(processes, "BACKOFF", (0.5,))  # the supervisor reads it where it lives
    said: list[str] = []
    monkeypatch.setattr(deployment, "say", said.append)
    node = deployment.add("node", ["bash", "-c", "setsid sleep 300 & echo $! > grandchild; exec sleep 300"])
    refused = deployment.add("refused", ["bash", "-c", "echo 'ERROR: Exit Code: 305'; exit 1"])
    try:
        old_cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            for child in (node, refused):
                deployment.launch(child)
            deadline = time.monotonic() + 30
            while not (tmp_path / "grandchild").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.3)
            deployment.check()  # remembers the grandchild
            grandchild = int((tmp_path / "grandchild").read_text())
            first = node.process.pid
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (node.process.pid == first or refused.failures < 2) and time.monotonic() < deadline:
                deployment.check()
                time.sleep(0.2)
        finally:
            os.chdir(old_cwd)
        assert node.process.pid != first and node.process.poll() is None  # restarted
        time.sleep(0.3)
        assert not up.alive(grandchild)  # the dead node's own-session child was ended
        assert sum("refused (Flower exit code 305)" in line for line in said) == 1
        assert any("node exited with code -9" in line for line in said)
        assert (tmp_path / "state" / "run" / "node.pid").read_text().strip() == str(node.process.pid)
    finally:
        deployment.stop()
    assert node.process.poll() is not None


@pytest.mark.slow
def test_stop_ends_what_a_killed_up_left_behind(tmp_path, capsys):
    """``up --stop`` after ``up`` itself was killed with SIGKILL: the process groups in STATE/run are ended."""
    (tmp_path / "run").mkdir()
    left = subprocess.Popen(["sleep", "300"], start_new_session=True)
    (tmp_path / "run" / "node.pid").write_text(f"{left.pid}\n")
    (tmp_path / "up.pid").write_text("999999999\n")  # no such process
    try:
        assert main(["up", "--stop", str(tmp_path)]) == 1
        assert left.wait(timeout=20) is not None
        assert f"ended the process groups it had left: [{left.pid}]" in capsys.readouterr().err
    finally:
        left.kill()
        left.wait()


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx-light)")
def test_the_operator_s_forwarder_passes_only_requests_with_its_token(tmp_path):
    """The gate and the operator's forwarder, running, with no SuperLink behind (its socket is missing): a
    request the forwarder passes reaches the gate, which passes it on and answers 502; one it refuses
    gets 403 from the forwarder (the gate's log then has no line for it)."""
    import socket
    import time

    def free() -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    certs = tmp_path / "certs"
    certificates.create(certs, ["localhost"], gate=True)
    gate_port, forward_port, token = free(), free(), "a1" * 32
    server = gate.server_config(tmp_path / "gate", certs, f"127.0.0.1:{gate_port}", f"unix:{tmp_path / 'none.sock'}")
    forward = gate.forward_config(tmp_path / "fwd", certs, "operator", f"localhost:{gate_port}",
                                  f"127.0.0.1:{forward_port}", gate_name="localhost", token=token)
    processes = [subprocess.Popen(g.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for g in (server, forward)]

    def status(authorization: str | None) -> object:
        return post_status(forward_port, certs / "ca.crt", "/v1/control/list-runs", authorization)

    try:
        deadline = time.monotonic() + 60
        while status(f"Bearer {token}") != 502 and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = {case: status(case) for case in (f"Bearer {token}", None, "Bearer wrong", f"bearer {token}",
                                                 f"Bearer {token}0", f"Bearer {token[:-1]}")}
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    assert seen == {f"Bearer {token}": 502, None: 403, "Bearer wrong": 403, f"bearer {token}": 403,
                    f"Bearer {token}0": 403, f"Bearer {token[:-1]}": 403}, seen
    passed = [line for line in (tmp_path / "gate" / "access.log").read_text().splitlines() if "list-runs" in line]
    assert passed and all(" 502 " in line and "role=operator" in line for line in passed), passed


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx-light)")
def test_a_node_s_entry_reaches_the_gate_through_its_forwarder_s_socket(tmp_path):
    """A node on a machine of its own, its processes in a private namespace: entry (TLS on loopback) -> the
    forwarder's Unix socket -> mutual TLS with the node's certificate -> the gate (no SuperLink behind: what
    the gate passes gets 502). The node's role holds along the chain: Fleet passes, Control gets 403."""
    import socket
    import time

    def free() -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    certs = tmp_path / "certs"
    certificates.create(certs, ["localhost"], nodes=1, gate=True)
    sockets = tmp_path / "s"
    sockets.mkdir(mode=0o700)
    gate_port, entry_port = free(), free()
    configs = [gate.server_config(tmp_path / "gate", certs, f"127.0.0.1:{gate_port}", f"unix:{sockets / 'none'}"),
               gate.forward_config(tmp_path / "fwd", certs, "supernode-1", f"localhost:{gate_port}",
                                   f"unix:{sockets / 'forward.sock'}", gate_name="localhost"),
               gate.entry_config(tmp_path / "entry", certs, "supernode-1", f"127.0.0.1:{entry_port}",
                                 f"unix:{sockets / 'forward.sock'}")]
    processes = [subprocess.Popen(g.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for g in configs]

    def status(path: str) -> object:
        return post_status(entry_port, certs / "ca.crt", path)  # the CA checked as flower-supernode checks it

    try:
        deadline = time.monotonic() + 60
        while status("/v1/fleet/get-run") != 502 and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = {path: status(path) for path in ("/v1/fleet/get-run", "/v1/control/list-runs")}
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    assert seen == {"/v1/fleet/get-run": 502, "/v1/control/list-runs": 403}, seen
    lines = (tmp_path / "gate" / "access.log").read_text().splitlines()
    assert lines and all("role=node" in line and 'client="CN=supernode-1,OU=node,O=fedhpro"' in line
                         for line in lines), lines
    with pytest.raises(ConfigError, match="Unix socket"):
        gate.entry_config(tmp_path / "e2", certs, "supernode-1", "127.0.0.1:1", "127.0.0.1:2")
    with pytest.raises(ConfigError, match="loopback"):
        gate.entry_config(tmp_path / "e3", certs, "supernode-1", "0.0.0.0:1", f"unix:{sockets / 'x'}")


def test_the_gate_logs_a_role_only_for_a_verified_certificate(tmp_path):
    """The access log's ``role=`` is the role of a certificate nginx verified ($ssl_client_verify = SUCCESS):
    the gate answers an expired operator certificate with 400, and its line must not read role=operator."""
    certificates.create(tmp_path / "certs", ["localhost"], gate=True)
    text = gate.server_config(tmp_path / "gate", tmp_path / "certs", "127.0.0.1:18000",
                              f"unix:{tmp_path / 'none.sock'}").config.read_text()
    block = text.split('map "$ssl_client_verify:$fedhpro_role" $fedhpro_logged_role {', 1)[1].split("}", 1)[0]
    assert [line.strip() for line in block.strip().splitlines()] == [
        'default "";', '"SUCCESS:operator" operator;', '"SUCCESS:node" node;']
    assert "role=$fedhpro_logged_role " in text and 'verify="$ssl_client_verify"' in text
    assert "role=$fedhpro_role" not in text  # the subject's role alone is never what the log shows


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx-light)")
def test_an_expired_operator_certificate_is_logged_without_a_role(tmp_path):
    """The running gate (no SuperLink behind: what it passes gets 502): the CA's operator certificate passes
    and is logged role=operator; the same subject, expired, gets 400 and a line with role= empty and the
    verification's failure."""
    import datetime
    import socket
    import time

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    certs = tmp_path / "certs"
    certificates.create(certs, ["localhost"], gate=True)
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.load_pem_x509_certificate((certs / "operator.crt").read_bytes()).subject
    expired = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=10)).not_valid_after(now - datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (tmp_path / "expired.crt").write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    certificates.write_file(tmp_path / "expired.key", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), True)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = gate.server_config(tmp_path / "gate", certs, f"127.0.0.1:{port}", f"unix:{tmp_path / 'none.sock'}")
    process = subprocess.Popen(server.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def status(cert: Path, key_file: Path) -> object:
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        context.check_hostname = False
        context.load_cert_chain(str(cert), str(key_file))
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
        try:
            connection.request("POST", "/v1/control/list-runs", body=b"")
            return connection.getresponse().status
        except OSError as error:
            return type(error).__name__
        finally:
            connection.close()

    try:
        deadline = time.monotonic() + 60
        while status(certs / "operator.crt", certs / "operator.key") != 502 and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = status(tmp_path / "expired.crt", tmp_path / "expired.key")
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert seen == 400, seen
    lines = (tmp_path / "gate" / "access.log").read_text().splitlines()
    refused = [line for line in lines if " 400 " in line]
    assert len(refused) == 1 and " role= " in refused[0], lines
    assert 'client="CN=operator,OU=operator,O=fedhpro"' in refused[0], lines
    assert 'verify="FAILED:certificate has expired"' in refused[0], lines
    passed = [line for line in lines if " 502 " in line]
    assert passed and all("role=operator " in line and 'verify="SUCCESS"' in line for line in passed), lines

"""Flower deployment secured with Flower's own mechanisms: TLS and registered (authenticated) SuperNodes.

The certificates and node keys come from ``python -m fedhpro.deploy
certificates`` (:mod:`fedhpro.deploy.certificates`); the unit tests check
them with an independent tool (``openssl``/``ssh-keygen`` where installed, else
the ``cryptography`` checks those tools make), the deployment test with
Flower itself, on the README's secured setup: ``python -m fedhpro.deploy up``
(a SuperLink with TLS, ``--enable-supernode-auth`` and ``--database`` on
127.0.0.1, nginx as a mutual-TLS gate with roles, each party's forwarder, 3
SuperNodes with their own folders). One deployment serves every check, to
keep the wall time low:

- the attack of the issue, refused at each step: a stranger holding only
  ``ca.crt`` (or a client certificate of another CA) cannot register a node,
  list runs or submit a run; a node's certificate cannot either (it may use
  the Fleet API only), and nothing reaches ``/v1/runtime``;
- the 3 registered nodes run 2 rounds of fedhpro on their own data, submitted
  with ``python -m fedhpro.flower run`` (exit 0 = ``finished:completed``), with
  the simulator's numbers;
- a SuperNode with a valid but unregistered key, through a node's forwarder,
  is refused by the SuperLink (Flower's exit code 305, never a node id);
- a SuperNode that does not trust the CA fails the TLS handshake and exits;
- nothing listens outside 127.0.0.0/8; in this host's network namespace only
  the gate and the operator's forwarder listen (the SuperLink and each node
  in a private one, as ``up``'s first line says), and ``up --stop`` leaves no
  process;
- straight at the SuperLink (from inside its namespace, as root), ``flwr ls``
  with ``ca.crt`` alone succeeds: it asks no client certificate, which is
  why nothing else may reach it;
- (run as root) another local user (uid ``nobody``, :func:`test_deploy_local_users.attack`)
  against every port of the range, every Unix socket in the state folder,
  the namespaces and the keys: ``flwr ls``/``flwr supernode register`` get 400
  at the gate and 403 at the operator's forwarder (no token), every other port
  refuses the connection, the sockets, namespaces and keys refuse to open;
  the same probes as the owner (root) reach the sockets and namespaces.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from test_deploy_local_users import attack  # noqa: E402
from test_flower import CORE_KEYS, REPO, assert_same_state, core, read_rows, reference  # noqa: E402
from test_flower_deployment import ENVIRONMENT, alive, descendants, flower_tool  # noqa: E402
from test_flower_own_data import SITES, settings, write_site  # noqa: E402

from fedhpro.deploy import certificates  # noqa: E402
from fedhpro.deploy.__main__ import main  # noqa: E402
from fedhpro.deploy.up import NO_UNIX_SOCKETS, Ports, port_free  # noqa: E402
from fedhpro.errors import ConfigError  # noqa: E402
from fedhpro.flower.roster import load_roster  # noqa: E402


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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------- the secured deployment
UP_TIMEOUT = 300  # seconds for `up` to have everything running (about 20 s on an idle machine)
RUN_TIMEOUT = 600  # seconds for the 2-round run (about 90 s on a busy 2-core machine)
NGINX_PAGE = b"<center>nginx</center>"  # nginx's own error page: the request went no further than the gate


def listening_addresses(pids: set[int], host_only: bool = False) -> list[str]:
    """The local addresses of every TCP socket in LISTEN state held by ``pids``, each read from the tables of
    the process's own network namespace (/proc/PID/net/tcp, tcp6); ``host_only``: only those of processes
    in this process's namespace (what a local user of the host can connect to)."""
    here = os.readlink("/proc/self/ns/net")
    found = set()
    for pid in pids:
        inodes = set()
        try:
            if host_only and os.readlink(f"/proc/{pid}/ns/net") != here:
                continue
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            tables = [Path(f"/proc/{pid}/net/{name}").read_text() for name in ("tcp", "tcp6")]
        except OSError:
            continue
        for table in tables:
            for line in table.splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word little-endian
                found.add(f"{ipaddress_text(raw)}:{int(port, 16)}")
    return sorted(found)


def ipaddress_text(raw: bytes) -> str:
    import ipaddress

    address = ipaddress.ip_address(raw)
    if address.version == 6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def outside_loopback(addresses: list[str]) -> list[str]:
    import ipaddress

    return [a for a in addresses if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]


def free_base(nodes: int) -> int:
    """A base port whose whole range (:class:`fedhpro.deploy.up.Ports`) is free on 127.0.0.1."""
    for _ in range(100):
        base = random.randrange(20000, 50000)
        if all(port_free(port) for port in Ports(base, nodes).all()):
            return base
    raise AssertionError("no free port range found")


def post(port: int, path: str, ca: Path, cert: Path | None = None, key: Path | None = None) -> tuple[Any, bytes]:
    """``POST path`` to 127.0.0.1:port over TLS (with a client certificate when given): (status, body), or
    (the error's name, b"") when the connection itself failed."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)
    try:
        connection.request("POST", path, body=b"", headers={"content-type": "application/protobuf"})
        response = connection.getresponse()
        return response.status, response.read()
    except (ssl.SSLError, OSError) as error:
        return type(error).__name__, b""
    finally:
        connection.close()


class Deployment:
    """``python -m fedhpro.deploy up`` in a process group of its own, and everything else a test starts."""

    def __init__(self, tmp_path: Path, sites: Path, state: Path | None = None):
        self.root = tmp_path
        self.home, self.logs = tmp_path / "flwr-home", tmp_path / "logs"
        self.state = state or tmp_path / "state"
        self.home.mkdir()
        self.logs.mkdir()
        self.ports = Ports(free_base(len(SITES)), len(SITES))
        self.env = {**ENVIRONMENT, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.env.pop("FEDHPRO_DATA_DIR", None)
        self.sites = sites
        self.started: dict[str, subprocess.Popen] = {}
        self.seen: set[int] = set()

    def start(self, name: str, args: list[str], inside: str | None = None) -> subprocess.Popen:
        args = [*(self.inside(inside) if inside else []), *args]
        with open(self.logs / f"{name}.log", "ab") as log:
            process = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.root)
        self.started[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def remember(self) -> set[int]:
        for process in self.started.values():
            if process.poll() is None:
                self.seen |= {process.pid} | descendants(process.pid)
        return self.seen

    def tails(self) -> str:
        paths = sorted(self.logs.glob("*.log")) + sorted((self.state / "logs").glob("*.log"))
        return "\n".join(f"----- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
                         for p in paths)

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            raise AssertionError(f"{message}\n{self.tails()}")

    def up(self) -> None:
        self.start("up", [sys.executable, "-m", "fedhpro.deploy", "up", str(self.sites), "--state", str(self.state),
                          "--port", str(self.ports.base), "--connection", "secure"])
        deadline = time.monotonic() + UP_TIMEOUT
        while "stop: Ctrl-C" not in self.log("up"):
            self.remember()
            self.check(self.started["up"].poll() is None, "fedhpro up exited while starting")
            self.check(time.monotonic() < deadline, f"fedhpro up not ready after {UP_TIMEOUT} s")
            time.sleep(0.5)

    def connect(self, name: str, port: int, ca: Path) -> None:
        with open(self.home / "config.toml", "a") as config:
            config.write(f'\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\nroot-certificates = "{ca}"\n')

    def inside(self, name: str) -> list[str]:
        """A command prefix that runs in the network namespace of ``up``'s process ``name`` (STATE/run): none
        when it is this one's; not root, through the user namespace ``up`` made it in (our uid owns it)."""
        pid = int((self.state / "run" / f"{name}.pid").read_text())
        if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            return []
        user = [] if os.geteuid() == 0 else [f"--user=/proc/{pid}/ns/user", "--preserve-credentials"]
        return ["nsenter", *user, f"--net=/proc/{pid}/ns/net", "--"]

    def flwr(self, *args: str, inside: str | None = None) -> dict:
        prefix = self.inside(inside) if inside else []
        done = subprocess.run([*prefix, flower_tool("flwr"), *args, "--format", "json"], env=self.env,
                              capture_output=True, text=True, timeout=180, cwd=self.root)
        with open(self.logs / "flwr.log", "a") as log:
            log.write(f"$ flwr {' '.join(args)} (exit {done.returncode})\n{done.stdout}{done.stderr}\n")
        return json.loads(done.stdout[done.stdout.index("{"):])

    def wait(self, name: str, seconds: float) -> int:
        process = self.started[name]
        deadline = time.monotonic() + seconds
        while process.poll() is None:
            self.remember()
            self.check(time.monotonic() < deadline, f"{name} still runs after {seconds:.0f} s")
            time.sleep(1)
        return process.returncode

    def stop_everything(self) -> list[int]:
        pids = self.remember()
        for process in self.started.values():
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.3)
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.started.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        return sorted(pid for pid in pids if alive(pid))


def check_other_user(net: Deployment, isolated: bool, first: str, registered: set[int]) -> None:
    """:func:`test_deploy_local_users.attack` against the running deployment, and what it must find: isolated,
    only the gate (400) and the operator's forwarder (403) take a connection; without namespaces, as ``up``'s
    first line says, the SuperLink's port takes ``flwr`` commands from anyone."""
    ports, ca = net.ports, net.state / "certs" / "ca.crt"
    parties = {name: int((net.state / "run" / f"{name}.pid").read_text())
               for name in ("superlink", first, f"{first}-forward")}
    found = attack(net.state, ports.all(), ca, parties)
    with open(net.logs / "attack.json", "w") as record:
        json.dump(found, record, indent=1)
    owner, other = found["owner"], found["other"]
    net.check(other["uid"] == 65534 and owner["uid"] == os.getuid(), f"uids: {other['uid']}, {owner['uid']}")
    net.check(other["state-parent-open"] and owner["state-parent-open"], "the state's parent is not open to all")
    refused = {"tcp": "open", "list-runs": "400", "flwr ls": "400", "flwr supernode register": "400"}
    no_token = {"tcp": "open", "list-runs": "403", "flwr ls": "403", "flwr supernode register": "403"}
    for port in ports.all():
        expected = (refused if port == ports.gate else no_token if port == ports.operator
                    else {"tcp": "ECONNREFUSED"} if isolated else None)
        if expected is not None:  # without namespaces the nodes' ports answer too: not asserted
            net.check(other["ports"][str(port)] == expected, f"port {port}: {other['ports'][str(port)]}")
    if not isolated:
        open_link = other["ports"][str(ports.superlink)]
        net.check(open_link["flwr ls"] == open_link["flwr supernode register"] == "success",
                  f"up said the SuperLink is open to local users, yet: {open_link}")
    net.check(len(other["sockets"]) == 2 and set(other["sockets"].values()) == {"EACCES"}, str(other["sockets"]))
    net.check(set(owner["sockets"].values()) == {"connected"}, f"the owner's probe: {owner['sockets']}")
    net.check(set(other["namespaces"].values()) == {"EACCES"}, str(other["namespaces"]))
    net.check(set(owner["namespaces"].values()) == {"opened"}, f"the owner's probe: {owner['namespaces']}")
    net.check(set(other["secrets"].values()) == {"EACCES"}, str(other["secrets"]))
    after = {int(node["node-id"]) for node in net.flwr("supernode", "ls", "secure")["nodes"]}
    runs = net.flwr("ls", "secure")["runs"]
    # without namespaces the owner's probe and the other user's each registered a key of their own
    net.check(len(runs) == 1 and (after == registered if isolated else len(after) == len(registered) + 2),
              f"after the other user: nodes {after}, runs {len(runs)}")


@pytest.mark.deploy
@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                    reason="nginx is not installed (apt-get install nginx-light)")
def test_secured_deployment_refuses_strangers_and_nodes_and_runs_fedhpro_like_the_simulator(tmp_path):
    sites = tmp_path / "sites"
    for k, (site, classes) in enumerate(SITES.items()):
        write_site(sites / site, classes, seed=k)
    config = {**settings(), "checkpoint_every": 1, "out": str(tmp_path / "out")}
    flower_keys = {"flower.node-auth": True}  # the SuperLink authenticates the nodes: tie clients to their keys
    # the state in a folder every user may enter (pytest's is root's only), so the other user's refusals
    # measure the state folder's own permissions
    open_parent = Path(tempfile.mkdtemp(prefix="fedhpro-secure-"))
    open_parent.chmod(0o755)
    net = Deployment(tmp_path, sites, state=open_parent / "state")
    try:
        net.up()
        certs, ports = net.state / "certs", net.ports
        ca = certs / "ca.crt"
        said = net.log("up")
        isolated = "run in a private network namespace" in said
        net.check(NO_UNIX_SOCKETS in said, "up did not say why Flower's listeners stay on TCP")
        addresses = listening_addresses(net.remember())
        net.check(len(addresses) >= 4, f"expected the gate, SuperLink and forwarders to listen: {addresses}")
        net.check(not outside_loopback(addresses), f"listening outside 127.0.0.0/8: {addresses}")
        on_host = listening_addresses(net.remember(), host_only=True)
        if isolated:  # the SuperLink, the nodes' forwarders and their APIs are in private namespaces
            net.check(on_host == sorted(f"127.0.0.1:{p}" for p in (ports.gate, ports.operator)),
                      f"listening in the host's network namespace: {on_host}")
            net.check(f"127.0.0.1:{ports.superlink}" in addresses, f"no SuperLink listening: {addresses}")
        # which site is node 1 (its forwarder is ports.forwarder(1)): the first name in STATE/sites.json
        first = json.loads((net.state / "sites.json").read_text())["sites"][0]
        # the operator's roster up wrote: every site with its sizes and the node key registered for it; the run
        # below uses it, so each node is admitted by the key the SuperLink lists for it
        roster = load_roster(net.state / "roster.yaml")
        net.check(sorted(roster.sites) == sorted(SITES) and all(site.key for site in roster.sites.values()),
                  f"up's roster: {roster}")
        flower_keys["flower.roster"] = str(net.state / "roster.yaml")

        # --- a stranger with ca.crt only, straight to the gate: the real flwr commands of the attack
        net.connect("stranger", ports.gate, ca)
        evil = tmp_path / "evil"
        evil.mkdir()
        evil_private, evil_public = certificates.node_key_pair()
        certificates.write_file(evil / "evil.key", evil_private, True)
        (evil / "evil.pub").write_bytes(evil_public)
        # --- a node's certificate, through that node's own forwarder (from inside the node's namespace)
        net.connect("as-node", ports.forwarder(1), ca)
        for connection, status in (("stranger", "400"), ("as-node", "403")):
            for args in (("supernode", "register", str(evil / "evil.pub"), connection), ("ls", connection),
                         ("run", str(REPO / "examples" / "flower"), connection)):
                reply = net.flwr(*args, inside=f"{first}-forward" if connection == "as-node" else None)
                net.check(not reply["success"] and status in reply.get("error-message", ""),
                          f"flwr {' '.join(args)} was not refused with {status}: {reply}")
        # --- the same endpoints with a client certificate of another CA, and with a node's certificate
        other = tmp_path / "other-ca"
        certificates.create(other, ["127.0.0.1"], nodes=1, gate=True)
        node_cert, node_key = certs / "supernode-1.crt", certs / "supernode-1-tls.key"
        operator_cert, operator_key = certs / "operator.crt", certs / "operator.key"
        for path in ("/v1/control/register-node", "/v1/control/list-runs", "/v1/control/start-run"):
            for cert, key, expected in ((None, None, 400), (other / "operator.crt", other / "operator.key", 400),
                                        (other / "supernode-1.crt", other / "supernode-1-tls.key", 400),
                                        (node_cert, node_key, 403)):
                status, body = post(ports.gate, path, ca, cert, key)
                net.check(status == expected and NGINX_PAGE in body, f"{path} with {cert}: {status} {body[:200]}")
        for path in ("/v1/runtime/pull-messages", "/v1/fleet/../control/list-runs", "/docs", "/openapi.json"):
            for cert, key in ((operator_cert, operator_key), (node_cert, node_key)):
                status, body = post(ports.gate, path, ca, cert, key)
                net.check(status == 403 and NGINX_PAGE in body, f"{path} with {cert.name}: {status} {body[:200]}")
        status, _ = post(ports.gate, "/v1/fleet/get-run", ca, operator_cert, operator_key)
        net.check(status == 403, f"the operator's certificate reached the Fleet API: {status}")
        registered = {int(node_id) for node_id in json.loads((net.state / "nodes.json").read_text()).values()}
        nodes = net.flwr("supernode", "ls", "secure")["nodes"]
        net.check({int(node["node-id"]) for node in nodes} == registered, f"a node was added: {nodes}")
        net.check(net.flwr("ls", "secure")["runs"] == [], "a run was submitted by someone")

        # --- an unregistered key behind a valid node certificate, and a node that does not trust the CA
        net.start("intruder", [flower_tool("flower-supernode"), "--root-certificates", str(ca),
                               "--auth-supernode-private-key", str(evil / "evil.key"),
                               "--superlink", f"127.0.0.1:{ports.forwarder(1)}", "--host", "127.0.0.1",
                               "--port", str(free_base(0)), "--node-config", f'data-dir="{sites / "lab-0"}"'],
                  inside=f"{first}-forward")
        net.start("untrusting", [flower_tool("flower-supernode"),
                                 "--auth-supernode-private-key", str(certs / "supernode-1.key"),
                                 "--superlink", f"127.0.0.1:{ports.forwarder(1)}", "--host", "127.0.0.1",
                                 "--port", str(free_base(0))], inside=f"{first}-forward")
        # --- the operator's run, as the README submits it
        run_config = " ".join(f"{key}={json.dumps(value)}" for key, value in {**config, **flower_keys}.items())
        net.start("run", [sys.executable, "-m", "fedhpro.flower", "run", str(REPO / "examples" / "flower"), "secure",
                          "--run-config", run_config])
        net.check(net.wait("intruder", 180) != 0, "the unregistered SuperNode exited with code 0")
        intruder = net.log("intruder")
        net.check("Exit Code: 305" in intruder and "SuperNode ID" not in intruder,
                  "the unregistered SuperNode was not refused at activation")
        net.check(net.wait("untrusting", 180) != 0, "the SuperNode without the CA exited with code 0")
        net.check("CERTIFICATE_VERIFY_FAILED" in net.log("untrusting"), "the untrusting node did not fail on TLS")
        addresses = listening_addresses(net.remember())
        net.check(not outside_loopback(addresses), f"listening outside 127.0.0.0/8 during the run: {addresses}")

        net.check(net.wait("run", RUN_TIMEOUT) == 0, "python -m fedhpro.flower run did not exit 0")
        net.check(re.search(r"run \d+ finished:completed", net.log("run")) is not None, "no finished:completed")
        runs = net.flwr("ls", "secure")["runs"]
        net.check(len(runs) == 1 and runs[0]["network-traffic"]["total-bytes"] > 0, f"runs: {runs}")
        nodes = {int(node["node-id"]): node["status"] for node in net.flwr("supernode", "ls", "secure")["nodes"]}
        net.check(nodes == {node_id: "online" for node_id in registered}, f"nodes: {nodes}")

        # --- why the SuperLink must be out of reach: it asks no client certificate (ca.crt is all flwr needs)
        net.connect("direct", ports.superlink, ca)
        direct = net.flwr("ls", "direct", inside="superlink")
        net.check(direct["success"] and len(direct["runs"]) == 1, f"flwr ls straight at the SuperLink: {direct}")

        # --- another local user of this host, and the owner for contrast (test_deploy_local_users.attack);
        # becoming uid nobody needs root
        if os.geteuid() == 0:
            check_other_user(net, isolated, first, registered)

        pids = net.remember()
        stopped = subprocess.run([sys.executable, "-m", "fedhpro.deploy", "up", "--stop", str(net.state)],
                                 env=net.env, capture_output=True, text=True, timeout=120)
        net.check(stopped.returncode == 0, f"up --stop failed: {stopped.stdout}{stopped.stderr}")
        net.wait("up", 60)
        time.sleep(0.5)
        net.check(not [pid for pid in pids if alive(pid)], f"left running: {[p for p in pids if alive(p)]}")
    finally:
        left = net.stop_everything()
        if (net.state / "logs").is_dir():  # kept with the test's other logs: the state folder goes
            shutil.copytree(net.state / "logs", tmp_path / "up-logs", dirs_exist_ok=True)
        shutil.rmtree(open_parent, ignore_errors=True)
    assert left == [], f"processes left running: {left}"

    rows = read_rows(tmp_path / "out" / "metrics.jsonl")
    expected = {key: value for key, value in config.items() if key != "out"}
    # nodes holding their own data send claims: update_bound=auto is on there, so the simulator turns it on too
    expected_rows, expected_state = reference({**expected, "data_dir": str(sites), "aggregation.update_bound": "on"},
                                              tmp_path / "reference")
    assert len(rows) == 2 and all(row["participants"] == [0, 1, 2] for row in rows)
    assert core(rows) == core(expected_rows), CORE_KEYS
    assert [row["client_accuracy"] for row in rows] == [row["client_accuracy"] for row in expected_rows]
    assert_same_state(torch.load(tmp_path / "out" / "server_state.pt", weights_only=True)["server"], expected_state)

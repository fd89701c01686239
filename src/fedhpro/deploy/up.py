"""``python -m fedhpro.deploy up SITES_DIR``: a secured Flower deployment on loopback, supervised.

One SuperNode per site folder of ``SITES_DIR`` (own-data mode: the node's
``data-dir`` is the site folder), behind the gate of :mod:`fedhpro.deploy.gate`:

- certificates and keys (``certificates.create(..., gate=True)``) in
  ``STATE/certs`` on the first start, reused afterwards;
- the SuperLink with TLS, ``--enable-supernode-auth`` and ``--database
  STATE/superlink.db`` (a restart keeps the registered keys), on 127.0.0.1 of
  a **private network namespace** (:class:`Namespace`) with the gate's bridge
  beside it on an owner-only Unix socket: Flower 1.42 takes no Unix socket
  (:data:`NO_UNIX_SOCKETS`), and its SuperLink asks no client certificate, so
  this is how no other local user reaches it;
- nginx as the gate (mutual TLS, roles; 127.0.0.1 and, for the nodes, an
  owner-only Unix socket) and one nginx forwarder per party: the operator's
  on 127.0.0.1, passing only requests with the operator's token (a fresh
  secret each start, in ``$FLWR_HOME/credentials.yaml``, Flower's own
  credential store, which ``flwr`` sends as ``Authorization: Bearer``), each
  node's in the node's own private network namespace with its SuperNode;
- the node keys registered through the operator's forwarder (once; the ids are
  kept in ``STATE/nodes.json``), and a flwr connection written into
  ``$FLWR_HOME/config.toml`` next to the connections already there;
- a supervisor: every process in its own process group, its pid in
  ``STATE/run/<name>.pid``; a process that dies is restarted (its group and
  every process it had started are killed first, so no ``flwr-clientapp`` of a
  dead node keeps knocking on its successor); a SuperNode refused because its
  previous session is still "online" (exit 305 for up to ~60 s after a kill -9)
  is retried with backoff, and a process that keeps failing for
  :data:`GIVE_UP` seconds is left down with one line naming its log.

Where no private network namespace can be made (``unshare`` refused), or
with ``--install-dependencies`` (installing needs the network), the SuperLink
and the nodes stay on the host's 127.0.0.1 and ``up`` says in one line who can
then reach them.

Ctrl-C or SIGTERM (``up --stop STATE``) stops everything: nodes first (they
say goodbye to the SuperLink), then forwarders, gate and SuperLink.

The namespaces are made in :mod:`fedhpro.deploy.namespaces`, the children
supervised by :mod:`fedhpro.deploy.processes`; the names they define that
callers and tests use are re-exported here (:data:`__all__`).
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedhpro.bounded import load_json, read_json_file
from fedhpro.data.clients import scan_client
from fedhpro.data.clients_options import ClientsOptions
from fedhpro.deploy import certificates, gate
from fedhpro.deploy.namespaces import Namespace, in_namespace, new_namespace
from fedhpro.deploy.processes import (
    BACKOFF,
    GIVE_UP,
    REFUSED_EXIT,
    STABLE,
    Child,
    Supervisor,
    alive,
    become_subreaper,
    below,
    descendants_map,
    end_left_behind,
    kill_all,
    stop_running,
)
from fedhpro.errors import ConfigError
from fedhpro.files import write_atomic

# importers and tests use these names from here, the moved ones included
__all__ = [
    "BACKOFF", "FLOWER_ENV", "GIVE_UP", "NO_UNIX_SOCKETS", "REFUSED_EXIT", "STABLE", "Child", "ConfigError",
    "Deployment", "Namespace", "Ports", "UnixHTTPConnection", "alive", "below", "become_subreaper",
    "connection_block", "descendants_map", "end_left_behind", "flower_tool", "flwr_home", "in_namespace",
    "kill_all", "new_namespace", "port_free", "run_up", "sites_of", "stop_running", "submit", "unix_health",
    "write_connection",
]

FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
#: what was measured against Flower 1.42 (tests/test_deploy_local_users.py): why its listeners stay on TCP
NO_UNIX_SOCKETS = ("Flower 1.42 takes no Unix socket (flower-superlink --host unix:PATH: uvicorn looks it up "
                   "as a host name and fails; flower-supernode --superlink unix:PATH: exit code 600, address cannot "
                   "be parsed; flwr's address unix:PATH: 'Connection to the SuperLink is unavailable') and its "
                   "SuperLink asks no client certificate")


def flower_tool(name: str) -> str:
    """A console script of flwr: next to this interpreter (a venv's bin), else on PATH."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name) or name


def flwr_home(env: Mapping[str, str] | None = None) -> Path:
    variables: Mapping[str, str] = os.environ if env is None else env
    return Path(variables.get("FLWR_HOME") or Path.home() / ".flwr")


def sites_of(sites_dir: Path) -> list[Path]:
    """The site folders (every visible sub-folder), sorted by name."""
    if not sites_dir.is_dir():
        raise ConfigError(f"{sites_dir} is not a folder; give a folder holding one folder per site")
    sites = sorted(p.resolve() for p in sites_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not sites:
        raise ConfigError(f"{sites_dir} holds no site folder (one sub-folder per site, each with train/ and test/)")
    for site in sites:
        if any(c in str(site) for c in '"\\'):
            raise ConfigError(f"site path {site} holds a quote or backslash; rename it")
    return sites


@dataclass(frozen=True)
class Ports:
    """Every port of a deployment, from one base: the gate, the SuperLink, the operator's forwarder,
    then each node's forwarder and each node's own ClientApp API (the SuperLink's and the nodes' on the
    127.0.0.1 of their private network namespaces, when :meth:`Deployment.isolate` made them)."""

    base: int
    nodes: int

    @property
    def gate(self) -> int:
        return self.base

    @property
    def superlink(self) -> int:
        return self.base + 1

    @property
    def operator(self) -> int:
        return self.base + 2

    def forwarder(self, k: int) -> int:  # k: 1-based node index
        return self.base + 2 + k

    def node_api(self, k: int) -> int:
        return self.base + 2 + self.nodes + k

    def all(self) -> list[int]:
        return list(range(self.base, self.base + 3 + 2 * self.nodes))


def connection_block(name: str, address: str, ca: Path) -> str:
    return f'[superlink.{name}]\naddress = "{address}"\nroot-certificates = "{ca}"\n'


def write_connection(home: Path, name: str, address: str, ca: Path, env: dict[str, str]) -> Path:
    """Add (or update) the table ``[superlink.<name>]`` in ``home/config.toml``, keeping every other
    connection (``local`` included: a missing file is first made by flwr itself, with its defaults)."""
    path = home / "config.toml"
    if not path.exists():
        subprocess.run([flower_tool("flwr"), "config", "list"], env=env, capture_output=True, timeout=120)
    text = path.read_text() if path.exists() else ""
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML ({error}); fix it, then start again") from None
    header = f"[superlink.{name}]"
    lines, kept, skipping = text.splitlines(), [], False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped == header
        if not skipping:
            kept.append(line)
    body = "\n".join(kept).rstrip("\n")
    new = (body + "\n\n" if body else "") + connection_block(name, address, ca)
    parsed = tomllib.loads(new)["superlink"][name]
    assert parsed["address"] == address
    if new != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, new)  # the project's one atomic writer (a temporary file beside it, then a rename)
    return path


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the bridge's)."""

    def __init__(self, path: Path, timeout: float = 3):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))


def unix_health(path: Path) -> bool:
    """Whether ``GET /health`` through the Unix socket ``path`` answers 200."""
    connection = UnixHTTPConnection(path)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()



class Deployment(Supervisor):
    """See the module docstring. ``base_port``: the gate; the others follow (:class:`Ports`)."""

    def __init__(self, sites_dir: str | os.PathLike, state: str | os.PathLike, base_port: int = 18000,
                 connection: str = "fedhpro-up", install_dependencies: bool = False,
                 out=sys.stdout):
        self.sites = sites_of(Path(sites_dir))
        self.state = Path(state).resolve()
        self.certs = self.state / "certs"
        self.ports = Ports(base_port, len(self.sites))
        self.connection = connection
        self.install_dependencies = install_dependencies
        self.out = out
        self.env = {**os.environ, **FLOWER_ENV}
        self.home = flwr_home(self.env)
        self.children: dict[str, Child] = {}
        self.namespaces: dict[str, Namespace] = {}
        self.isolation = ""  # why the SuperLink and nodes are (or are not) in private namespaces: said at start
        self.token = secrets.token_hex(32)  # the operator's forwarder passes requests with it only
        self.stopping = False

    # ------------------------------------------------------------------ files
    def node_names(self) -> dict[str, int]:
        """site name -> node index (1-based), fixed in STATE/sites.json at the first start."""
        record = self.state / "sites.json"
        names = [site.name for site in self.sites]
        if record.exists():
            saved = read_json_file(record, ConfigError)
            if saved["sites"] != names:
                raise ConfigError(f"{self.state} was made for the sites {saved['sites']}, not {names}; "
                                  "use another --state folder for another set of sites")
        else:
            record.write_text(json.dumps({"sites": names, "base_port": self.ports.base}, indent=1) + "\n")
        return {name: k for k, name in enumerate(names, 1)}

    def prepare(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state, 0o700)
        for folder in ("run", "logs"):
            (self.state / folder).mkdir(exist_ok=True)
        if len(set(site.name for site in self.sites)) != len(self.sites):
            raise ConfigError("two site folders share a name")
        if not (self.certs / certificates.CA_CERT).exists():
            # "localhost" first: the certificate's DNS name and CN, which nginx checks (it checks no IP address)
            certificates.create(self.certs, ["localhost", "127.0.0.1"], nodes=len(self.sites), gate=True)
        self.index = self.node_names()
        self.sockets = self.state / "s"  # short: a Unix socket path holds at most 108 bytes
        self.sockets.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.sockets, 0o700)
        for name in ("gate.sock", "link.sock"):
            gate.unix_path(f"unix:{self.sockets / name}")  # refuses a path too long, in one line
        busy = [port for port in self.ports.all() if not port_free(port)]
        if busy:
            raise ConfigError(f"port(s) {busy} on 127.0.0.1 are in use (a deployment already up?); stop it, "
                              f"or choose another --port (this one needs {self.ports.base}-{self.ports.all()[-1]})")

    # ------------------------------------------------------------------ processes
    def health(self, port: int, token: str | None = None) -> bool:
        context = ssl.create_default_context(cafile=str(self.certs / certificates.CA_CERT))
        request = urllib.request.Request(f"https://127.0.0.1:{port}/health",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=3, context=context) as r:
                return r.status == 200
        except OSError:
            return False

    def isolate(self) -> None:
        """Make the SuperLink's and each node's private network namespace, or say why not (:attr:`isolation`)."""
        names = ["superlink"] + [site.name for site in self.sites]
        if self.install_dependencies:
            self.isolation = (f"{NO_UNIX_SOCKETS}; with --install-dependencies (it needs the network) the SuperLink "
                              f"and nodes stay on this host's 127.0.0.1, where every local user reaches the "
                              f"SuperLink (127.0.0.1:{self.ports.superlink}) as operator")
            return
        try:
            for name in names:
                self.namespaces[name] = new_namespace(name)
        except OSError as error:
            for namespace in self.namespaces.values():
                namespace.close()
            self.namespaces.clear()
            self.isolation = (f"{NO_UNIX_SOCKETS}, and no private network namespace could be made ({error}): "
                              f"every local user reaches the SuperLink (127.0.0.1:{self.ports.superlink}) as "
                              "operator and each node's forwarder and API")
            return
        self.isolation = (f"{NO_UNIX_SOCKETS}: the SuperLink and each node run in a private network namespace; "
                          f"other local users reach only the gate (127.0.0.1:{self.ports.gate}, a client "
                          f"certificate needed) and the operator's forwarder (127.0.0.1:{self.ports.operator}, "
                          "the operator's token needed)")

    def write_token(self) -> Path:
        """The operator's token into Flower's credential store for the operator's forwarder's address, so
        that ``flwr`` sends it (``Authorization: Bearer``); the store's file is owner-only."""
        return gate.store_flwr_token(self.home, f"127.0.0.1:{self.ports.operator}", self.token)

    def flwr(self, *args: str) -> dict:
        done = subprocess.run([flower_tool("flwr"), *args, "--format", "json"], env=self.env,
                              capture_output=True, text=True, timeout=180)
        try:
            reply = load_json(done.stdout[done.stdout.index("{"):], "flwr's reply")
        except ValueError:
            reply = {"success": False, "error-message": (done.stdout + done.stderr).strip()[-500:]}
        if not reply.get("success", False):
            raise ConfigError(f"flwr {' '.join(args)} failed: {reply.get('error-message', reply)}")
        return reply

    def define(self) -> None:
        c = self.certs
        ca, server_cert, server_key = (str(c / certificates.CA_CERT), str(c / certificates.SERVER_CERT),
                                       str(c / certificates.SERVER_KEY))
        p = self.ports
        link_socket, gate_socket = self.sockets / "link.sock", self.sockets / "gate.sock"
        link_namespace = self.namespaces.get("superlink")
        # the bridge first: the SuperLink's health is read through it (it is in the SuperLink's namespace)
        bridge = gate.bridge_config(self.state / "bridge", c, f"unix:{link_socket}", f"127.0.0.1:{p.superlink}")
        self.add("bridge", bridge.command(), ready=link_socket.exists, namespace=link_namespace,
                 sockets=(link_socket,))
        link = ["--ssl-ca-certfile", ca, "--ssl-certfile", server_cert, "--ssl-keyfile", server_key]
        self.add("superlink", [flower_tool("flower-superlink"), *link, "--enable-supernode-auth",
                               "--host", "127.0.0.1", "--port", str(p.superlink),
                               "--database", str(self.state / "superlink.db"),
                               *([] if self.install_dependencies else ["--disable-runtime-dependency-installation"])],
                 ready=lambda: unix_health(link_socket), namespace=link_namespace)
        server = gate.server_config(self.state / "gate", c, f"127.0.0.1:{p.gate}", f"unix:{link_socket}",
                                    local=f"unix:{gate_socket}")
        self.add("gate", server.command(), ready=lambda: not port_free(p.gate) and gate_socket.exists(),
                 sockets=(gate_socket,))
        self.gate_name = gate.check_name(c / certificates.SERVER_CERT)
        operator = gate.forward_config(self.state / "operator-forward", c, certificates.OPERATOR,
                                       f"127.0.0.1:{p.gate}", f"127.0.0.1:{p.operator}", gate_name=self.gate_name,
                                       token=self.token)
        self.add("operator-forward", operator.command(), ready=lambda: self.health(p.operator, self.token))
        for site in self.sites:
            k = self.index[site.name]
            namespace = self.namespaces.get(site.name)
            prefix = self.state / "nodes" / site.name
            # in its own namespace a node reaches the gate through the gate's owner-only socket
            forward = gate.forward_config(prefix / "forward", c, f"supernode-{k}", f"unix:{gate_socket}",
                                          f"127.0.0.1:{p.forwarder(k)}", gate_name=self.gate_name)
            port = p.forwarder(k)
            self.add(f"{site.name}-forward", forward.command(), namespace=namespace,
                     ready=lambda port=port, namespace=namespace: in_namespace(namespace, lambda: self.health(port)))
            node_state = prefix / "node-state"
            node_state.mkdir(parents=True, exist_ok=True)
            private_key = c / certificates.node_key_names(k)[0]
            self.add(site.name, [flower_tool("flower-supernode"), "--root-certificates", ca,
                                 "--auth-supernode-private-key", str(private_key),
                                 "--superlink", f"127.0.0.1:{p.forwarder(k)}",
                                 "--host", "127.0.0.1", "--port", str(p.node_api(k)),
                                 "--node-config", f'data-dir="{site}" state-dir="{node_state}"'],
                     namespace=namespace)

    def register(self) -> dict[str, int]:
        """Register each site's node key once (ids kept in STATE/nodes.json; the database keeps the keys)."""
        record = self.state / "nodes.json"
        ids = read_json_file(record, ConfigError) if record.exists() else {}
        nodes = self.flwr("supernode", "ls", self.connection)["nodes"]
        listed = {int(node["node-id"]): node["status"] for node in nodes}
        for site in self.sites:
            known = ids.get(site.name)
            if known is not None and listed.get(known, "unregistered") != "unregistered":
                continue
            public = self.certs / certificates.node_key_names(self.index[site.name])[1]
            ids[site.name] = int(self.flwr("supernode", "register", str(public), self.connection)["node-id"])
            record.write_text(json.dumps(ids, indent=1) + "\n")
        return ids

    def write_roster(self) -> Path:
        """``STATE/roster.yaml``: the operator's roster of this deployment (:mod:`fedhpro.flower.roster`):
        each site's training and test sizes as its folder holds them and the node key registered for it, so a
        run with ``flower.roster`` admits only these nodes, each as its own site."""
        lines = ["# written by python -m fedhpro.deploy up: the sites of this deployment (flower.roster)",
                 "sites:"]
        for site in self.sites:
            info = scan_client(site, ClientsOptions())
            public = (self.certs / certificates.node_key_names(self.index[site.name])[1]).resolve()
            lines.append(f"  {json.dumps(site.name)}: {{train: {info.train_size}, test: {info.test_size}, "
                         f"key: {json.dumps(str(public))}}}")
        path = self.state / "roster.yaml"
        write_atomic(path, "\n".join(lines) + "\n")
        return path

    def start(self) -> None:
        """Everything up, in order; raises ConfigError (after stopping what started) on a failure."""
        self.prepare()
        become_subreaper()
        (self.state / "up.pid").write_text(f"{os.getpid()}\n")
        self.isolate()
        self.say(self.isolation)
        self.define()
        try:
            for name in ("bridge", "superlink", "gate", "operator-forward"):
                self.launch(self.children[name])
                self.wait_ready(self.children[name])
            write_connection(self.home, self.connection, f"127.0.0.1:{self.ports.operator}",
                             self.certs / certificates.CA_CERT, self.env)
            self.write_token()
            ids = self.register()
            roster = self.write_roster()
            for site in self.sites:
                self.launch(self.children[f"{site.name}-forward"])
            for site in self.sites:
                self.wait_ready(self.children[f"{site.name}-forward"])
                self.launch(self.children[site.name])
        except BaseException:
            self.stop()
            raise
        nodes = ", ".join(f"{site.name} (node {ids[site.name]})" for site in self.sites)
        where = " in its private network namespace" if self.namespaces else ""
        self.say(f"SuperLink on 127.0.0.1:{self.ports.superlink}{where} (database {self.state / 'superlink.db'}), "
                 f"gate https://127.0.0.1:{self.ports.gate} (mutual TLS), SuperNodes: {nodes}")
        self.say(f'flwr connection "{self.connection}" (the operator\'s forwarder, 127.0.0.1:{self.ports.operator}) '
                 f"in {self.home / 'config.toml'}, its token in {self.home / 'credentials.yaml'}; logs in "
                 f"{self.state / 'logs'}, pids in {self.state / 'run'}")
        self.say(f"roster: {roster} (each site's training and test sizes and node key; with flower.roster only "
                 "those sites, with those sizes and keys, take part)")
        self.say(f"submit: python -m fedhpro.flower run examples/flower {self.connection} --run-config "
                 f"'dataset=\"clients\" rounds=2 local_epochs=1 checkpoint_every=1 "
                 f"flower.node-auth=true flower.roster=\"{roster}\" out=\"/abs/out\"'")
        self.say(f"stop: Ctrl-C, or python -m fedhpro.deploy up --stop {self.state}")

    def stop(self) -> None:
        """Nodes first (SIGTERM: they say goodbye), then forwarders, gate, SuperLink; SIGKILL after 15 s."""
        infrastructure = {"gate", "bridge", "superlink"} | {n for n in self.children if n.endswith("-forward")}
        self.stop_groups([[c for c in self.children.values() if c.name not in infrastructure],
                          [c for c in self.children.values() if c.name.endswith("-forward")],
                          [self.children.get("gate"), self.children.get("bridge")], [self.children.get("superlink")]])
        for namespace in self.namespaces.values():
            namespace.close()  # the namespaces end with their last process
        self.namespaces.clear()
        pid_file = self.state / "up.pid"
        if pid_file.exists() and pid_file.read_text().strip() == str(os.getpid()):
            pid_file.unlink()


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True



def run_up(sites_dir: str, state: str, base_port: int, connection: str, install_dependencies: bool) -> int:
    deployment = Deployment(sites_dir, state, base_port, connection, install_dependencies)

    def on_signal(signum, frame):  # noqa: ARG001
        deployment.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deployment.start()
    try:
        deployment.supervise()
    finally:
        deployment.say("stopping")
        deployment.stop()
        deployment.say("stopped")
    return 0


def _flwr_json(args: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run([flower_tool("flwr"), *args, "--format", "json"], env=env, capture_output=True, text=True,
                          timeout=300)
    try:
        return load_json(done.stdout[done.stdout.index("{"):], "flwr's reply")
    except ValueError:
        return {"success": False, "error-message": (done.stdout + done.stderr).strip()[-500:]}


def submit(app: str, connection: str, run_config: str | None = None, federation_config: str | None = None,
           stream: bool = True, poll: float = 5.0) -> int:
    """``python -m fedhpro.flower run``: ``flwr run`` (the run id), stream its log with ``flwr log``, then
    read its status from ``flwr ls``: 0 for ``finished:completed``, 1 with one line otherwise (``flwr run
    --stream`` itself exits 0 even when the ServerApp failed)."""
    env = {**os.environ, **FLOWER_ENV}
    args = ["run", app, connection]
    if run_config:
        args += ["--run-config", run_config]
    if federation_config:
        args += ["--federation-config", federation_config]
    reply = _flwr_json(args, env)
    if not reply.get("success") or "run-id" not in reply:
        message = " ".join(str(reply.get("error-message", reply)).split())
        print(f"fedhpro run: flwr run was refused: {message}", file=sys.stderr)
        return 2
    run_id = str(reply["run-id"])
    print(f"fedhpro run: run {run_id} submitted to {connection}", flush=True)
    unreachable = 0
    while True:
        if stream:
            try:
                subprocess.run([flower_tool("flwr"), "log", run_id, connection, "--stream"], env=env)
            except KeyboardInterrupt:
                print(f"fedhpro run: stopped following run {run_id}; it goes on (flwr stop {run_id} {connection} "
                      "ends it)", file=sys.stderr)
                return 130
        deadline = time.monotonic() + 60
        while True:
            listed = _flwr_json(["ls", connection, "--run-id", run_id], env)
            runs = listed.get("runs") if listed.get("success") else None
            if not runs:
                unreachable += 1
                if unreachable >= 5:
                    message = " ".join(str(listed.get("error-message", listed)).split())
                    print(f"fedhpro run: cannot read the status of run {run_id}: {message}", file=sys.stderr)
                    return 1
            else:
                unreachable = 0
                status = runs[0]["status"]
                if status == "finished:completed":
                    print(f"fedhpro run: run {run_id} {status}")
                    return 0
                if status.startswith("finished"):
                    print(f"fedhpro run: run {run_id} ended {status} (its log: flwr log {run_id} {connection} "
                          "--show)", file=sys.stderr)
                    return 1
            if stream and time.monotonic() > deadline:
                break  # the log stream ended early (a SuperLink restart?): follow it again
            time.sleep(poll)

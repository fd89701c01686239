"""What another local user can do against ``python -m fedhpro.deploy up``'s listeners.

Flower 1.42's SuperLink asks no client certificate and its Control API authentication is a no-op: whoever
connects to it acts as the operator. ``up`` therefore keeps it (and every node) in a private network
namespace, because Flower takes no Unix socket (measured here), and lets local users reach only the gate
(client certificate needed) and the operator's forwarder (the operator's token needed).

:func:`attack` is the other local user (uid 65534, ``nobody``; this machine's Python lives under a folder
only root may enter, so it runs in a forked child of the test that drops to that uid instead of a new
interpreter): against every port of the deployment's range it tries a raw TCP connect, a TLS handshake
trusting ``ca.crt``, ``POST /v1/control/list-runs`` and Flower's own CLI (``flwr ls``, ``flwr supernode
register``, in-process); it tries every Unix socket in the state folder, opening the namespaces of the
SuperLink and the nodes, and reading the state's keys and the operator's token. The same probes run first as
root, the deployment's owner, so a probe that could not detect access would show here. The deployment test
(test_flower_secure.py) runs it against a running ``up``; the tests below measure Flower's refusals of Unix
sockets and the namespace itself without a deployment.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import http.client
import io
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from fedhpro.deploy import certificates, up  # noqa: E402

NOBODY = 65534
PR_SET_DUMPABLE = 4
LINUX = sys.platform.startswith("linux")


def tool(name: str) -> str:
    return up.flower_tool(name)


# ---------------------------------------------------------------------------- running as another user
def as_user(uid: int | None, probe, *args) -> Any:
    """``probe(*args)`` in a forked child that first drops to ``uid`` (None: in this process, which also
    imports what the probes need); its JSON result. No exec: the child keeps the modules this process
    imported (a new interpreter of another uid could not read this machine's Python)."""
    if uid is None:
        return json.loads(json.dumps(probe(*args)))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                # dropping from root leaves the process non-dumpable (its /proc files stay root's), which an
                # ordinary user's process is not
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
            result = probe(*args)
        except BaseException as error:  # noqa: BLE001  # reported to the parent, never raised in the child
            result, code = {"child-error": f"{type(error).__name__}: {error}"}, 1
        with os.fdopen(write, "w") as out:
            json.dump(result, out)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as answer:
        text = answer.read()
    os.waitpid(pid, 0)
    result = json.loads(text)
    assert not (isinstance(result, dict) and "child-error" in result), result
    return result


def errno_name(error: OSError) -> str:
    return errno.errorcode.get(error.errno or 0, type(error).__name__)


def tcp(port: int) -> str:
    with socket.socket() as probe:
        probe.settimeout(10)
        try:
            probe.connect(("127.0.0.1", port))
        except OSError as error:
            return errno_name(error)
    return "open"


def tls_post(port: int, ca: str, path: str) -> str:
    """The status of ``POST path`` over TLS trusting ``ca`` (no client certificate), or the failure."""
    context = ssl.create_default_context(cafile=ca)
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
    try:
        connection.request("POST", path, body=b"", headers={"content-type": "application/protobuf"})
        return str(connection.getresponse().status)
    except ssl.SSLError as error:
        return f"SSLError {error.reason}"
    except OSError as error:
        return errno_name(error)
    finally:
        connection.close()


def flwr_in_process(home: Path, *args: str) -> dict:
    """Flower's CLI (its click command, as the ``flwr`` script runs it) with ``FLWR_HOME=home``; its JSON.

    flwr prints its JSON to ``sys.__stdout__`` and sets ``sys.stdout`` back to it when done, so all four
    streams (and its log handler's) are swapped for the call and put back after it."""
    import typer
    from flwr.cli.app import app
    from flwr.supercore import logger
    from flwr.supercore.credential_store import file_credential_store

    saved_home, saved_store = os.environ.get("FLWR_HOME"), file_credential_store.CREDENTIAL_FILE_PATH
    os.environ["FLWR_HOME"] = str(home)
    file_credential_store.CREDENTIAL_FILE_PATH = home / "credentials.yaml"  # fixed when flwr was imported
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, logger.console_handler.stream)
    out = io.StringIO()
    sys.__stdout__ = sys.__stderr__ = sys.stdout = sys.stderr = out  # type: ignore[misc]
    try:
        typer.main.get_command(app).main(args=[*args, "--format", "json"], prog_name="flwr", standalone_mode=False)
    except BaseException:  # noqa: BLE001  # flwr ends with SystemExit/typer.Exit after printing its JSON
        pass
    finally:
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, logger.console_handler.stream = streams  # type: ignore[misc]
        file_credential_store.CREDENTIAL_FILE_PATH = saved_store
        if saved_home is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = saved_home
    text = out.getvalue()
    try:
        return json.loads(text[text.index("{"):text.rindex("}") + 1])
    except ValueError:
        return {"success": False, "error-message": text[-300:]}


def outcome(reply: dict) -> str:
    """A flwr reply in a word: success, or the HTTP status / failure its error message names."""
    if reply.get("success"):
        return "success"
    message = str(reply.get("error-message", ""))
    for word in ("400", "401", "403", "404", "502", "unavailable"):
        if re.search(rf"\b{word}\b", message):  # a whole word: port 40139 in the message is no 401
            return word
    return "failed: " + " ".join(message.split())[-160:]


def open_path(path: str) -> str:
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as error:
        return errno_name(error)
    return "opened"


def unix_connect(path: str) -> str:
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(10)
        try:
            probe.connect(path)
        except OSError as error:
            return errno_name(error)
    return "connected"


def probes(home: str, state: str, ports: list[int], sockets: list[str], namespaces: list[str],
           secrets: list[str]) -> dict:
    """Everything :func:`attack` tries, as whoever runs it."""
    folder = Path(home)
    ca = str(folder / "ca.crt")
    found: dict[str, Any] = {"uid": os.getuid(), "ports": {}, "sockets": {}, "namespaces": {}, "secrets": {},
                             # the folder holding the state is open to all: a refusal below is the state's own
                             "state-parent-open": os.access(Path(state).parent, os.X_OK)}
    key = folder / f"evil-{os.getuid()}.pub"  # a node key of this prober's own (a key registers once)
    key.write_bytes(certificates.node_key_pair()[1])
    # flwr looks for an app folder under the working directory, which this prober may not be allowed to read
    # (a repository checked out in a folder open to its owner only): work from the prober's own folder
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    os.chdir(folder)
    try:
        _probe_ports(found, folder, ca, key, ports)
    finally:
        try:  # back where it was, where this prober may enter it (it runs in a child of its own anyway)
            if cwd is not None:
                os.chdir(cwd)
        except OSError:
            pass
    found["sockets"] = {path: unix_connect(path) for path in sockets}
    found["namespaces"] = {path: open_path(path) for path in namespaces}
    found["secrets"] = {path: open_path(path) for path in secrets}
    return found


def _probe_ports(found: dict[str, Any], folder: Path, ca: str, key: Path, ports: list[int]) -> None:
    for port in ports:
        entry = {"tcp": tcp(port)}
        if entry["tcp"] == "open":
            entry["list-runs"] = tls_post(port, ca, "/v1/control/list-runs")
            entry["flwr ls"] = outcome(flwr_in_process(folder, "ls", f"p{port}"))
            entry["flwr supernode register"] = outcome(flwr_in_process(
                folder, "supernode", "register", str(key), f"p{port}"))
        found["ports"][str(port)] = entry


def attack(state: Path, ports: list[int], ca: Path, pids: dict[str, int]) -> dict[str, dict]:
    """The probes as root (the deployment's owner) and as ``nobody``, against ``ports`` (every port of the
    deployment's range), the Unix sockets in ``state``, the network namespaces of ``pids`` (name -> a process
    of that party) and the secrets; {"owner": ..., "other": ...}. The other user's FLWR_HOME (a copy of
    ``ca.crt``, a connection per port, a node key of its own) is a folder of its own in the system's
    temporary folder (pytest's is open to root only)."""
    home = Path(tempfile.mkdtemp(prefix="fedhpro-other-user-"))
    try:
        return _attack(state, ports, ca, pids, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _attack(state: Path, ports: list[int], ca: Path, pids: dict[str, int], home: Path) -> dict[str, dict]:
    shutil.copy(ca, home / "ca.crt")
    flwr_in_process(home, "config", "list")  # flwr writes its default config.toml first
    with open(home / "config.toml", "a") as config:
        for port in ports:
            config.write(f'\n[superlink.p{port}]\naddress = "127.0.0.1:{port}"\nroot-certificates = '
                         f'"{home / "ca.crt"}"\n')
    for path in [home, *home.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
    sockets = sorted(str(path) for path in state.rglob("*") if path.is_socket())
    namespaces = [f"/proc/{pid}/ns/net" for pid in pids.values()]
    secrets = [str(state / "certs" / "operator.key"), str(state / "certs" / "ca.key"),
               str(state / "operator-forward" / "nginx.conf")]
    args = (str(home), str(state), ports, sockets, namespaces, secrets)
    owner = as_user(None, probes, *args)  # first: the probes' code paths are then imported for the other user
    other = as_user(NOBODY, probes, *args)
    return {"owner": owner, "other": other}


# ---------------------------------------------------------------------------- without a deployment
@pytest.mark.slow
def test_flower_takes_no_unix_socket(tmp_path, network_attempts):
    """The facts behind ``up``'s first line (:data:`fedhpro.deploy.up.NO_UNIX_SOCKETS`). flwr, in this process,
    takes ``unix:/path`` for a host named ``unix`` and looks it up (a name lookup that may leave the machine: the
    test suite's network guard refuses it, and it is the only one)."""
    env = {**os.environ, **up.FLOWER_ENV, "FLWR_HOME": str(tmp_path / "home")}
    sock = tmp_path / "link.sock"
    link_code, link = finished([tool("flower-superlink"), "--insecure", "--host", f"unix:{sock}", "--port", "9",
                                "--database", ":flwr-in-memory:"], env, tmp_path / "superlink.log")
    # uvicorn resolves "unix:/path" as a host name: "Name or service not known", or an idna error when long
    assert link_code != 0 and ("Name or service not known" in link or "getaddrinfo" in link) and not sock.exists()
    _, node = finished([tool("flower-supernode"), "--insecure", "--superlink", f"unix:{sock}",
                        "--port", str(up_free_port())], env, tmp_path / "supernode.log")
    assert "Exit Code: 600" in node and "cannot be parsed" in node
    home = tmp_path / "home"
    flwr_in_process(home, "config", "list")
    with open(home / "config.toml", "a") as config:
        config.write(f'\n[superlink.unixy]\naddress = "unix:{sock}"\ninsecure = true\n')
    reply = flwr_in_process(home, "ls", "unixy")
    assert not reply["success"] and "Connection to the SuperLink is unavailable" in reply["error-message"]
    assert {attempt.host for attempt in network_attempts} <= {"unix"}


def finished(args: list[str], env: dict[str, str], log: Path) -> tuple[int, str]:
    """Run a Flower command to its end in a session of its own, then end what it started (its SuperExec)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        code = process.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()
    return code, log.read_text(errors="replace")


def up_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="network namespaces are Linux's")
def test_a_private_network_namespace_is_out_of_reach_of_the_host_and_of_other_users(tmp_path):
    try:
        namespace = up.new_namespace("probe")
    except OSError as error:
        pytest.skip(f"no private network namespace here: {error}")
    port = up_free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
                              preexec_fn=namespace.enter)
    try:
        deadline = time.monotonic() + 60
        while not up.in_namespace(namespace, lambda: tcp(port) == "open") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert up.in_namespace(namespace, lambda: tcp(port) == "open")  # inside: it serves
        assert tcp(port) == "ECONNREFUSED"  # the host's 127.0.0.1: nothing there
        ns = f"/proc/{server.pid}/ns/net"
        if os.geteuid() == 0:
            assert as_user(None, open_path, ns) == "opened"  # its owner could join it
            assert as_user(NOBODY, open_path, ns) == "EACCES"  # another user cannot
    finally:
        server.kill()
        server.wait()
        namespace.close()


def loopback_serves(port: int) -> bool:
    """Whether a server bound here on 127.0.0.1:port accepts a connection (all in this process)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(1)
        return tcp(port) == "open"


def rootless_namespace(port: int) -> dict:
    """As a user without privileges: a namespace of ours, a server in it, and the host's view of its port."""
    try:
        namespace = up.new_namespace("rootless")
    except OSError as error:
        return {"refused": str(error)}
    try:
        return {"inside": up.in_namespace(namespace, lambda: loopback_serves(port)),
                "user-namespace": namespace.user is not None}
    finally:
        namespace.close()


@pytest.mark.skipif(not LINUX or os.geteuid() != 0, reason="drops to another uid: needs root")
def test_a_user_without_privileges_gets_a_namespace_of_a_user_namespace_or_a_reason():
    """``up`` run by an ordinary user: the namespace comes with a user namespace (its uid mapped to itself), or
    :func:`fedhpro.deploy.up.new_namespace` raises the one-line reason that ``up`` then prints."""
    found = as_user(NOBODY, rootless_namespace, up_free_port())
    if "refused" in found:
        assert found["refused"].startswith("unshare(CLONE_NEWNET|CLONE_NEWUSER) refused: ")
        assert "\n" not in found["refused"]
    else:
        assert found == {"inside": True, "user-namespace": True}


def test_up_says_in_one_line_who_reaches_the_superlink_when_no_namespace_can_be_made(tmp_path, monkeypatch):
    (tmp_path / "sites" / "site-a").mkdir(parents=True)
    deployment = up.Deployment(tmp_path / "sites", tmp_path / "state", base_port=18000)

    def refused(name: str) -> up.Namespace:
        raise OSError("unshare(CLONE_NEWNET) refused: Operation not permitted")

    monkeypatch.setattr(up, "new_namespace", refused)
    deployment.isolate()
    assert deployment.namespaces == {} and "\n" not in deployment.isolation
    assert deployment.isolation.startswith(up.NO_UNIX_SOCKETS)
    assert ("no private network namespace could be made (unshare(CLONE_NEWNET) refused: Operation not permitted): "
            "every local user reaches the SuperLink (127.0.0.1:18001) as operator") in deployment.isolation
    deployment = up.Deployment(tmp_path / "sites", tmp_path / "state", base_port=18000, install_dependencies=True)
    deployment.isolate()
    assert deployment.namespaces == {} and "--install-dependencies" in deployment.isolation


def test_a_state_folder_too_deep_for_unix_sockets_is_one_line(tmp_path):
    (tmp_path / "sites" / "site-a").mkdir(parents=True)
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deployment = up.Deployment(tmp_path / "sites", deep, base_port=up_free_port())
    with pytest.raises(up.ConfigError, match="longer than 100 bytes; use a shorter folder") as error:
        deployment.prepare()
    assert "\n" not in str(error.value)

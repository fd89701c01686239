"""``python -m fedhpro.deploy``: the commands of a secured Flower deployment.

- ``certificates DIR --host H [--host H2 ...] [--nodes N] [--days D]``: a CA,
  the SuperLink's TLS certificate for those hosts and N SuperNode key pairs
  for Flower's node authentication (:mod:`fedhpro.deploy.certificates`); with
  ``--gate``, the operator's and each node's client certificate for the gate;
  ``certificates DIR --client NAME --role node|operator``: one more client
  certificate signed by DIR's ca.key;
- ``gate server|bridge|forward|entry PREFIX ...``: nginx configs for mutual
  TLS with roles in front of the SuperLink, the bridge from an owner-only
  Unix socket to a SuperLink in a private network namespace, and every
  party's local forwarder, with ``--token`` one that passes only the requests
  of the ``flwr`` of this user, on a Unix socket with an entry in the node's
  private network namespace (:mod:`fedhpro.deploy.gate`); ``--start`` runs
  nginx in the foreground;
- ``up SITES_DIR``: a secured, supervised deployment on loopback, one
  SuperNode per site folder (:mod:`fedhpro.deploy.up`); ``up --stop STATE``.

Runs are submitted with ``python -m fedhpro.flower run`` (:mod:`fedhpro.flower.__main__`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

from fedhpro.deploy import certificates, gate, up
from fedhpro.errors import ConfigError, run_handler


def make_certificates(args: argparse.Namespace) -> int:
    if args.client:
        written = certificates.issue_client(args.dir, args.client, args.role, days=args.days)
        print("wrote " + ", ".join(str(path) for path in written))
        print(f"its forwarder: python -m fedhpro.deploy gate forward <folder> --certs {Path(args.dir).resolve()} "
              f"--name {args.client} --gate <gate host:port>")
        return 0
    written = certificates.create(args.dir, args.host, nodes=args.nodes, days=args.days, gate=args.gate)
    folder = Path(args.dir).resolve()
    print("wrote " + ", ".join(str(path) for path in written))
    print(f"SuperLink: flower-superlink --ssl-ca-certfile {folder / certificates.CA_CERT} "
          f"--ssl-certfile {folder / certificates.SERVER_CERT} --ssl-keyfile {folder / certificates.SERVER_KEY}"
          + (" --enable-supernode-auth" if args.nodes else ""))
    print(f"SuperNodes: flower-supernode --root-certificates {folder / certificates.CA_CERT} ..."
          + (" --auth-supernode-private-key <its supernode-K.key>" if args.nodes else ""))
    print(f'flwr connection (config.toml): root-certificates = "{folder / certificates.CA_CERT}"')
    if args.nodes:
        print("register each node: flwr supernode register <its supernode-K.pub> <connection>")
    if args.gate:
        print("gate: python -m fedhpro.deploy gate server <folder> --certs ... --listen <host:port> --superlink "
              "127.0.0.1:<port>; each party: python -m fedhpro.deploy gate forward <folder> --certs ... "
              "--name operator|supernode-K --gate <host:port>")
    print(f"keep {certificates.CA_KEY} off the SuperLink and nodes; each node gets only ca.crt and its own key")
    return 0


def make_gate(args: argparse.Namespace) -> int:
    if args.kind == "server":
        written = gate.server_config(args.prefix, args.certs, args.listen, args.superlink, args.local)
    elif args.kind == "bridge":
        written = gate.bridge_config(args.prefix, args.certs, args.listen, args.superlink)
    elif args.kind == "entry":
        written = gate.entry_config(args.prefix, args.certs, args.name, args.listen, args.forwarder)
    else:
        token = secrets.token_hex(32) if args.token else None
        written = gate.forward_config(args.prefix, args.certs, args.name, args.gate, args.listen, args.gate_name,
                                      token=token)
        if token is not None:
            store = gate.store_flwr_token(up.flwr_home(), args.listen, token)
            print(f"token for {args.listen} in {store} (flwr sends it; a request without it gets 403)")
    command = written.command()
    if args.start:
        sys.stdout.flush()  # what was printed above would be lost with this process's buffers
        os.execv(command[0], command)  # nginx in the foreground, in place of this process
    print(f"wrote {written.config}")
    print("run: " + " ".join(part if " " not in part else repr(part) for part in command))
    return 0


def bring_up(args: argparse.Namespace) -> int:
    if args.stop:
        return up.stop_running(args.stop)
    if not args.sites:
        raise ConfigError("give SITES_DIR (a folder of site folders), or --stop STATE")
    return up.run_up(args.sites, args.state, args.port, args.connection, args.install_dependencies)


def add_command(commands, name: str, handler: Callable[[argparse.Namespace], int], help: str,
                description: str) -> argparse.ArgumentParser:
    """A sub-command's parser, which runs ``handler``."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fedhpro.deploy",
                                     description="a secured Flower deployment: certificates, gate, up")
    commands = parser.add_subparsers(dest="command", required=True)
    certs = add_command(
        commands, "certificates", make_certificates,
        help="a CA, the SuperLink's TLS certificate and SuperNode authentication key pairs",
        description="Write ca.crt/ca.key, server.pem/server.key (signed by the CA, one subjectAltName per "
                    "--host) and, with --nodes N, supernode-K.key/supernode-K.pub (EC P-384, OpenSSH "
                    "format) into DIR. Private keys get mode 0600; existing files are never replaced.")
    certs.add_argument("dir", help="folder for the files (created if missing)")
    certs.add_argument("--host", action="append", default=[],
                       help="an IP address or DNS name the nodes and flwr use to reach the SuperLink (repeat)")
    certs.add_argument("--nodes", type=int, default=0, help="number of SuperNode key pairs (default 0)")
    certs.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    certs.add_argument("--gate", action="store_true",
                       help="also operator.crt/.key (OU=operator) and, per node, supernode-K.crt/supernode-K-tls.key "
                            "(OU=node): client certificates for the gate (python -m fedhpro.deploy gate)")
    certs.add_argument("--client", help="add one client certificate NAME.crt (needs DIR/ca.key); with --role")
    certs.add_argument("--role", choices=certificates.ROLES, default="node", help="the role of --client (node)")

    gates = add_command(
        commands, "gate", make_gate,
        help="nginx configs: mutual TLS with roles in front of the SuperLink, and local forwarders",
        description="server: the gate on the SuperLink's host (operator certificates may use /v1/control, node "
                    "certificates /v1/fleet, both /health; nothing else passes). forward: a party's local "
                    "forwarder on 127.0.0.1 that connects to the gate with the party's client certificate.")
    kinds = gates.add_subparsers(dest="kind", required=True)
    server = kinds.add_parser("server", help="the gate, on the SuperLink's host")
    server.add_argument("prefix", help="folder for nginx.conf, its pid file, logs and temporary files")
    server.add_argument("--certs", required=True, help="folder with ca.crt, server.pem, server.key")
    server.add_argument("--listen", required=True, help="host:port the others reach (e.g. 0.0.0.0:18000)")
    server.add_argument("--superlink", default="127.0.0.1:18001",
                        help="the SuperLink's own address (flower-superlink --host 127.0.0.1; default "
                             "127.0.0.1:18001), or unix:/abs/path of a bridge (gate bridge)")
    server.add_argument("--local", help="also listen on this Unix socket (unix:/abs/path), for forwarders on this "
                                        "host in private network namespaces")
    bridge = kinds.add_parser("bridge", help="from an owner-only Unix socket to the SuperLink in a private network "
                                             "namespace (run it in that namespace)")
    bridge.add_argument("prefix", help="folder for nginx.conf, its pid file, logs and temporary files")
    bridge.add_argument("--certs", required=True, help="folder with ca.crt and server.pem")
    bridge.add_argument("--listen", required=True,
                        help="unix:/abs/path in a folder only its owner may enter (the gate's --superlink)")
    bridge.add_argument("--superlink", default="127.0.0.1:18001",
                        help="the SuperLink's address in the namespace (default 127.0.0.1:18001)")
    forward = kinds.add_parser("forward", help="a party's local forwarder (operator or node)")
    forward.add_argument("prefix", help="folder for nginx.conf, its pid file, logs and temporary files")
    forward.add_argument("--certs", required=True, help="folder with ca.crt and NAME.crt and its key")
    forward.add_argument("--name", required=True, help="operator or supernode-K (the certificate's file name)")
    forward.add_argument("--gate", required=True, help="the gate's host:port")
    forward.add_argument("--gate-name",
                         help="the name the gate's certificate must hold (default: --gate's host). nginx checks DNS "
                              "names (or the CN) only: for a gate reached by IP address give its DNS name here")
    forward.add_argument("--listen", default="127.0.0.1:18001",
                         help="loopback host:port (default 127.0.0.1:18001), or unix:/abs/path for a gate entry")
    forward.add_argument("--token", action="store_true",
                         help="pass only requests with a new secret token, stored in $FLWR_HOME/credentials.yaml "
                              "for --listen (flwr sends it): for the operator's forwarder")
    entry = kinds.add_parser("entry", help="in a node's private network namespace: from 127.0.0.1 there to the "
                                           "forwarder's Unix socket outside")
    entry.add_argument("prefix", help="folder for nginx.conf, its pid file, logs and temporary files")
    entry.add_argument("--certs", required=True, help="folder with NAME.crt and its key")
    entry.add_argument("--name", required=True, help="supernode-K (the certificate's file name)")
    entry.add_argument("--listen", default="127.0.0.1:18001", help="loopback host:port in the namespace")
    entry.add_argument("--forwarder", required=True, help="the forwarder's unix:/abs/path (gate forward --listen)")
    for sub in (server, bridge, entry, forward):
        sub.add_argument("--start", action="store_true", help="then run nginx in the foreground")

    ups = add_command(
        commands, "up", bring_up,
        help="a secured deployment on loopback: one SuperNode per site folder, supervised",
        description="Start a SuperLink (TLS, node authentication, --database), the gate and forwarders (nginx), "
                    "and one SuperNode per site folder of SITES_DIR (data-dir = the folder), register the nodes, "
                    "write the flwr connection into $FLWR_HOME/config.toml (and its token into "
                    "$FLWR_HOME/credentials.yaml), restart what dies; Ctrl-C stops all. The SuperLink and each node "
                    "run in a private network namespace: other local users reach only the gate and the operator's "
                    "forwarder (the first line says so, or why not).")
    ups.add_argument("sites", nargs="?", help="folder of site folders (each: train/ and test/, or .npz)")
    ups.add_argument("--state", default="fedhpro-up", help="folder for certificates, database, logs (fedhpro-up)")
    ups.add_argument("--port", type=int, default=18000,
                     help="the gate's port; the SuperLink, forwarders and nodes take the next 2+2N (default 18000)")
    ups.add_argument("--connection", default="fedhpro-up", help="name of the flwr connection (fedhpro-up)")
    ups.add_argument("--install-dependencies", action="store_true",
                     help="let the SuperLink install each app's dependencies with uv (default: off); it needs the "
                          "network, so the SuperLink and nodes then stay on this host's 127.0.0.1, open to local users")
    ups.add_argument("--stop", metavar="STATE", help="stop the deployment running from STATE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_handler(args, "python -m fedhpro.deploy")


if __name__ == "__main__":
    sys.exit(main())

"""``python -m fedhpro.flower``: helpers for running fedhpro on Flower.

- ``new-app DIR``: write a Flower app (its pyproject.toml) that runs fedhpro;
- ``certificates DIR --host H [--host H2 ...] [--nodes N] [--days D]``: a CA,
  the SuperLink's TLS certificate for those hosts and N SuperNode key pairs
  for Flower's node authentication (:mod:`fedhpro.flower.certificates`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedhpro.errors import FedHProError
from fedhpro.flower import certificates
from fedhpro.flower.settings import app_pyproject_toml


def new_app(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    target.mkdir(parents=True, exist_ok=True)
    (target / "pyproject.toml").write_text(app_pyproject_toml())
    print(f"wrote {target / 'pyproject.toml'}; run it with: flwr run {target} <connection> --run-config 'rounds=2'")
    return 0


def make_certificates(args: argparse.Namespace) -> int:
    written = certificates.create(args.dir, args.host, nodes=args.nodes, days=args.days)
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
    print(f"keep {certificates.CA_KEY} off the SuperLink and nodes; each node gets only ca.crt and its own key")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fedhpro.flower", description="fedhpro on Flower")
    commands = parser.add_subparsers(dest="command", required=True)
    app = commands.add_parser("new-app", help="write a Flower app (pyproject.toml) that runs fedhpro")
    app.add_argument("dir")
    app.set_defaults(handler=new_app)
    certs = commands.add_parser(
        "certificates", help="a CA, the SuperLink's TLS certificate and SuperNode authentication key pairs",
        description="Write ca.crt/ca.key, server.pem/server.key (signed by the CA, one subjectAltName per "
                    "--host) and, with --nodes N, supernode-K.key/supernode-K.pub (EC P-384, OpenSSH "
                    "format) into DIR. Private keys get mode 0600; existing files are never replaced.")
    certs.add_argument("dir", help="folder for the files (created if missing)")
    certs.add_argument("--host", action="append", default=[],
                       help="an IP address or DNS name the nodes and flwr use to reach the SuperLink (repeat)")
    certs.add_argument("--nodes", type=int, default=0, help="number of SuperNode key pairs (default 0)")
    certs.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    certs.set_defaults(handler=make_certificates)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.handler(args)
    except FedHProError as error:
        print(f"python -m fedhpro.flower: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

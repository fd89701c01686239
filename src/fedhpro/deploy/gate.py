"""An access layer for a Flower 1.42 deployment: nginx with mutual TLS and roles, written as config files.

Flower 1.42's SuperLink serves every API on one HTTP(S) port: ``/health``,
``/v1/control/*`` (the ``flwr`` CLI: submit, list and stop runs, register
nodes; its authentication is a no-op in open-source Flower), ``/v1/fleet/*``
(the SuperNodes) and ``/v1/runtime/*`` (the ServerApp process on the same
host). Anyone who reaches that port and trusts its CA could use all of them.
The gate puts nginx (a Debian package, no code of ours on the wire) in front:

- **gate server** (the SuperLink's host): listens on the public address with
  TLS and demands a client certificate signed by the CA (no certificate, or
  one from another CA: the handshake fails). The certificate's subject decides
  the role, and only a subject of exactly the form the CA issues,
  ``CN=<name>,OU=<role>,O=fedhpro`` in nginx's RFC 2253 form with ``<name>``
  of :data:`fedhpro.deploy.certificates.CLIENT_NAME` (no escaped character,
  no further attribute: :func:`role_rules`), gets one: ``OU=operator`` may use
  ``/v1/control/*``, ``OU=node`` only ``/v1/fleet/*``; both may read
  ``/health``; everything else (``/v1/runtime``, ``/docs``, ...) is refused
  with 403. The access log shows a role only for a certificate nginx verified
  (``$ssl_client_verify`` = ``SUCCESS``; an expired one is answered 400 and
  logged with ``role=`` empty and its ``verify=`` failure). Requests go on to
  the SuperLink (on 127.0.0.1 over its own TLS, checked against the CA, or
  through a **bridge** on an owner-only Unix socket, ``--superlink
  unix:/path``), where ``--enable-supernode-auth`` still
  checks each node's signature: two independent checks.
- **gate bridge** (the SuperLink's host): Flower 1.42's SuperLink listens on
  TCP only (``--host``/``--port``), so it runs in a private network
  namespace with this nginx beside it: it listens on a Unix socket (in a
  folder only its owner may enter) and passes everything on to the
  SuperLink's TLS port in that namespace. Local users of the host then reach
  the gate only.
- **gate forward** (every party's machine): Flower's clients (``flwr``,
  ``flower-supernode``) cannot present a client certificate, so they talk TLS
  to a forwarder on 127.0.0.1 (listening with the party's own certificate,
  which is valid for 127.0.0.1) that opens the mutual-TLS connection to the
  gate with that certificate.

nginx runs in the foreground as a child (``nginx -p PREFIX -c nginx.conf -e
error.log -g 'daemon off;'``) with its pid file, logs and temporary paths in
its own folder, as root or not (as root its workers run as root too: they must
reach the owner-only Unix sockets). A forwarder may demand a secret token
(``Authorization: Bearer``, what Flower's ``flwr`` CLI sends from its
credential store): then a local process without the token is refused there. Request bodies are streamed to the upstream
(no temporary files; ``client_max_body_size`` :data:`MAX_BODY`), responses are
not buffered (``flwr run --stream`` / ``flwr log`` stream for the whole run)
and read timeouts are long (:data:`READ_TIMEOUT`).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from fedhpro.deploy import certificates
from fedhpro.errors import ConfigError

#: the largest request nginx passes on (a model upload by a node: a few MB for fedhpro's models; 1 GB of room)
MAX_BODY = "1024m"
#: how long nginx waits for the SuperLink to answer or stream (a run's log stream lasts the whole run)
READ_TIMEOUT = "86400s"
CONFIG_NAME = "nginx.conf"
#: the paths a role may use on the gate (the raw request line must match exactly: no ``..``, no escapes)
ROLE_PATHS = {"operator": "/v1/control/", "node": "/v1/fleet/"}


def nginx_binary() -> str:
    """The nginx executable (PATH, then /usr/sbin: Debian puts it there, outside a normal user's PATH)."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/sbin")
    if found is None:
        raise ConfigError("nginx is not installed; install it (Debian/Ubuntu: apt-get install nginx-light)")
    return found


def unix_path(address: str) -> Path | None:
    """The socket path of a ``unix:/abs/path`` address (None for ``host:port``)."""
    if not address.startswith("unix:"):
        return None
    path = Path(address[len("unix:"):])
    if not path.is_absolute():
        raise ConfigError(f"address {address!r}: give an absolute path, e.g. unix:/srv/fedhpro/s/link.sock")
    if len(str(path).encode()) > 100:  # sun_path holds 108 bytes
        raise ConfigError(f"Unix socket path {path} is longer than 100 bytes; use a shorter folder")
    return path


def upstream_server(address: str) -> str:
    """An nginx ``server`` value for ``host:port`` or ``unix:/path``."""
    path = unix_path(address)
    return _q(f"unix:{path}") if path is not None else nginx_address(*split_address(address))


def store_flwr_token(home: Path, address: str, token: str) -> Path:
    """Put ``token`` into Flower's credential store (``home/credentials.yaml``, owner-only) for the connection
    address ``address``, as Flower's OIDC login would: ``flwr`` then sends ``Authorization: Bearer <token>``
    with every request to that address, which a forwarder with that token demands."""
    from flwr.cli.constant import ACCESS_TOKEN_STORE_KEY, AUTHN_TYPE_STORE_KEY, REFRESH_TOKEN_STORE_KEY
    from flwr.common.constant import AuthnType
    from flwr.supercore.credential_store.file_credential_store import FileCredentialStore

    home.mkdir(parents=True, exist_ok=True)
    path = home / "credentials.yaml"
    store = FileCredentialStore(path)
    store.set(AUTHN_TYPE_STORE_KEY % address, AuthnType.OIDC.encode())
    store.set(ACCESS_TOKEN_STORE_KEY % address, token.encode())
    # flwr sends only the access token, but wants a refresh token stored (it would send it only after a 401)
    store.set(REFRESH_TOKEN_STORE_KEY % address, b"none")
    os.chmod(path, 0o600)
    return path


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) -> (host, port); a one-line ConfigError otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"address {address!r} is not host:port (e.g. 127.0.0.1:18000 or superlink.example.org:443)")
    return host, int(port)


def nginx_address(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def _q(path: Path | str) -> str:
    """A path as an nginx string (quoted; nginx configs take no other escaping we need)."""
    text = str(path)
    if any(c in text for c in '"\\;{}\n$'):
        raise ConfigError(f"path {text!r} holds a character nginx configs cannot take here; use a plainer path")
    return f'"{text}"'


def _common(prefix: Path) -> str:
    """The top of every config: one worker, everything of nginx's own in ``prefix``; as root, the worker
    stays root (nginx would switch it to ``nobody``, who could not reach the owner-only Unix sockets)."""
    temp = prefix / "temp"
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""# written by python -m fedhpro.deploy gate
# run: nginx -p {prefix} -c {CONFIG_NAME} -e error.log -g 'daemon off;'
{user}worker_processes 1;
pid {_q(prefix / "nginx.pid")};
error_log {_q(prefix / "error.log")} warn;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {_q(temp / "body")};
    proxy_temp_path {_q(temp / "proxy")};
    fastcgi_temp_path {_q(temp / "fastcgi")};
    uwsgi_temp_path {_q(temp / "uwsgi")};
    scgi_temp_path {_q(temp / "scgi")};
    default_type application/octet-stream;
    server_tokens off;
    underscores_in_headers on;
    ignore_invalid_headers off;
    client_max_body_size {MAX_BODY};
    client_body_buffer_size 1m;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_request_buffering off;
    proxy_read_timeout {READ_TIMEOUT};
    proxy_send_timeout {READ_TIMEOUT};
    proxy_connect_timeout 20s;
    client_body_timeout 3600s;
    keepalive_timeout 75s;
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache shared:fedhpro_tls:1m;
"""


@dataclass(frozen=True)
class Gate:
    """The gate in front of a SuperLink: nginx's config in ``prefix`` and the command that runs it."""

    prefix: Path
    config: Path

    def command(self) -> list[str]:
        return [nginx_binary(), "-p", str(self.prefix), "-c", str(self.config), "-e", str(self.prefix / "error.log"),
                "-g", "daemon off;"]


def _prepare(prefix: str | os.PathLike) -> Path:
    prefix = Path(prefix).resolve()
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / "temp" / sub).mkdir(parents=True, exist_ok=True)
    return prefix


def check_name(certificate: Path) -> str:
    """The name nginx must check ``certificate`` against: its first DNS subjectAltName, else its CN.

    nginx 1.22 matches ``proxy_ssl_name`` with OpenSSL's host-name check only: DNS names (or the CN when the
    certificate has no DNS name), never IP addresses; an IP literal fails against a certificate that also
    holds DNS names."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(certificate.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = names.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        dns = []
    if dns:
        return dns[0]
    common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not common:
        raise ConfigError(f"{certificate} holds no DNS name and no CN; nginx cannot check it")
    return str(common[0].value)


def _need(*paths: Path) -> None:
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"{path} does not exist; make it with python -m fedhpro.deploy certificates ... --gate")


def role_rules() -> dict[str, str]:
    """role -> the regular expression nginx matches ``$ssl_client_s_dn`` against for it (anchored).

    nginx prints the subject in RFC 2253 form, last attribute first, a ``,`` or ``+`` inside a value escaped
    as ``\\,``/``\\+``. A rule that looks for ``OU=operator`` anywhere also matches inside an escaped value
    (``CN=site9\\,OU=operator,OU=node,...``), so the whole subject must be exactly what
    :func:`fedhpro.deploy.certificates.client_certificate` issues: ``CN=<name>,OU=<role>,O=fedhpro`` with a
    name of :data:`~fedhpro.deploy.certificates.CLIENT_NAME` (no backslash, comma, ``+`` or ``=`` can occur
    in it, so no escaped character and no further attribute passes)."""
    name = certificates.CLIENT_NAME.pattern
    return {role: f"^CN={name},OU={role},O=fedhpro$" for role in ROLE_PATHS}


def server_config(prefix: str | os.PathLike, certs: str | os.PathLike, listen: str, superlink: str,
                  local: str | None = None) -> Gate:
    """Write the gate's config into ``prefix``: listen on ``listen`` (``host:port``, the address the others
    reach; mutual TLS with ``certs``' ``server.pem``/``server.key`` and ``ca.crt``) and, with ``local``
    (``unix:/path``), on that socket too (the same checks, for forwarders in private network namespaces), and
    pass each role's paths on to the SuperLink at ``superlink``: ``host:port`` (its TLS checked against
    ``ca.crt`` for server.pem's own name: the SuperLink serves the same certificate) or ``unix:/path`` (a
    :func:`bridge_config` socket, plain HTTP: only its owner can open it)."""
    prefix, certs = _prepare(prefix), Path(certs).resolve()
    ca, cert, key = certs / certificates.CA_CERT, certs / certificates.SERVER_CERT, certs / certificates.SERVER_KEY
    _need(ca, cert, key)
    host, port = split_address(listen)
    local_path = unix_path(local) if local else None
    if local and local_path is None:
        raise ConfigError(f"--local {local}: give unix:/abs/path (the gate's socket for local forwarders)")
    bridged = unix_path(superlink) is not None
    upstream = upstream_server(superlink)
    scheme = "http" if bridged else "https"
    link_tls = "" if bridged else f"""
        proxy_ssl_trusted_certificate {_q(ca)};
        proxy_ssl_verify on;
        proxy_ssl_verify_depth 1;
        proxy_ssl_name {check_name(cert)};
        proxy_ssl_session_reuse on;"""
    roles = "\n".join(f'        "~{rule}" {role};' for role, rule in role_rules().items())
    logged = "\n".join(f'        "SUCCESS:{role}" {role};' for role in ROLE_PATHS)
    locations = "".join(f"""
        location {path} {{
            if ($fedhpro_role != {role}) {{ return 403; }}
            if ($request_uri !~ "^{path}[a-z0-9-]+$") {{ return 403; }}
            limit_except POST {{ deny all; }}
            proxy_pass {scheme}://superlink;
        }}""" for role, path in ROLE_PATHS.items())
    also = f"\n        listen {_q(f'unix:{local_path}')} ssl;" if local_path is not None else ""
    text = _common(prefix) + f"""    # a certificate's role: its whole subject, exactly as the CA issues it (role_rules)
    map $ssl_client_s_dn $fedhpro_role {{
        default "";
{roles}
    }}
    # the role the log shows: only for a certificate nginx verified (an expired or revoked one whose subject
    # reads as a role is answered with 400 and logged with role= empty and its verify result)
    map "$ssl_client_verify:$fedhpro_role" $fedhpro_logged_role {{
        default "";
{logged}
    }}
    log_format fedhpro '$remote_addr [$time_local] "$request" $status $body_bytes_sent role=$fedhpro_logged_role '
                       'client="$ssl_client_s_dn" verify="$ssl_client_verify" $request_time';
    access_log {_q(prefix / "access.log")} fedhpro;
    upstream superlink {{
        server {upstream};
        keepalive 16;
    }}
    server {{
        listen {nginx_address(host, port)} ssl;{also}
        ssl_certificate {_q(cert)};
        ssl_certificate_key {_q(key)};
        ssl_client_certificate {_q(ca)};
        ssl_verify_client on;
        ssl_verify_depth 1;{link_tls}
        location = /health {{
            if ($request_uri != "/health") {{ return 403; }}
            limit_except GET {{ deny all; }}
            proxy_pass {scheme}://superlink;
        }}{locations}
        location / {{ return 403; }}
    }}
}}
"""
    config = prefix / CONFIG_NAME
    config.write_text(text)
    return Gate(prefix, config)


def bridge_config(prefix: str | os.PathLike, certs: str | os.PathLike, listen: str, superlink: str) -> Gate:
    """Write the bridge's config into ``prefix``: listen on the Unix socket ``listen`` (``unix:/path``; put it in
    a folder only its owner may enter) and pass every request on to the SuperLink at ``superlink``
    (``host:port`` in the bridge's network namespace, its TLS checked against ``ca.crt`` for server.pem's
    name). It checks no role: only the gate (the socket's owner) reaches it."""
    prefix, certs = _prepare(prefix), Path(certs).resolve()
    ca, cert = certs / certificates.CA_CERT, certs / certificates.SERVER_CERT
    _need(ca, cert)
    path = unix_path(listen)
    if path is None:
        raise ConfigError(f"--listen {listen}: the bridge listens on a Unix socket only, e.g. unix:/srv/fedhpro/s/l")
    link_host, link_port = split_address(superlink)
    text = _common(prefix) + f"""    access_log {_q(prefix / "access.log")};
    upstream superlink {{
        server {nginx_address(link_host, link_port)};
        keepalive 16;
    }}
    server {{
        listen {_q(f"unix:{path}")};
        proxy_ssl_trusted_certificate {_q(ca)};
        proxy_ssl_verify on;
        proxy_ssl_verify_depth 1;
        proxy_ssl_name {check_name(cert)};
        proxy_ssl_session_reuse on;
        location / {{
            proxy_pass https://superlink;
        }}
    }}
}}
"""
    config = prefix / CONFIG_NAME
    config.write_text(text)
    return Gate(prefix, config)


def loopback(listen: str, what: str) -> str:
    """``listen`` as an nginx address when it is a loopback ``IP:port``; a one-line ConfigError otherwise."""
    host, port = split_address(listen)
    try:
        if not ipaddress.ip_address(host).is_loopback:
            raise ConfigError(f"--listen {listen}: {what} listens on a loopback address only "
                              "(anyone who reaches it acts with its certificate)")
    except ValueError:
        raise ConfigError(f"--listen {listen}: give a loopback IP address, e.g. 127.0.0.1:18001") from None
    return nginx_address(host, port)


def entry_config(prefix: str | os.PathLike, certs: str | os.PathLike, name: str, listen: str,
                 forwarder: str) -> Gate:
    """Write an entry's config into ``prefix``: in a party's private network namespace, listen with TLS on
    ``listen`` (loopback; certificate ``<name>.crt``) for the party's Flower process and pass everything to its
    forwarder's Unix socket ``forwarder`` (``unix:/path``, :func:`forward_config` outside the namespace, which
    holds the network). Only processes in the namespace reach the entry."""
    prefix, certs = _prepare(prefix), Path(certs).resolve()
    cert_name, key_name = certificates.client_names(name)
    cert, key = certs / cert_name, certs / key_name
    _need(cert, key)
    if unix_path(forwarder) is None:
        raise ConfigError(f"--forwarder {forwarder}: give the forwarder's Unix socket, e.g. unix:/srv/fedhpro/s/f")
    text = _common(prefix) + f"""    access_log {_q(prefix / "access.log")};
    upstream forwarder {{
        server {upstream_server(forwarder)};
        keepalive 16;
    }}
    server {{
        listen {loopback(listen, "an entry")} ssl;
        ssl_certificate {_q(cert)};
        ssl_certificate_key {_q(key)};
        location / {{
            proxy_pass http://forwarder;
        }}
    }}
}}
"""
    config = prefix / CONFIG_NAME
    config.write_text(text)
    return Gate(prefix, config)


def forward_config(prefix: str | os.PathLike, certs: str | os.PathLike, name: str, gate: str,
                   listen: str = "127.0.0.1:18001", gate_name: str | None = None, token: str | None = None) -> Gate:
    """Write a local forwarder's config into ``prefix``: listen with TLS on ``listen`` (a loopback address;
    certificate ``<name>.crt``, valid for 127.0.0.1), or on the Unix socket ``unix:/path`` (plain HTTP, for an
    :func:`entry_config` in a private network namespace; put it in a folder only its owner may enter), and
    open a mutual-TLS connection to the gate at ``gate``
    (``host:port``, or ``unix:/path`` for a gate on the same host) with the same certificate, checking the
    gate's certificate against ``ca.crt`` for ``gate_name`` (default: the gate's host; nginx checks DNS names
    or the CN only, not IP addresses: see :func:`check_name`). With ``token``, a request passes only with the
    header ``Authorization: Bearer <token>`` (removed before the gate); the config is then made 0600."""
    prefix, certs = _prepare(prefix), Path(certs).resolve()
    cert_name, key_name = certificates.client_names(name)
    ca, cert, key = certs / certificates.CA_CERT, certs / cert_name, certs / key_name
    _need(ca, cert, key)
    socket_path = unix_path(listen)
    listener = (f"listen {_q(f'unix:{socket_path}')};" if socket_path is not None
                else f"listen {loopback(listen, 'a forwarder')} ssl;")
    if token is not None and not token.isalnum():
        raise ConfigError("the forwarder's token may hold letters and digits only")
    if unix_path(gate) is not None:
        if gate_name is None:
            raise ConfigError(f"--gate {gate}: give --gate-name too (the name the gate's certificate holds)")
        expected = gate_name
    else:
        expected = gate_name or split_address(gate)[0]
    try:
        ipaddress.ip_address(expected)
        sni = "off"  # SNI carries host names only
    except ValueError:
        sni = "on"
    # nginx compares the header byte by byte (it has no constant-time compare: a timing oracle in theory for a
    # local process, against a 256-bit token made anew at each start); a proxy_set_header in the location
    # replaces every one of the http block, so the keepalive's Connection "" is repeated there
    check = ("" if token is None else f"""
            if ($http_authorization != "Bearer {token}") {{ return 403; }}
            proxy_set_header Authorization "";
            proxy_set_header Connection "";""")
    text = _common(prefix) + f"""    access_log {_q(prefix / "access.log")};
    upstream gate {{
        server {upstream_server(gate)};
        keepalive 16;
    }}
    server {{
        {listener}
        ssl_certificate {_q(cert)};
        ssl_certificate_key {_q(key)};
        proxy_ssl_certificate {_q(cert)};
        proxy_ssl_certificate_key {_q(key)};
        proxy_ssl_trusted_certificate {_q(ca)};
        proxy_ssl_verify on;
        proxy_ssl_verify_depth 1;
        proxy_ssl_name {expected};
        proxy_ssl_server_name {sni};
        proxy_ssl_session_reuse on;
        location / {{{check}
            proxy_pass https://gate;
        }}
    }}
}}
"""
    config = prefix / CONFIG_NAME
    if token is not None:
        # the token is a secret: the file is made owner-only before it is written
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
    else:
        config.write_text(text)
    return Gate(prefix, config)

"""The operator's roster of sites: who may hold data in an own-data Flower run, and how much.

What a node declares at discovery (its name, its training and test sizes) is a claim: the server cannot
see its data. A roster (``flower.roster=<file>`` on the SuperLink host) states what the operator expects
of each site, and discovery admits only nodes that agree with it::

    tolerance: 0.05            # a declared size may differ from the roster's by this share (default 0)
    sites:
      clinic-0: {train: 1200, test: 300}
      clinic-1: {train: 800, test: 200, key: keys/supernode-1.pub}

``key`` (optional): the node's public key file (OpenSSH ``.pub`` or PEM, relative to the roster's folder),
checked against the key the SuperLink lists for the node (``--enable-supernode-auth``): another node that
answers with this site's name is then refused, whatever it declares. Without a roster, sizes are bounded
only by ``aggregation.max_share``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhpro.bounded import load_yaml
from fedhpro.errors import ConfigError

#: the most sites a roster may name, and the largest roster file read
MAX_SITES = 100_000
MAX_ROSTER_BYTES = 16 * 2 ** 20
_SITE_KEYS = {"train", "test", "key"}


def key_fingerprint(data: bytes) -> bytes | None:
    """A public key in a canonical form (DER SubjectPublicKeyInfo) from PEM, DER or OpenSSH bytes; None when
    ``data`` is none of them."""
    from cryptography.hazmat.primitives import serialization

    loaders = (serialization.load_pem_public_key, serialization.load_der_public_key,
               serialization.load_ssh_public_key)
    for loader in loaders:
        try:
            key = loader(data.strip())
        except (ValueError, TypeError, IndexError):  # not this encoding (or an unsupported key type)
            continue
        return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return None


@dataclass(frozen=True)
class Site:
    """One roster entry: the training and test sizes the operator expects, and the node's key if pinned."""

    name: str
    train: int
    test: int
    key: bytes | None = None  # key_fingerprint of the node's public key


@dataclass(frozen=True)
class Roster:
    """The sites the operator expects (:func:`load_roster`), and how far a declared size may stray."""

    sites: dict[str, Site]
    tolerance: float = 0.0

    def problem(self, name: str, train_size: int, test_size: int, key: bytes | None) -> str | None:
        """Why a node answering as ``name`` with these sizes and public key (as the SuperLink lists it; None:
        none listed) is not the roster's site, or None when it is."""
        site = self.sites.get(name)
        if site is None:
            return f"its name {name[:60]!r} is not in the roster ({len(self.sites)} sites)"
        if site.key is not None:
            listed = key_fingerprint(key) if key is not None else None
            if listed is None:
                return (f"the roster pins site {name!r} to a key, but the SuperLink lists no readable key for "
                        "this node (run it with --enable-supernode-auth)")
            if listed != site.key:
                return f"its public key is not the one the roster pins for site {name!r}"
        for what, declared, expected in (("train", train_size, site.train), ("test", test_size, site.test)):
            if abs(declared - expected) > self.tolerance * expected:
                return (f"it declares {declared} {what} samples but the roster expects {expected} for site "
                        f"{name!r} (tolerance {self.tolerance:g})")
        return None


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10 ** 12:
        raise ConfigError(f"{where} must be a whole number of samples >= 0, not {str(value)[:40]!r}")
    return value


def load_roster(path: str | Path) -> Roster:
    """The roster in the YAML file ``path`` (module doc); one-line ConfigError naming the fix otherwise."""
    path = Path(path).expanduser()
    where = f"flower.roster={str(path)!r}"
    try:
        size = path.stat().st_size
        if size > MAX_ROSTER_BYTES:
            raise ConfigError(f"{where} is {size} bytes, more than a roster needs ({MAX_ROSTER_BYTES})")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or type(error).__name__
        raise ConfigError(f"{where} cannot be read ({reason}); give the roster file's path on the "
                          "SuperLink host") from None
    try:
        values = load_yaml(text)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    except Exception as error:  # noqa: BLE001 - any YAML failure is one line
        raise ConfigError(f"{where} is not valid YAML ({type(error).__name__}); fix its syntax") from None
    if not isinstance(values, dict) or not isinstance(values.get("sites"), dict) or not values["sites"]:
        raise ConfigError(f"{where} must hold 'sites:', a mapping of site names to {{train: N, test: M}}")
    unknown = sorted(map(str, set(values) - {"sites", "tolerance"}))
    if unknown:
        raise ConfigError(f"{where} holds unknown keys {unknown[:4]}; a roster has 'sites' and 'tolerance'")
    tolerance = values.get("tolerance", 0.0)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1 \
            or not math.isfinite(tolerance):
        raise ConfigError(f"{where}: tolerance must be a share in [0, 1), not {str(tolerance)[:40]!r}")
    if len(values["sites"]) > MAX_SITES:
        raise ConfigError(f"{where} names {len(values['sites'])} sites, more than {MAX_SITES}")
    sites = {}
    for name, entry in values["sites"].items():
        if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 255:
            raise ConfigError(f"{where}: site name {str(name)[:40]!r} is not a printable name")
        if not isinstance(entry, dict) or not {"train", "test"} <= set(entry) or set(entry) - _SITE_KEYS:
            raise ConfigError(f"{where}: site {name!r} must be {{train: N, test: M}} (and optionally key: FILE)")
        key = None
        if entry.get("key") is not None:
            key_path = path.parent / str(entry["key"])
            try:
                key = key_fingerprint(key_path.read_bytes()[:MAX_ROSTER_BYTES])
            except OSError as error:
                raise ConfigError(f"{where}: site {name!r}'s key file {str(key_path)!r} cannot be read "
                                  f"({error.strerror or type(error).__name__})") from None
            if key is None:
                raise ConfigError(f"{where}: site {name!r}'s key file {str(key_path)!r} holds no public key "
                                  "(OpenSSH .pub or PEM)")
        sites[name] = Site(name, _count(entry["train"], f"{where}: site {name!r} train"),
                           _count(entry["test"], f"{where}: site {name!r} test"), key)
    return Roster(sites, float(tolerance))

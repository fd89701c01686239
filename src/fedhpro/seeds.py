"""Seeds of independent random streams, one construction for the engines and the methods.

The engines derive every client's and round's generator from ``(seed, stream, round, client)``;
a method that draws on the server (FedTGP's initial net and its shuffling) derives its own streams
from the server's seed the same way. Both import :func:`derive_seed` from here (methods never
import the engines).
"""

from __future__ import annotations

import numpy as np


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts: independent streams for different parts (rounds, clients, tags)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))

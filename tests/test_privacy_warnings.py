"""fedhpro.privacy.privacy_warnings: one line when delta is at least 1/N or at least 0.1 (a near-vacuous guarantee),
against hand-computed deltas."""

from __future__ import annotations

import pytest

from fedhpro.config import PrivacyOptions
from fedhpro.privacy import VACUOUS_DELTA, privacy_warnings


def warn(mode: str, num_clients: int, sizes=(), **changes) -> list[str]:
    return privacy_warnings(PrivacyOptions(mode=mode, **changes), num_clients, list(sizes))


def test_the_docs_tiny_example_default_delta_of_4_clients_is_warned():
    # 4^-1.1 = exp(-1.1 ln 4) = 0.21764: below 1/4 = 0.25, but above 0.1
    lines = warn("client", 4)
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "privacy.delta=0.2176 (the default 1/N^1.1) is at least 0.1 for 4 clients" in lines[0]
    assert lines[0].endswith("use more clients or set privacy.delta=0.01")


@pytest.mark.parametrize(("clients", "delta", "warned", "why"), [
    (20, 0.0, False, ""),  # default 20^-1.1 = 0.03706 < 1/20 = 0.05 and < 0.1
    (8, 0.0, True, "at least 0.1"),  # default 8^-1.1 = 0.10153 >= 0.1
    (9, 0.0, False, ""),  # default 9^-1.1 = 0.08919
    (20, 0.05, True, "at least 1/N = 0.05"),  # exactly 1/N
    (20, 0.0499, False, ""),
    (1000, 0.001, True, "at least 1/N = 0.001"),
    (1000, 1e-5, False, ""),
])
def test_privacy_client_warns_at_one_over_n_or_one_tenth(clients, delta, warned, why):
    lines = warn("client", clients, delta=delta)
    assert bool(lines) == warned
    if warned:
        assert why in lines[0] and f"for {clients} clients" in lines[0]


def test_privacy_sample_names_the_clients_whose_sample_count_makes_delta_weak():
    # delta = 0.01: 1/30 = 0.033 and 1/8 = 0.125 are above it, 1/500 = 0.002 is not
    lines = warn("sample", 3, [30, 500, 8], delta=0.01)
    assert lines == ["privacy.delta=0.01 (as set) is at least 1/N = 0.002 for 1 of 3 client(s), the largest with "
                     "500 samples: a near-vacuous guarantee (publishing one of the N records outright with "
                     "probability delta meets it); give the clients more samples or set privacy.delta=0.0001"]
    # the default 1/n^1.1 of the smallest client (8 samples): 0.10153 >= 0.1, so every client is concerned
    lines = warn("sample", 3, [30, 500, 8])
    assert len(lines) == 1 and "privacy.delta=0.1015 (the default 1/N^1.1) is at least 1/N = 0.002 for 3 of 3" \
        in lines[0]
    lines = warn("sample", 2, [8, 8])
    assert len(lines) == 1 and "0.1015 (the default 1/N^1.1) is at least 0.1 for 2 of 2" in lines[0]
    # the default of 9 samples, 9^-1.1 = 0.08919, is below 0.1 and 1/9, but above 1/30 and 1/500
    lines = warn("sample", 3, [30, 500, 9])
    assert len(lines) == 1 and "0.08919 (the default 1/N^1.1) is at least 1/N = 0.002 for 2 of 3" in lines[0]
    assert lines[0].endswith("privacy.delta=0.0001")  # below 1/500
    assert warn("sample", 3, [9, 9, 9]) == []


def test_no_warning_without_privacy_or_for_a_delta_the_ledger_refuses():
    assert warn("none", 2) == []
    assert warn("client", 1) == []  # default delta 1: the ledger's own one-line error says it
    assert VACUOUS_DELTA == 0.1

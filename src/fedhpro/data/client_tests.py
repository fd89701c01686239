"""``client_test=``'s values, declared without torch so that a config checks them before torch loads (the
matched test sets themselves: :mod:`fedhpro.data.matched_tests`)."""

from __future__ import annotations

#: ``client_test=`` values: ``shared`` (the paper's protocol) and ``matched``
CLIENT_TESTS = ("shared", "matched")

__all__ = ["CLIENT_TESTS"]

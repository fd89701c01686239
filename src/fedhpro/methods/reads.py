"""Which keys of the clients' replies a method's server reads: the check that a client uploads only what its server
uses (every key a reply carries leaves the client, and a key nobody reads is a leak for nothing).

:func:`keys_read` hands replies to the server's ``aggregate`` as the engines do (``new_replies()``, ``append``,
``aggregate``), each reply wrapped in a :class:`ReadRecorder` that notes every key the server looks up. The
fold of :class:`~fedhpro.methods.base.Replies` reads ``weights`` and ``num_examples`` of every reply it appends
(the running ``num_examples``-weighted sum); a server that keeps its replies whole reads them itself. For tests
(tests/test_reply_reads.py) and the privacy audit's "sent, not read" column (bench/privacy_audit.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from fedhpro.methods.base import Replies
from fedhpro.methods.layout import Payload


class ReadRecorder(Mapping[str, Any]):
    """A reply that records in ``reads`` every key whose value is looked up (``reply[key]``, ``get``, and
    ``items()`` / ``values()``, which look every value up). Listing the keys (``in``, ``keys()``, iteration)
    reads no value, so it records nothing."""

    def __init__(self, reply: Mapping[str, Any], reads: set[str]):
        self._reply = reply
        self.reads = reads

    def __getitem__(self, key: str) -> Any:
        value = self._reply[key]
        self.reads.add(key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._reply

    def __iter__(self) -> Iterator[str]:
        return iter(self._reply)

    def __len__(self) -> int:
        return len(self._reply)


class RecordedReplies(Replies):
    """The engines' :class:`~fedhpro.methods.base.Replies` whose stored replies come back as
    :class:`ReadRecorder` s on ``reads``; the fold's own reads (``weights`` and ``num_examples`` of each reply it
    appends) are recorded too."""

    def __init__(self, reads: set[str], fold_weights: bool = True):
        super().__init__(fold_weights=fold_weights)
        self.reads = reads

    def append(self, reply: Payload) -> None:
        if self.folds_weights:  # the running sum reads both (Replies.append)
            self.reads.update(("weights", "num_examples"))
        super().append(reply)

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            return [ReadRecorder(reply, self.reads) for reply in item]
        return ReadRecorder(item, self.reads)

    def __iter__(self) -> Iterator[Payload]:
        return (ReadRecorder(reply, self.reads) for reply in super().__iter__())  # type: ignore[misc]


def keys_read(server: Any, round: int, replies: Iterable[Payload]) -> tuple[set[str], dict[str, float]]:
    """``(the keys the server read, its metrics)`` after aggregating ``replies`` in ``round`` as an engine does:
    a container like its ``new_replies()`` (same folding), each reply appended, then ``aggregate``. The
    server's state changes as in a run."""
    reads: set[str] = set()
    container = RecordedReplies(reads, fold_weights=server.new_replies().folds_weights)
    for reply in replies:
        container.append(reply)
    metrics = server.aggregate(round, container)
    return reads, metrics


def sent_not_read(replies: Iterable[Mapping[str, Any]], reads: set[str]) -> list[str]:
    """The keys some reply carries that the server never read, sorted."""
    return sorted({key for reply in replies for key in reply} - reads)


__all__ = ["ReadRecorder", "RecordedReplies", "keys_read", "sent_not_read"]

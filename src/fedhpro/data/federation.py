"""A federation: the clients' training data and the test sets, resident as tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedhpro.errors import DataError

#: ``augment(x, generator) -> x``: a per-batch training augmentation (e.g. TinyImageNet's AutoAugment)
Augment = Callable[[Tensor, torch.Generator], Tensor]


@dataclass
class ClientData:
    """One client's training data, resident as tensors on the training device.

    ``augment``, when set, is applied to every training mini-batch (never to
    the data used for prototypes or evaluation); its randomness comes from the
    client's training generator, so a run stays reproducible.
    """

    x: Tensor
    y: Tensor
    num_classes: int
    augment: Augment | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device) -> ClientData:
        """This client's data on ``device``."""
        return ClientData(self.x.to(device), self.y.to(device), self.num_classes, self.augment)

    def select(self, index: Tensor) -> ClientData:
        """The samples at ``index`` (a copy)."""
        return ClientData(self.x[index], self.y[index], self.num_classes, self.augment)

    def with_augment(self, augment: Augment | None) -> ClientData:
        """The same data with another training augmentation."""
        return ClientData(self.x, self.y, self.num_classes, augment)


class CompactClientData(ClientData):
    """A client's 8-bit images kept as read (``uint8``: a quarter of float32's memory, which decides how many
    clients a machine holds), decoded by ``decode`` at each access of :attr:`x`. The decoding is elementwise
    (``normalize_images``), so the floats are those a decoding up front gives, to the bit."""

    def __init__(self, pixels: Tensor, y: Tensor, num_classes: int, decode: Callable[[Tensor], Tensor],
                 augment: Augment | None = None):
        if pixels.dtype != torch.uint8:
            raise DataError(f"compact client data holds uint8 pixels, got {pixels.dtype}")
        self.pixels, self.decode = pixels, decode
        self.y, self.num_classes, self.augment = y, num_classes, augment

    @property
    def x(self) -> Tensor:
        return self.decode(self.pixels)

    @x.setter
    def x(self, value: Tensor) -> None:
        raise AttributeError("compact client data is read-only: build a ClientData from its x instead")

    def to(self, device: torch.device) -> ClientData:
        return CompactClientData(self.pixels.to(device), self.y.to(device), self.num_classes, self.decode, self.augment)

    def select(self, index: Tensor) -> ClientData:
        return CompactClientData(self.pixels[index], self.y[index], self.num_classes, self.decode, self.augment)

    def with_augment(self, augment: Augment | None) -> ClientData:
        return CompactClientData(self.pixels, self.y, self.num_classes, self.decode, augment)


@dataclass
class UnseenClients:
    """The clients held out of training (:func:`fedhpro.data.unseen.hold_out_clients`): their training data
    (what a fine-tuning would use), their names, the test set each is pooled into (``groups``: its domain, or
    ``all``) and its test data."""

    clients: list[ClientData]
    names: list[str]
    groups: list[str]
    tests: list[tuple[Tensor, Tensor]]

    def to(self, device: torch.device) -> UnseenClients:
        """Move every tensor to ``device``."""
        self.clients = [c.to(device) for c in self.clients]
        self.tests = [(x.to(device), y.to(device)) for x, y in self.tests]
        return self


@dataclass
class Federation:
    """Clients' training tensors, test sets by domain (or one ``"all"``), and how they were made.

    ``partition`` is JSON-serialisable: per client its domain, the indices it
    took from its domain's training set, and its class counts.

    ``client_tests``, when set, holds each client's own test split (a
    federation that arrives split, as real sites hold data: ``dataset=clients``,
    :meth:`from_tensors` with per-client tests). Evaluation is then federated:
    every client tests on its own split and the correct counts are pooled per
    domain (per ``client_domains``; ``"all"`` for clients without one), exactly
    as the Flower server pools what its nodes report; AVG is the unweighted
    mean over those test sets, and the notes say so (:func:`avg_note`). ``test_sets`` then holds
    the same data concatenated per domain, for whole-set measurements (t-SNE).
    ``client_names`` names the clients (their folders); Flower nodes are
    ordered by it.
    """

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    clients: list[ClientData]
    client_domains: list[str]
    test_sets: dict[str, tuple[Tensor, Tensor]]
    partition: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    client_tests: list[tuple[Tensor, Tensor]] | None = None
    client_names: list[str] | None = None
    #: each client's validation part, held out of its training data (``validation=``:
    #: :func:`fedhpro.data.validation.hold_out_validation`); None: no validation
    client_validation: list[tuple[Tensor, Tensor]] | None = None
    #: each client's test set drawn to follow its training labels (``client_test=matched``:
    #: :func:`fedhpro.data.matched_tests.match_client_tests`); None: the shared test sets only
    client_matched_tests: list[tuple[Tensor, Tensor]] | None = None
    #: the clients held out of training (``unseen_clients=`` / ``unseen_domain=``:
    #: :func:`fedhpro.data.unseen.hold_out_clients`); None: every client trains
    unseen: UnseenClients | None = None

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def untested_clients(self) -> list[int]:
        """The clients whose own test split is empty (a federation that arrives split: ``client_tests``): they
        are not tested, so they have no accuracy of their own and stay out of the fairness statistics."""
        if self.client_tests is None:
            return []
        return [k for k, (_, y) in enumerate(self.client_tests) if not y.numel()]

    def client_test_name(self, k: int) -> str:
        """The test set of client ``k``'s own distribution: its domain's, else the only/``all`` one."""
        domain = self.client_domains[k] if self.client_domains else None
        if self.client_tests is not None:
            return domain or "all"
        if domain in self.test_sets:
            return domain
        if "all" in self.test_sets or len(self.test_sets) != 1:
            return "all"
        return next(iter(self.test_sets))

    def to(self, device: torch.device) -> Federation:
        """Move every tensor to ``device`` (once, before training: data stays resident)."""
        self.clients = [c.to(device) for c in self.clients]
        self.test_sets = {name: (x.to(device), y.to(device)) for name, (x, y) in self.test_sets.items()}
        if self.client_tests is not None:
            self.client_tests = [(x.to(device), y.to(device)) for x, y in self.client_tests]
        if self.client_validation is not None:
            self.client_validation = [(x.to(device), y.to(device)) for x, y in self.client_validation]
        if self.client_matched_tests is not None:
            self.client_matched_tests = [(x.to(device), y.to(device)) for x, y in self.client_matched_tests]
        if self.unseen is not None:
            self.unseen.to(device)
        return self

    @classmethod
    def from_tensors(cls, train: Sequence[tuple[Tensor, Tensor]],
                     test: Sequence[tuple[Tensor, Tensor] | None] | Mapping[str, tuple[Tensor, Tensor]], *,
                     num_classes: int | None = None, domains: Sequence[str | None] | None = None,
                     names: Sequence[str] | None = None, name: str = "custom",
                     partition: dict[str, Any] | None = None, notes: Sequence[str] = ()) -> Federation:
        """A federation from per-client ``(x, y)`` training tensors, checked.

        ``test``: one ``(x, y)`` per client (each client's own test split:
        evaluation is federated, see the class docstring; ``None`` for a
        client without a test split, which is then not tested, as a client
        folder without ``test/`` in ``dataset=clients``), or a mapping
        ``name -> (x, y)`` of shared test sets (a domain's name, or ``"all"``),
        on which the global model is tested as for the built-in data sets.
        ``domains``: each client's domain (``None`` or ``""``: none).
        ``num_classes``: default max label + 1. Inputs are float (images,
        features) or integer token ids; labels integer class indices.

        Raises :class:`~fedhpro.errors.DataError` naming the client and the fix
        (no training data, labels out of range, shapes that differ).
        """
        train = list(train)
        if not train:
            raise DataError("a federation needs at least one client; give one (x, y) training pair per client")
        k_total = len(train)
        names = [str(n) for n in names] if names is not None else [f"client {k}" for k in range(k_total)]
        if len(names) != k_total:
            raise DataError(f"{len(names)} client names for {k_total} clients; give one name per client")
        if len(set(names)) != k_total:
            raise DataError(f"client names repeat ({sorted(n for n in set(names) if names.count(n) > 1)}); "
                            "give every client its own name")
        domain_list = [str(d) if d else "" for d in domains] if domains is not None else [""] * k_total
        if len(domain_list) != k_total:
            raise DataError(f"{len(domain_list)} domains for {k_total} clients; give one domain (or None) per client")
        per_client = not isinstance(test, Mapping)
        tests = [] if isinstance(test, Mapping) else list(test)
        if per_client and len(tests) != k_total:
            raise DataError(f"{len(tests)} test splits for {k_total} clients; give one (x, y) test pair per client, "
                            "or a mapping name -> (x, y) of shared test sets")
        shared = {str(n): pair for n, pair in test.items()} if isinstance(test, Mapping) else {}
        if not per_client and not shared:
            raise DataError("no test set; give one (x, y) per client or a mapping name -> (x, y)")
        if per_client and all(pair is None for pair in tests):
            raise DataError("no client has a test set (every test entry is None); give at least one client an "
                            "(x, y) test pair, or a mapping name -> (x, y) of shared test sets")
        labelled = [(names[k], "training", pair) for k, pair in enumerate(train)]
        labelled += [(names[k], "test", pair) for k, pair in enumerate(tests) if pair is not None]
        labelled += [(f"test set {n!r}", "test", pair) for n, pair in shared.items()]
        checked = {}
        for who, split, pair in labelled:
            checked[(who, split)] = _checked_pair(pair, who, split)
        for k, given in enumerate(tests):
            if given is None:  # no test split: an empty one, as a client folder without test/ is read
                x, _ = checked[(names[k], "training")]
                checked[(names[k], "test")] = (x.new_empty((0, *x.shape[1:])), torch.empty(0, dtype=torch.int64))
        top = max(int(y.max()) for (_, y) in checked.values() if y.numel())
        num_classes = top + 1 if num_classes is None else int(num_classes)
        shapes = {tuple(x.shape[1:]) for (x, _) in checked.values()}
        if len(shapes) != 1:
            raise DataError(f"the clients' inputs differ in shape {sorted(shapes)}; give every client the same "
                            "input shape (e.g. resize images to one size)")
        for (who, split), (_, y) in checked.items():
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
                bad = int(y.max()) if int(y.max()) >= num_classes else int(y.min())
                raise DataError(f"{who}: {split} label {bad} is out of range for {num_classes} classes; labels must "
                                f"be 0..{num_classes - 1} (set num_classes or fix the labels)")
        for who in names:
            if checked[(who, "training")][1].numel() == 0:
                raise DataError(f"{who} has no training data; give it samples or leave it out of the federation")
        clients = [ClientData(*checked[(who, "training")], num_classes) for who in names]
        client_tests: list[tuple[Tensor, Tensor]] | None = None
        if per_client:
            client_tests = [checked[(who, "test")] for who in names]
            groups: dict[str, list[int]] = {}
            for k, domain in enumerate(domain_list):
                groups.setdefault(domain or "all", []).append(k)
            test_sets = {group: (torch.cat([client_tests[k][0] for k in members]),
                                 torch.cat([client_tests[k][1] for k in members]))
                         for group, members in groups.items()}
        else:
            test_sets = {n: checked[(f"test set {n!r}", "test")] for n in shared}
        notes = list(notes)
        untested = [names[k] for k, (_, y) in enumerate(client_tests or []) if not y.numel()]
        if untested and untested_note(untested) not in notes:
            notes.append(untested_note(untested))
        if client_tests is not None:
            blank = sorted({d or "all" for d in domain_list} - {domain_list[k] or "all"
                                                               for k, (_, y) in enumerate(client_tests) if y.numel()})
            if blank and untested_domains_note(blank) not in notes:
                notes.append(untested_domains_note(blank))
            avg = avg_note([(names[k], domain_list[k] or "all") for k, (_, y) in enumerate(client_tests) if y.numel()])
            if avg is not None and avg not in notes:
                notes.append(avg)
        record = partition if partition is not None else {
            "dataset": name, "scheme": "given",
            "clients": [{"client": k, "name": names[k], "domain": domain_list[k] or None,
                         "size": len(clients[k]),
                         "class_counts": torch.bincount(clients[k].y, minlength=num_classes).tolist()}
                        for k in range(k_total)]}
        return cls(name, num_classes, tuple(next(iter(shapes))), clients, domain_list, test_sets, record,
                   notes, client_tests=client_tests, client_names=names)

    @classmethod
    def from_datasets(cls, train: Sequence[Any], test: Sequence[Any | None] | Mapping[str, Any], *,
                      domains: Sequence[str | None] | None = None, names: Sequence[str] | None = None,
                      num_classes: int | None = None, name: str = "custom", batch_size: int = 256) -> Federation:
        """A federation from per-client ``torch.utils.data.Dataset`` objects, read once into tensors.

        Each dataset's items are ``(x, y)``: ``x`` a tensor (or array) of the
        same shape for every item, ``y`` a class index. They are read in order
        with a ``DataLoader`` of ``batch_size`` items (the dataset's transform
        runs once, here: a random augmentation is frozen into the data) and
        the tensors go to :meth:`from_tensors`, which checks them; ``test``
        (``None`` for a site without a test set: it is not tested),
        ``domains``, ``names``, ``num_classes`` and ``name`` mean what they
        mean there. Items that are PIL images raise a one-line DataError asking
        for a transform such as ``torchvision.transforms.ToTensor()``.

        Classes are matched by name across the datasets: where they carry
        their class names (torchvision's ``.class_to_idx`` or ``.classes``,
        also through a ``Subset``'s ``.dataset``) and number them differently
        (one ``ImageFolder`` per site, each numbering its own class folders),
        every label is mapped to the sorted union of the names, and the
        federation's ``notes`` say so. Datasets of which some carry names and
        others do not are a one-line DataError (their numberings cannot be
        matched).
        """
        from torch.utils.data import DataLoader

        def materialise(dataset: Any, who: str, split: str) -> tuple[Tensor, Tensor]:
            xs: list[Tensor] = []
            ys: list[Tensor] = []
            for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=list):
                for item in batch:
                    if not isinstance(item, (tuple, list)) or len(item) != 2:
                        raise DataError(f"{who}: {split} items must be (x, y) pairs, got {type(item).__name__}; "
                                        "make the dataset return (input, class index)")
                    x, y = item
                    if type(x).__module__.startswith("PIL."):
                        raise DataError(f"{who}: {split} inputs are PIL images; give the dataset a transform that "
                                        "makes tensors, e.g. transform=torchvision.transforms.ToTensor()")
                    try:
                        xs.append(torch.as_tensor(x))
                        ys.append(torch.as_tensor(y).reshape(()))
                    except (TypeError, ValueError, RuntimeError):
                        raise DataError(f"{who}: a {split} item is ({type(x).__name__}, {type(y).__name__}); "
                                        "x must be a tensor and y one class index") from None
            if not xs:
                raise DataError(f"{who}: the {split} dataset is empty; give it samples")
            shapes = {tuple(x.shape) for x in xs}
            if len(shapes) != 1:
                raise DataError(f"{who}: {split} inputs differ in shape ({sorted(shapes)[:3]}); give the dataset a "
                                "transform that makes them one shape (e.g. Resize, then ToTensor)")
            return torch.stack(xs), torch.stack(ys)

        train = list(train)
        labels = [str(n) for n in names] if names is not None else [f"client {k}" for k in range(len(train))]
        if len(labels) != len(train):
            raise DataError(f"{len(labels)} client names for {len(train)} clients; give one name per client")
        if not isinstance(test, Mapping) and len(list(test)) != len(train):
            raise DataError(f"{len(list(test))} test datasets for {len(train)} clients; give one test dataset per "
                            "client, or a mapping name -> dataset of shared test sets")
        sources = [(labels[k], "training", dataset) for k, dataset in enumerate(train)]
        sources += ([(f"test set {str(n)!r}", "test", dataset) for n, dataset in test.items()]
                    if isinstance(test, Mapping) else [(labels[k], "test", d) for k, d in enumerate(test)])
        absent = [index for index, (_, split, dataset) in enumerate(sources) if split == "test" and dataset is None]
        if isinstance(test, Mapping) and absent:
            raise DataError(f"{sources[absent[0]][0]} is None; a shared test set needs a dataset (None means "
                            "\"no test set\" only in a list of one test dataset per client)")
        sources = [source for index, source in enumerate(sources) if index not in absent]
        mapping = _class_mapping(sources, num_classes)
        pairs = []
        for (who, split, dataset), lookup in zip(sources, mapping.lookups if mapping else [None] * len(sources)):
            x, y = materialise(dataset, who, split)
            pairs.append((x, _renumbered(y, lookup, who, split) if lookup is not None else y))
        train_pairs = pairs[:len(train)]
        tests: Any = (dict(zip((str(n) for n in test), pairs[len(train):])) if isinstance(test, Mapping)
                      else _with_gaps(pairs[len(train):], [d is None for d in test]))
        notes = mapping.notes if mapping else []
        federation = cls.from_tensors(train_pairs, tests, num_classes=num_classes if mapping is None else
                                      len(mapping.classes), domains=domains, names=names, name=name, notes=notes)
        if mapping is not None:
            federation.partition["classes"] = list(mapping.classes)
        return federation


def round_robin(domains: Sequence[str], clients: int) -> dict[str, int]:
    """``clients`` spread over ``domains`` in their order, round robin: the first ``clients mod len(domains)``
    get one more (a domain may get none when ``clients < len(domains)``)."""
    return {d: clients // len(domains) + (1 if i < clients % len(domains) else 0) for i, d in enumerate(domains)}


def domains_without_clients_note(dataset: str, domains: Sequence[str], layout: Mapping[str, int],
                                 clients: int | None, left_out: Sequence[str] = (), choose: str = "") -> str | None:
    """The note of a federation some of whose ``domains`` get no client in ``layout`` (domain -> clients), one
    wording for every data set: which domains, why (``clients=K`` fewer than the domains, or
    ``data.clients_per_domain`` not naming them), that they are neither trained on nor tested and what AVG
    covers, and the fix (``choose``: how to pick the domains on purpose). Domains in ``left_out`` were left
    out on purpose (``data.clients_per_domain`` gives them 0) and are not named; None when none is dropped."""
    dropped = [d for d in domains if layout.get(d, 0) <= 0 and d not in left_out]
    if not dropped:
        return None
    kept = [d for d in domains if layout.get(d, 0) > 0]
    these = f"domain{'s' if len(dropped) > 1 else ''} {', '.join(dropped)}"
    if clients is not None:
        verb = "get" if len(dropped) > 1 else "gets"
        cause = f"clients={clients} is fewer than its {len(domains)} domains, so {these} {verb} no client"
        fix = f"set clients={len(domains)} or more to give every domain a client"
    else:
        cause = f"data.clients_per_domain gives {these} no client"
        fix = "give every domain its clients in data.clients_per_domain (0 leaves one out on purpose)"
    return (f"{dataset}: {cause}: not trained on, not tested, and AVG covers {', '.join(kept)} only; {fix}"
            f"{', or ' + choose if choose else ''}")


#: fewer local batches an epoch than this, and a client takes too few SGD steps a round to learn much
FEW_BATCHES = 3


def batches_per_epoch(samples: int, batch_size: int) -> int:
    """The SGD steps a client of ``samples`` training samples takes an epoch at ``batch_size``: one per batch,
    but the local loop skips a batch of a single sample (unless the client holds just one)."""
    if samples <= 1:
        return samples
    return sum(1 for start in range(0, samples, batch_size) if min(batch_size, samples - start) >= 2)


def few_batches_note(federation: Federation | Sequence[int], batch_size: int,
                     names: Sequence[str] | None = None) -> str | None:
    """A note when the smallest client takes fewer than :data:`FEW_BATCHES` batches an epoch at ``batch_size``
    (e.g. a small tabular data set over three sites at the default 64), naming its size and a ``batch_size``
    that gives it at least that many; None otherwise. ``federation``: the federation, or the clients'
    training-set sizes (``names``: their names), as a Flower server knows them from its nodes."""
    if isinstance(federation, Federation):
        sizes, names = [len(client) for client in federation.clients], federation.client_names
    else:
        sizes = [int(n) for n in federation]
    if not sizes:
        return None
    k = min(range(len(sizes)), key=sizes.__getitem__)
    samples = sizes[k]
    steps = batches_per_epoch(samples, batch_size)
    if steps >= FEW_BATCHES:
        return None
    name = names[k] if names else f"client {k}"
    line = (f"the smallest client, {name}, has {samples} training samples: {steps} batch"
            f"{'' if steps == 1 else 'es'} an epoch at batch_size={batch_size}, too few SGD steps a round to "
            "learn much; ")
    better = samples // FEW_BATCHES
    if better >= 2:
        return line + f"batch_size={better} gives it {batches_per_epoch(samples, better)}"
    return line + f"no batch size gives it {FEW_BATCHES} batches of 2 or more samples: give it more data"


#: the most names a note lists (test sets; sites of one test set) before ``...`` and the count
MAX_LISTED = 10


def _listed(names: Sequence[str], what: str) -> str:
    """``names`` joined, the first :data:`MAX_LISTED` then ``..., N <what>`` where there are more."""
    if len(names) <= MAX_LISTED:
        return ", ".join(names)
    return ", ".join(names[:MAX_LISTED]) + f", ... ({len(names)} {what})"


def avg_note(sites: Sequence[tuple[str, str]], claimed: bool = False) -> str | None:
    """The note saying what AVG is where it is not the obvious one: a federation that arrives split (each site
    tested on its own test split) with more than one site tested. ``sites``: ``(site name, test set)`` of each
    tested site, in the sites' order; a site's test set is its domain, else ``"all"``
    (:meth:`Federation.client_test_name`). One wording wherever such a federation is made
    (:meth:`Federation.from_tensors`, ``dataset=clients``, the Flower server from its nodes' descriptions).

    The rule (``engines.evaluation.pool_accuracy``): a test set's accuracy pools the test counts of the sites
    tested on it (each test sample counts alike); AVG is the unweighted mean over the test sets. So one test set
    of several sites (``hospital-0..2`` by the name-prefix rule, or sites without a domain, all in ``all``)
    makes AVG the pooled accuracy, and a test set per site (``domain.txt`` naming each its own) makes it the
    unweighted mean over the sites. None for one site, or none (shared test sets, as the built-in data sets and
    ``dataset=imagefolder`` have, make AVG the unweighted mean over their domains: the paper's AVG).

    ``claimed``: nobody vouches for the sites (Flower's own-data mode without a roster), so AVG weighs each test
    set by its number of sites, up to the median site's test set's (``engines.evaluation.headline_weights``);
    the note says so where that differs from the unweighted mean."""
    if len(sites) < 2:
        return None
    members: dict[str, list[str]] = {}
    for name, test_set in sites:
        members.setdefault(test_set, []).append(name)
    entries = [test_set if names == [test_set] else f"{test_set} ({_listed(names, 'sites')})"
               for test_set, names in members.items()]
    pooled = "each test sample counts alike, so a site with more test data weighs more"
    if len(members) == 1:
        line = f"AVG is the accuracy on one test set, {entries[0]}, which pools the sites' test counts: {pooled}"
    elif all(len(names) == 1 for names in members.values()):
        line = (f"AVG is the unweighted mean over {len(members)} test sets, one per site: "
                f"{_listed(entries, 'test sets')}; each site counts alike, whatever the size of its test data")
    else:
        line = (f"AVG is the unweighted mean over {len(members)} test sets: {_listed(entries, 'test sets')}; "
                f"each test set counts alike, whatever its size, and one of several sites pools their test "
                f"counts ({pooled})")
    sizes = sorted(len(names) for names in members.values())
    if claimed and len(members) > 1 and sizes[0] != sizes[-1]:
        line = line.replace("AVG is the unweighted mean", "AVG is the mean", 1)
        line += ("; no roster vouches for the sites, so each test set weighs by its number of sites, up to the "
                 "typical site's test set's (one site naming a test set of its own weighs as one site)")
    return line + "; a site's test set is its domain, else all"


def untested_domains_note(domains: Sequence[str]) -> str:
    """The note naming the domains none of whose clients has a test split (one wording wherever a federation
    is made)."""
    return f"no client of {', '.join(domains)} has test data: no accuracy of its own is measured"


def untested_note(names: Sequence[str]) -> str:
    """The note naming the clients without a test split (one wording wherever a federation is made)."""
    return (f"clients without a test split, not tested (no accuracy of their own, left out of the fairness "
            f"statistics): {', '.join(names)}")


@dataclass
class ClassMapping:
    """How :meth:`Federation.from_datasets` numbers the classes: ``classes`` in label order; per dataset
    (training ones first, then the tests) the lookup from its own index to the federation's label, or
    None where its numbering is kept."""

    classes: list[str]
    lookups: list[dict[int, int] | None]
    notes: list[str]


def class_names_of(dataset: Any) -> dict[int, str] | None:
    """A dataset's own numbering of its classes, index -> name: torchvision's ``.class_to_idx``, else
    ``.classes`` (looked for through a ``Subset``'s ``.dataset`` too); None when it carries neither."""
    seen, depth = dataset, 0
    while seen is not None and depth < 8:
        mapping = getattr(seen, "class_to_idx", None)
        if isinstance(mapping, Mapping) and mapping:
            inverse = {int(index): str(name) for name, index in mapping.items()}
            if len(inverse) != len(mapping):
                raise DataError(f"{type(seen).__name__}.class_to_idx gives two classes one index ({dict(mapping)}); "
                                "give every class its own index")
            return inverse
        classes = getattr(seen, "classes", None)
        if isinstance(classes, (list, tuple)) and classes:
            return {i: str(name) for i, name in enumerate(classes)}
        seen, depth = getattr(seen, "dataset", None), depth + 1
    return None


def _class_mapping(sources: Sequence[tuple[str, str, Any]], num_classes: int | None) -> ClassMapping | None:
    """The federation's classes of ``(who, split, dataset)`` sources that carry class names (None when none
    does): their own numbering where every dataset numbers the classes alike, else the sorted union of the
    names; a one-line DataError where only some carry names, or ``num_classes`` disagrees."""
    found = [(who, split, class_names_of(dataset)) for who, split, dataset in sources]
    named = [(who, split) for who, split, names in found if names is not None]
    if not named:
        return None
    bare = [(who, split) for who, split, names in found if names is None]
    if bare:
        raise DataError(f"{named[0][0]}'s {named[0][1]} dataset names its classes (.classes / .class_to_idx) but "
                        f"{bare[0][0]}'s {bare[0][1]} dataset does not, so their numberings cannot be matched; give "
                        "every dataset its class names (e.g. torchvision's ImageFolder), or none")
    numberings = [names for _, _, names in found if names is not None]
    same = all(names == numberings[0] for names in numberings)
    if same:
        first = numberings[0]
        classes = [first[i] for i in sorted(first)]
        lookups: list[dict[int, int] | None] = [None] * len(found)
        notes = []
    else:
        classes = sorted({name for names in numberings for name in names.values()})
        index = {name: label for label, name in enumerate(classes)}
        lookups = [{own: index[name] for own, name in names.items()} for names in numberings]
        notes = [f"from_datasets: the datasets number their classes differently; labels matched by name to the "
                 f"sorted union of their class names: {', '.join(classes)}"]
    if num_classes is not None and int(num_classes) != len(classes):
        raise DataError(f"num_classes={num_classes} but the datasets name {len(classes)} classes "
                        f"({', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''}); leave num_classes unset")
    return ClassMapping(classes, lookups, notes)


def _renumbered(y: Tensor, lookup: dict[int, int], who: str, split: str) -> Tensor:
    """``y`` (a dataset's own class indices) as the federation's labels; an index the dataset does not name
    is a one-line DataError."""
    unknown = sorted({int(v) for v in y.reshape(-1).tolist()} - set(lookup))
    if unknown:
        raise DataError(f"{who}: {split} label {unknown[0]} is not among the dataset's class indices "
                        f"({sorted(lookup)}); fix its labels or its .classes / .class_to_idx")
    table = torch.full((max(lookup) + 1,), -1, dtype=torch.int64)
    for own, label in lookup.items():
        table[own] = label
    return table[y.long()]


def _with_gaps(pairs: Sequence[Any], gaps: Sequence[bool]) -> list[Any]:
    """``pairs`` in order, with ``None`` where ``gaps`` is true (the per-client test list of a federation some
    of whose sites have no test set)."""
    given = iter(pairs)
    return [None if gap else next(given) for gap in gaps]


def _checked_pair(pair: Any, who: str, split: str) -> tuple[Tensor, Tensor]:
    """``(x, y)`` as tensors: x float (or integer token ids), y int64 of the same length; else one DataError."""
    try:
        x, y = pair
    except (TypeError, ValueError):
        raise DataError(f"{who}: the {split} data must be an (x, y) pair of tensors") from None
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if y.dim() != 1 or x.dim() < 2 or x.shape[0] != y.shape[0]:
        raise DataError(f"{who}: {split} inputs {tuple(x.shape)} and labels {tuple(y.shape)} do not match; give "
                        "x as N x ... and y as N class indices")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        if y.is_floating_point() and bool(torch.all(y == y.round())):
            y = y.long()
        else:
            raise DataError(f"{who}: {split} labels must be integer class indices, got {y.dtype}")
    if x.is_floating_point():
        if not bool(torch.isfinite(x).all()):
            raise DataError(f"{who}: {split} inputs hold NaN or infinite values; clean the data")
        x = x.float()
    elif x.dtype == torch.uint8:
        raise DataError(f"{who}: {split} inputs are uint8 pixels; convert them to float "
                        "(fedhpro.data.federation.normalize_images maps 0..255 to [-1, 1])")
    else:
        x = x.long()
    return x.contiguous(), y.long().contiguous()


def normalize_images(images: Tensor) -> Tensor:
    """uint8 N x C x H x W -> float32 in [-1, 1] (mean 0.5, std 0.5 per channel)."""
    return images.float().div_(127.5).sub_(1.0)

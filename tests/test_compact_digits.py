"""digits-offline in a quarter of the memory: clients gather their rows of the domain's one uint8 tensor (mapped
from the cache file), test sets stay uint8 and are decoded a batch at a time, the ``syn`` build draws its noise
a chunk at a time and splits its rows in place.

References: hand-computed decoded values, ``normalize_images`` of a copy (the floats must be the same, to the
bit), ``count_correct`` on the float test set, torch's own indexing ``x[train]`` / ``x[test]``, and the build
with its noise drawn in one call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhpro.data import digits_offline as do
from fedhpro.data.digits_federation import DomainRows
from fedhpro.data.federation import ClientData, CompactClientData, normalize_images
from fedhpro.data.pixels import CompactImages
from fedhpro.errors import DataError


def test_domain_rows_decode_hand_values_exactly():
    images = torch.tensor([0, 255, 51, 128], dtype=torch.uint8).reshape(4, 1, 1, 1)
    client = DomainRows(images, torch.tensor([1, 0, 2, 3]), torch.tensor([0, 1, 2, 3]), 4, normalize_images)
    # x / 127.5 - 1 in float32: 255 -> 1.0, 0 -> -1.0, 51 -> 0.4 - 1, 128 -> 1.00392... - 1
    expected = torch.tensor([1.0, -1.0, np.float32(51 / 127.5) - np.float32(1.0),
                             np.float32(128 / 127.5) - np.float32(1.0)], dtype=torch.float32)
    assert torch.equal(client.x.flatten(), expected)
    assert client.x.dtype == torch.float32


def test_domain_rows_equal_a_float_copy_of_the_same_rows():
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (30, 3, 8, 8), dtype=torch.uint8, generator=generator)
    rows = torch.tensor([17, 2, 29, 5, 11, 0])
    y = torch.arange(6) % 3
    shared = DomainRows(images, rows, y, 3, normalize_images)
    eager = ClientData(normalize_images(images[rows].clone()), y, 3)  # the float client of before
    assert torch.equal(shared.x, eager.x) and torch.equal(shared.pixels, images[rows])
    index = torch.tensor([4, 0, 2])
    assert torch.equal(shared.select(index).x, eager.select(index).x)
    assert torch.equal(shared.select(index).y, eager.select(index).y)
    assert isinstance(shared.select(index), DomainRows) and shared.select(index).images is images  # no copy
    assert shared.to(torch.device("cpu")) is shared and shared.to("cpu") is shared

    def flip(x, generator):
        return x.flip(-1)

    augmented = shared.with_augment(flip)
    assert augmented.augment is flip and torch.equal(augmented.x, eager.x) and augmented.images is images
    with pytest.raises(AttributeError, match="read-only"):
        shared.pixels = images[:2]
    with pytest.raises(AttributeError, match="read-only"):
        shared.x = eager.x
    with pytest.raises(DataError, match="uint8"):
        DomainRows(images.float(), rows, y, 3, normalize_images)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_domain_rows_move_only_their_rows_to_another_device():
    images = torch.randint(0, 256, (30, 3, 4, 4), dtype=torch.uint8)
    rows = torch.tensor([3, 1])
    moved = DomainRows(images, rows, torch.tensor([0, 1]), 2, normalize_images).to(torch.device("cuda"))
    assert isinstance(moved, CompactClientData) and moved.pixels.shape[0] == 2
    assert torch.equal(moved.x.cpu(), normalize_images(images[rows]))


def test_split_rows_in_place_equals_indexing():
    x = torch.randint(0, 256, (57, 3, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    labels = np.arange(57) % 10
    train, test = do._stratified_split(labels, 0.2, np.random.default_rng(3))
    expected_train, expected_test = x[torch.from_numpy(train)], x[torch.from_numpy(test)]
    got_train, got_test = do._split_rows(x, train, test)
    assert torch.equal(got_train, expected_train) and torch.equal(got_test, expected_test)
    assert got_train.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # views: no copy
    with pytest.raises(ValueError, match="once"):
        do._split_rows(x, train, test[1:])


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_syn_noise_in_chunks_gives_the_one_call_images(chunk):
    labels = np.arange(13) % 10
    whole_rng, chunked_rng = np.random.default_rng([0, 2]), np.random.default_rng([0, 2])
    whole = do._build_syn(labels, whole_rng, chunk=len(labels))  # the noise in one call, as before
    chunked = do._build_syn(labels, chunked_rng, chunk=chunk)
    assert whole.dtype == torch.uint8 and whole.shape == (13, 3, 32, 32)
    assert torch.equal(chunked, whole)
    # the generator ends where it did, so the split drawn after it is the same too
    assert whole_rng.integers(0, 2 ** 62) == chunked_rng.integers(0, 2 ** 62)
    with pytest.raises(ValueError, match="chunk"):
        do._build_syn(labels, np.random.default_rng(0), chunk=0)


@pytest.mark.slow
def test_first_run_and_cached_run_give_the_same_mapped_tensors(tmp_path):
    first = do.build_digits_offline(tmp_path, syn_size=60)
    cached = do.build_digits_offline(tmp_path, syn_size=60)
    fresh = do._build(0, 0.2, 60, False)  # built in memory, never saved
    for name in do.DOMAINS:
        for a, b, c in zip(first[name], cached[name], fresh[name]):
            assert torch.equal(a, c) and torch.equal(b, c)
    train, test = cached["syn"].train_x, cached["syn"].test_x
    assert train.shape[0] + test.shape[0] == 60
    # the file's mapping is private: writing to a loaded tensor leaves the cache as it was
    train[0].fill_(0)
    again = do.build_digits_offline(tmp_path, syn_size=60)
    assert torch.equal(again["syn"].train_x, fresh["syn"].train_x)


def test_compact_images_read_as_their_decoded_floats():
    pixels = torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    images = CompactImages(pixels, normalize_images)
    floats = normalize_images(pixels.clone())  # the test set held before
    assert (images.shape, images.device, images.dtype, len(images), images.dim()) == (
        floats.shape, floats.device, torch.float32, 10, 4)
    assert torch.equal(images[2:7], floats[2:7]) and torch.equal(images[torch.tensor([9, 0])], floats[[9, 0]])
    assert type(images[:3]) is torch.Tensor and images[:3].dtype == torch.float32
    assert torch.equal(torch.cat([images, images]), torch.cat([floats, floats]))
    assert torch.equal(images + 1, floats + 1) and images.is_floating_point()
    assert images.to("cpu") is images and torch.equal(images.to(torch.float64), floats.double())
    assert images.pixels.nbytes * 4 == floats.nbytes
    hand = CompactImages(torch.tensor([0, 255, 51], dtype=torch.uint8), normalize_images)
    assert torch.equal(hand[:], torch.tensor([-1.0, 1.0, np.float32(51 / 127.5) - np.float32(1.0)]))
    with pytest.raises(DataError, match="read-only"):
        images[0] = 0
    with pytest.raises(DataError, match="read-only"):
        images.mul_(2)
    with pytest.raises(DataError, match="uint8"):
        CompactImages(floats, normalize_images)


def test_compact_test_sets_count_as_the_float_ones():
    from fedhpro.engines.one_round import count_correct

    generator = torch.Generator().manual_seed(5)
    pixels = torch.randint(0, 256, (150, 3, 8, 8), dtype=torch.uint8, generator=generator)
    y = torch.randint(0, 4, (150,), generator=generator)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4))
    compact, floats = CompactImages(pixels, normalize_images), normalize_images(pixels.clone())
    for batch in (7, 64, None):
        assert count_correct(model, compact, y, batch) == count_correct(model, floats, y, batch)
    with torch.no_grad():
        assert torch.equal(model(compact[:64]), model(floats[:64]))


def test_digits_offline_test_sets_are_compact(digits_data_dir):
    from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

    from fedhpro.data.digits_federation import DigitsOfflineOptions, build

    options = DigitsOfflineOptions(domains=["syn", "mnist"], syn_size=DIGITS_SYN_SIZE,
                                   test_fraction=DIGITS_TEST_FRACTION)
    federation = build(options, 4, 0, digits_data_dir)
    domains = do.build_digits_offline(digits_data_dir, syn_size=DIGITS_SYN_SIZE, test_fraction=DIGITS_TEST_FRACTION)
    for name, (x, y) in federation.test_sets.items():
        assert isinstance(x, CompactImages) and x.pixels.dtype == torch.uint8
        assert torch.equal(x[:], normalize_images(domains[name].test_x)) and torch.equal(y, domains[name].test_y)
    assert all(isinstance(c, DomainRows) for c in federation.clients)

"""Tests of the embedded synthetic identity dataset."""

import tracemalloc

import numpy as np
import pytest

from kdpemb.datasets.identity_renderer import IdentityRenderer
from kdpemb.datasets.synthetic_identities import SyntheticImages, synthetic_identities
from kdpemb.datasets.user_images import UserImages

NOISE_STD = 8.0  # Pixel noise of the renderer, in 0..255 units.


@pytest.fixture(scope="module")
def fifty_identities():
    """50 identities x 20 images at 32x32x3, as float64 `(50, 20, 3072)`."""
    data = synthetic_identities(50, 20, image_size=32, channels=3, seed=0)
    return np.asarray(data.images).reshape(50, 20, -1).astype(np.float64)


def test_shapes_dtypes_and_identity_major_labels():
    data = synthetic_identities(5, 4, image_size=16, channels=3, seed=1)
    images, labels, user_ids = data
    assert isinstance(data, UserImages)
    assert isinstance(images, SyntheticImages)
    assert len(images) == len(data) == 20
    assert images.shape == (20, 16, 16, 3)
    assert images.ndim == 4
    assert images.dtype == np.uint8
    array = np.asarray(images)
    assert array.shape == (20, 16, 16, 3)
    assert array.dtype == np.uint8
    assert labels.dtype == np.int64
    assert user_ids.dtype == np.int64
    np.testing.assert_array_equal(labels, np.repeat(np.arange(5), 4))
    np.testing.assert_array_equal(user_ids, labels)
    assert data.num_classes == 5
    assert data.num_users == 5


def test_grayscale_has_one_channel_and_other_sizes_work():
    images = synthetic_identities(3, 2, image_size=9, channels=1).images
    assert images.shape == (6, 9, 9, 1)
    assert np.asarray(images).shape == (6, 9, 9, 1)
    assert images[0].shape == (9, 9, 1)


def test_identities_per_user_groups_consecutive_identities():
    data = synthetic_identities(7, 2, image_size=8, identities_per_user=3)
    np.testing.assert_array_equal(data.labels, np.repeat(np.arange(7), 2))
    # Users 0 and 1 hold three identities each; user 2 holds the last one.
    np.testing.assert_array_equal(
        data.user_ids, [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
    )
    np.testing.assert_array_equal(data.user_ids, data.labels // 3)
    assert data.num_users == 3


def test_same_seed_gives_identical_bytes():
    first = np.asarray(synthetic_identities(6, 3, seed=7).images)
    second = np.asarray(synthetic_identities(6, 3, seed=7).images)
    assert first.tobytes() == second.tobytes()


def test_different_seed_gives_different_images():
    first = np.asarray(synthetic_identities(6, 3, seed=7).images)
    second = np.asarray(synthetic_identities(6, 3, seed=8).images)
    differs = (first != second).reshape(18, -1).any(axis=1)
    assert differs.all()
    assert np.abs(first.astype(int) - second.astype(int)).mean() > 10


def test_index_array_matches_rows_of_the_materialized_array():
    images = synthetic_identities(40, 5, seed=3).images
    full = np.asarray(images)
    rng = np.random.default_rng(0)
    index = rng.integers(0, len(images), size=64)  # Random order, repeats.
    index[:3] = [5, 5, 199]
    np.testing.assert_array_equal(images[index], full[index])
    np.testing.assert_array_equal(images[list(index)], full[index])
    negative = np.array([-1, -200, -17])
    np.testing.assert_array_equal(images[negative], full[negative])
    grid = index[:12].reshape(3, 4)
    np.testing.assert_array_equal(images[grid], full[grid])
    assert images[np.array([], dtype=np.int64)].shape == (0, 32, 32, 3)


def test_single_image_rendered_alone_equals_its_row_in_a_batch():
    images = synthetic_identities(40, 5, seed=3).images
    full = np.asarray(images)
    for i in (0, 1, 57, 123, 199):
        alone = images[i]
        assert alone.shape == (32, 32, 3)
        assert alone.tobytes() == full[i].tobytes()
        assert images[np.array([i])][0].tobytes() == full[i].tobytes()
    assert images[-1].tobytes() == full[199].tobytes()


def test_chunk_size_does_not_change_pixels():
    reference = np.asarray(SyntheticImages(30, 4, seed=5, chunk_size=1024))
    for chunk_size in (1, 7, 64):
        images = SyntheticImages(30, 4, seed=5, chunk_size=chunk_size)
        assert np.asarray(images).tobytes() == reference.tobytes()


def test_slices_ints_and_boolean_masks_index_like_numpy():
    images = synthetic_identities(8, 3, image_size=8, seed=2).images
    full = np.asarray(images)
    np.testing.assert_array_equal(images[3:11:2], full[3:11:2])
    np.testing.assert_array_equal(images[::-5], full[::-5])
    np.testing.assert_array_equal(images[np.int64(4)], full[4])
    mask = np.arange(24) % 5 == 0
    np.testing.assert_array_equal(images[mask], full[mask])
    np.testing.assert_array_equal(images[2, :, 3], full[2, :, 3])
    np.testing.assert_array_equal(images[1:4, ..., 0], full[1:4, ..., 0])


def test_images_depend_only_on_seed_identity_and_index_within_identity():
    base = np.asarray(synthetic_identities(5, 4, seed=9).images).reshape(
        5, 4, 32, 32, 3
    )
    more_images = np.asarray(synthetic_identities(5, 6, seed=9).images)
    np.testing.assert_array_equal(more_images.reshape(5, 6, 32, 32, 3)[:, :4], base)
    offset = synthetic_identities(3, 4, seed=9, first_identity=2)
    np.testing.assert_array_equal(offset.labels, np.repeat(np.arange(3), 4))
    np.testing.assert_array_equal(
        np.asarray(offset.images).reshape(3, 4, 32, 32, 3), base[2:]
    )


def test_array_protocol_casts_and_refuses_copy_false():
    images = synthetic_identities(2, 2, image_size=8).images
    as_float = np.asarray(images, dtype=np.float32)
    assert as_float.dtype == np.float32
    np.testing.assert_array_equal(as_float, np.asarray(images).astype(np.float32))
    np.testing.assert_array_equal(images.materialize(), np.asarray(images))
    with pytest.raises(ValueError, match="copy"):
        np.asarray(images, copy=False)
    assert images.nbytes == images.size == 4 * 8 * 8 * 3


def test_a_million_identities_are_lazy(monkeypatch):
    # The work is counted, not timed: the images rendered.
    rendered = []
    render = IdentityRenderer.render

    def counted(self, identity, within, chunk_size):
        rendered.append(np.size(identity))
        return render(self, identity, within, chunk_size)

    monkeypatch.setattr(IdentityRenderer, "render", counted)
    tracemalloc.start()
    try:
        images = SyntheticImages(1_000_000, 10, image_size=32, channels=3)
        assert rendered == []  # Nothing rendered ahead ...
        batch = images[[0, 9_999_999, 123_456]]
        assert sum(rendered) == 3  # ... and only the images asked for.
        _, images_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        data = synthetic_identities(1_000_000, 10, image_size=32, channels=3)
        _, data_peak = tracemalloc.get_traced_memory()
        assert sum(rendered) == 3  # The dataset renders nothing either.
    finally:
        tracemalloc.stop()
    full_size = 10_000_000 * 32 * 32 * 3  # 30.7 GB if it were materialised.
    assert len(images) == len(data) == 10_000_000
    assert images.shape == (10_000_000, 32, 32, 3)
    assert batch.shape == (3, 32, 32, 3)
    assert batch[1].tobytes() == images[-1].tobytes()
    # Rendering three images allocates a few hundred kB, not the array ...
    assert images_peak < 2_000_000
    # ... and the dataset only adds its two int64 label arrays (80 MB each).
    labels_bytes = data.labels.nbytes + data.user_ids.nbytes
    assert labels_bytes == 2 * 8 * 10_000_000
    assert data_peak < labels_bytes + 16_000_000
    assert data_peak < full_size / 100
    assert data.labels[-1] == 999_999
    assert data.user_ids[123_456] == 12_345


def test_nearest_centroid_on_raw_pixels_is_far_above_chance(fifty_identities):
    centroids = fifty_identities[:, :10].mean(axis=1)
    test = fifty_identities[:, 10:].reshape(500, -1)
    truth = np.repeat(np.arange(50), 10)
    squared = (
        (test**2).sum(1)[:, None]
        - 2 * test @ centroids.T
        + (centroids**2).sum(1)[None, :]
    )
    accuracy = float((squared.argmin(axis=1) == truth).mean())
    print(f"nearest-centroid accuracy: {accuracy:.3f} (chance 0.02)")
    # Measured 0.444 for seed 0 (0.42-0.49 over seeds 0-4); 10x chance is 0.2.
    assert accuracy >= 10 * (1 / 50)
    # Nuisance keeps raw pixels far from perfect: invariance must be learned.
    assert accuracy < 0.9


def test_same_identity_images_differ_by_more_than_pixel_noise(fifty_identities):
    within = np.abs(fifty_identities[:, 0] - fifty_identities[:, 1]).mean()
    print(f"mean |difference| within an identity: {within:.1f} / 255")
    # Measured 33.8 (31.9-34.8 over seeds 0-4); noise alone gives about
    # 0.8 * sqrt(2) * 8 = 9.
    assert within >= 3 * NOISE_STD


def test_between_identity_distances_exceed_within_identity(fifty_identities):
    first, second = fifty_identities[:, 0], fifty_identities[:, 1]
    within = np.linalg.norm(first - second, axis=1).mean()
    between = np.linalg.norm(first - np.roll(first, 1, axis=0), axis=1).mean()
    print(f"L2 between / within identity: {between / within:.3f}")
    # Measured 1.254 (1.22-1.25 over seeds 0-4).
    assert between > 1.1 * within


def test_no_two_images_of_an_identity_are_byte_identical():
    images = np.asarray(synthetic_identities(10, 12, image_size=16, seed=4).images)
    flat = images.reshape(10, 12, -1)
    for identity in flat:
        assert len({row.tobytes() for row in identity}) == 12


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_identities": 0}, r"num_identities .* got 0"),
        ({"num_identities": -3}, r"num_identities .* got -3"),
        ({"num_identities": 2.5}, r"num_identities must be an int, got 2\.5"),
        ({"num_identities": True}, r"num_identities must be an int, got True"),
        ({"images_per_identity": 0}, r"images_per_identity .* got 0"),
        ({"channels": 2}, r"channels must be 1 .* or 3 .*got 2"),
        ({"image_size": 4}, r"image_size must be an int >= 8, got 4"),
        ({"image_size": "32"}, r"image_size must be an int, got '32'"),
        ({"seed": -1}, r"seed .* got -1"),
        ({"seed": 2**64}, r"seed .* got 18446744073709551616"),
        ({"identities_per_user": 0}, r"identities_per_user .* got 0"),
        ({"first_identity": -5}, r"first_identity .* got -5"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_value(kwargs, pattern):
    arguments = {"num_identities": 4, "images_per_identity": 2, **kwargs}
    with pytest.raises(ValueError, match=pattern) as error:
        synthetic_identities(**arguments)
    assert "pass" in str(error.value)  # The message says how to fix it.


def test_syntheticimages_validates_chunk_size():
    with pytest.raises(ValueError, match=r"chunk_size .* got 0"):
        SyntheticImages(2, 2, chunk_size=0)


@pytest.mark.parametrize(
    "index",
    [10, -11, [0, 10], np.array([3, -11]), np.array([2**40])],
    ids=["int", "negative-int", "list", "array-negative", "huge"],
)
def test_out_of_range_indices_raise_index_error(index):
    images = synthetic_identities(5, 2, image_size=8).images
    with pytest.raises(IndexError, match="out of bounds"):
        images[index]


def test_non_integer_indices_raise_index_error():
    images = synthetic_identities(5, 2, image_size=8).images
    with pytest.raises(IndexError, match="dtype float64"):
        images[np.array([0.5, 1.0])]
    with pytest.raises(IndexError, match="boolean mask"):
        images[np.array([True, False])]


# ------------------------------------------------------- public domain --


def test_private_is_the_default_domain_and_public_is_reproducible():
    default = np.asarray(synthetic_identities(6, 3, seed=7).images)
    private = np.asarray(synthetic_identities(6, 3, seed=7, domain="private").images)
    assert default.tobytes() == private.tobytes()
    first = np.asarray(synthetic_identities(6, 3, seed=7, domain="public").images)
    second = np.asarray(synthetic_identities(6, 3, seed=7, domain="public").images)
    assert first.tobytes() == second.tobytes()
    assert (first != default).reshape(18, -1).any(axis=1).all()
    # Rendered alone or in a batch, at any chunking: the same bytes.
    lone = SyntheticImages(6, 3, seed=7, domain="public", chunk_size=1)
    np.testing.assert_array_equal(lone[np.array([17, 4])], first[[17, 4]])


def test_public_identities_are_another_stream_than_private_ones():
    private = SyntheticImages(1, 1, seed=3)
    public = SyntheticImages(1, 1, seed=3, domain="public")
    identities = np.arange(20_000, dtype=np.int64)
    private_keys = private._identity_keys(identities)
    public_keys = public._identity_keys(identities)
    # Identity k differs between the domains, and no public identity among
    # the first 20,000 is any of the first 20,000 private ones.
    assert (private_keys != public_keys).all()
    assert not np.isin(public_keys, private_keys).any()
    assert len(np.unique(public_keys)) == len(identities)


def test_public_identity_k_is_not_private_identity_k():
    # Nearest private centroid (images 0-4 of each identity) of held-out
    # images, every image standardised (which removes brightness and
    # contrast): private images find their identity far above chance, the
    # public images "of the same index" do not.
    def standardised(domain):
        images = np.asarray(synthetic_identities(20, 10, seed=0, domain=domain).images)
        flat = images.reshape(20, 10, -1).astype(np.float64)
        flat -= flat.mean(axis=-1, keepdims=True)
        return flat / flat.std(axis=-1, keepdims=True)

    private, public = standardised("private"), standardised("public")
    centroids = private[:, :5].mean(axis=1)

    def accuracy(queries):
        queries = queries.reshape(-1, queries.shape[-1])
        distances = ((queries[:, None] - centroids[None]) ** 2).sum(-1)
        return (distances.argmin(1) == np.repeat(np.arange(20), 5)).mean()

    assert accuracy(private[:, 5:]) > 0.3
    assert accuracy(public[:, 5:]) < 0.15  # Chance: 0.05.


def test_public_nuisance_is_brighter_and_warmer_as_documented():
    def stats(domain):
        images = synthetic_identities(100, 2, seed=0, domain=domain).images
        pixels = np.asarray(images).astype(np.float64)
        return pixels.mean(), (pixels[..., 0] - pixels[..., 2]).mean()

    (private_mean, private_warmth), (public_mean, public_warmth) = (
        stats("private"),
        stats("public"),
    )
    # Module docstring: mean pixel about 160 against 122, mean red minus
    # blue about +57 against +24.
    assert 150 < public_mean < 170 and 112 < private_mean < 132
    assert 45 < public_warmth < 67 and 14 < private_warmth < 34


def test_public_images_are_rarely_occluded_and_less_rotated():
    def nuisance(domain):
        images = SyntheticImages(1, 1, domain=domain)
        domain = images._domain
        return domain.occlusion, domain.rotation, domain.shift

    private, public = nuisance("private"), nuisance("public")
    assert public[0] < private[0] and public[1] < private[1]
    assert public[2] < private[2]


def test_unknown_domain_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"domain must be one of .*'public'.*got 'x'"):
        synthetic_identities(2, 2, domain="x")

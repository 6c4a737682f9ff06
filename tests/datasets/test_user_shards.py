"""User data on disk: write_user_shards, UserShards, VirtualClients over them."""

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from kdpemb.data import VirtualClients
from kdpemb.datasets import (
    ShardedArray,
    UserImages,
    UserShards,
    from_directory,
    synthetic_identities,
    write_user_shards,
)
from kdpemb.datasets import user_shards_writer as user_shards
from kdpemb.errors import CorruptDatasetError, DatasetNotFoundError
from tests.data.elements import Elements, batches, population

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleSamplingWarning"
)


def string_population(num_users, seed):
    """`population` with string user ids (sorted otherwise than the ints)."""
    images, labels, user_ids = population(num_users, seed)
    return images, labels, np.array([f"u{u % 97}-{u}" for u in user_ids])


def assert_same_data(shards, images, labels, user_ids):
    """The shards hold every user's examples, in input order, users sorted."""
    names = np.unique(user_ids)
    np.testing.assert_array_equal(shards.user_names, names)
    offsets = shards.user_offsets
    for u, name in enumerate(names):
        rows = np.flatnonzero(user_ids == name)
        stored = np.arange(offsets[u], offsets[u + 1])
        np.testing.assert_array_equal(shards.images[stored], images[rows])
        np.testing.assert_array_equal(shards.labels[stored], labels[rows])
    assert shards.num_images == len(images) and shards.num_users == names.size
    assert shards.image_shape == images.shape[1:]


def assert_same_rounds(a, b, rounds=3):
    assert a.num_examples == b.num_examples and a.num_users == b.num_users
    assert a.max_identities_per_user == b.max_identities_per_user
    assert a.describe() == b.describe()
    for r in range(rounds):
        x, y = a.round(r), b.round(r)
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """String-id data and its shards (several: 13 images per shard), written
    through several buckets (so the users of each shard come from several)."""
    data = string_population(40, seed=3)
    directory = tmp_path_factory.mktemp("shards") / "data"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(user_shards, "BUCKET_ROWS", 32)
        return data, write_user_shards(directory, *data, images_per_shard=13)


# ------------------------------------------------------------ round trips --


def test_round_trip_from_arrays(written):
    (images, labels, user_ids), shards = written
    assert shards.num_shards > 3
    assert_same_data(shards, images, labels, user_ids)
    reopened = UserShards(shards.directory)
    np.testing.assert_array_equal(reopened.labels[:], shards.labels[:])
    assert shards.num_classes == labels.max() + 1
    assert shards.user_id_kind == "str"
    assert shards.user_keys.dtype == np.uint64
    assert shards.index_nbytes > 0


def test_round_trip_from_a_user_images_of_a_directory(tmp_path):
    rng = np.random.default_rng(0)
    for user, identity, k in [("ann", "cat", 0), ("ann", "dog", 1), ("bob", "cat", 2)]:
        folder = tmp_path / "photos" / user / identity
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{k}.png")
    data = from_directory(tmp_path / "photos")
    shards = write_user_shards(tmp_path / "out", data)
    assert_same_data(shards, np.asarray(data.images), data.labels, data.user_ids)
    assert shards.max_identities_per_user == 2


def test_round_trip_from_datasets(tmp_path):
    tf = pytest.importorskip("tensorflow")
    images, labels, user_ids = population(12, seed=5)
    sources = {
        "py": Elements(batches(images, labels, user_ids, size=7)),
        "tf-batched": tf.data.Dataset.from_tensor_slices(
            (images, labels, user_ids)
        ).batch(5),
        "tf-single": tf.data.Dataset.from_tensor_slices(
            {"images": images, "labels": labels, "user_ids": user_ids}
        ),
    }
    for name, source in sources.items():
        shards = write_user_shards(tmp_path / name, source, images_per_shard=10)
        assert_same_data(shards, images, labels, user_ids)


def test_a_lazy_array_is_read_in_blocks_and_buckets_are_grouped_bounded(
    tmp_path, monkeypatch
):
    # The writer's memory: blocks of at most COPY_ROWS input rows, and
    # buckets of at most BUCKET_ROWS rows grouped at once (a bucket that
    # grows larger is split again), never the whole data.
    monkeypatch.setattr(user_shards, "COPY_ROWS", 16)
    monkeypatch.setattr(user_shards, "BUCKET_ROWS", 24)
    monkeypatch.setattr(user_shards, "STREAM_BUCKETS", 2)
    data = synthetic_identities(60, 3, image_size=8, channels=1, seed=2)
    reads, grouped = [], []

    class Counted:
        shape, dtype = data.images.shape, data.images.dtype

        def __len__(self):
            return len(data.images)

        def __getitem__(self, key):
            rows = data.images[key]
            reads.append(len(rows))
            return rows

    load = user_shards._load_columns

    def counted_load(bucket):
        labels, ids = load(bucket)
        grouped.append(len(labels))
        return labels, ids

    monkeypatch.setattr(user_shards, "_load_columns", counted_load)
    shards = write_user_shards(tmp_path / "lazy", Counted(), data.labels, data.user_ids)
    assert max(reads) <= 16 and sum(reads) >= 180
    assert sum(grouped) == 180 and max(grouped) <= 24
    # A stream of unknown length starts with 2 buckets of ~90 rows: split.
    grouped.clear()
    stream = Elements(batches(np.asarray(data.images), data.labels, data.user_ids))
    streamed = write_user_shards(tmp_path / "stream", stream)
    assert sum(grouped) == 180 and max(grouped) <= 24 and len(grouped) > 2
    for other in (shards, streamed):
        assert_same_data(other, np.asarray(data.images), data.labels, data.user_ids)


# --------------------------------------------------------- VirtualClients --


@pytest.mark.parametrize(
    ("sampling", "k", "extra"),
    [
        ("poisson", 1, {"clients_per_round": 6}),
        ("poisson", 3, {"clients_per_round": 4}),
        ("fixed", 1, {"clients_per_round": 5}),
        ("fixed", 3, {"clients_per_round": 4}),
        ("epochs", 1, {"rounds_per_epoch": 4}),
        ("epochs", 3, {"rounds_per_epoch": 4}),
    ],
)
def test_rounds_over_shards_are_those_over_the_data(written, sampling, k, extra):
    data, shards = written
    kwargs = dict(
        users_per_client=k, sampling=sampling, local_steps=2, batch_size=3, seed=11
    )
    in_memory = VirtualClients(*data, **kwargs, **extra)
    on_disk = VirtualClients(shards, **kwargs, **extra)
    assert_same_rounds(in_memory, on_disk, rounds=5)
    for r in range(3):
        a, b = in_memory.plan_round(r), on_disk.plan_round(r)
        assert list(a) == list(b)


def test_virtual_clients_over_shards_hold_nothing_per_example(written):
    _, shards = written
    clients = VirtualClients(shards, clients_per_round=5, seed=0)
    assert isinstance(clients._labels, ShardedArray)
    assert isinstance(clients._images, ShardedArray)
    assert isinstance(clients._keys, np.memmap)
    assert isinstance(clients._user_offsets, np.memmap)
    assert not isinstance(clients._examples_by_user, np.ndarray)
    assert isinstance(clients.user_names, np.memmap)


def test_users_roster_and_num_classes_over_shards(written):
    data, shards = written
    names = shards.user_names.tolist()
    roster = [*names, "nobody-1", "nobody-2"]
    with pytest.warns(UserWarning, match="2 of 42 users have no examples") as seen:
        on_disk = VirtualClients(shards, clients_per_round=5, users=roster, seed=4)
    assert seen[0].filename == __file__  # Points at the caller.
    with pytest.warns(UserWarning, match="2 of 42 users"):
        in_memory = VirtualClients(*data, clients_per_round=5, users=roster, seed=4)
    assert_same_rounds(in_memory, on_disk)
    with pytest.raises(ValueError, match=r"1 user id\(s\) in .* are not in `users`"):
        VirtualClients(shards, clients_per_round=5, users=names[1:])
    with pytest.raises(ValueError, match=r"labels of .* go up to 6\. Use num_classes"):
        VirtualClients(shards, clients_per_round=5, num_classes=6)
    wider = VirtualClients(shards, clients_per_round=5, num_classes=30, seed=4)
    assert wider.num_classes == 30
    with pytest.raises(ValueError, match="either a UserShards or"):
        VirtualClients(shards, data[1], clients_per_round=5)


# ------------------------------------------------------------ bad inputs --


def test_bad_inputs_are_refused_naming_the_value(tmp_path):
    images, labels, user_ids = population(8, seed=1)
    target = tmp_path / "out"
    bad = images.copy()
    bad[len(bad) - 2] = np.nan
    last = len(bad) - 2
    with pytest.raises(ValueError, match=rf"images\[{last}\] holds NaN"):
        write_user_shards(target, bad, labels, user_ids)
    stream = Elements(batches(bad, labels, user_ids, size=3))
    with pytest.raises(ValueError, match=rf"images\[{last}\] holds NaN"):
        write_user_shards(target, stream)
    negative = labels.copy()
    negative[4] = -1
    with pytest.raises(ValueError, match=r"labels\[4\] = -1"):
        write_user_shards(target, images, negative, user_ids)
    with pytest.raises(
        ValueError, match=r"In element 1 of the PyDataset: .*labels\[1\] = -1"
    ):
        write_user_shards(target, Elements(batches(images, negative, user_ids)))
    with pytest.raises(ValueError, match="must be < num_classes=3"):
        write_user_shards(target, images, labels, user_ids, num_classes=3)
    mixed = [(images[:2], labels[:2], [1, 2]), (images[2:4], labels[2:4], ["a", "b"])]
    with pytest.raises(ValueError, match="holds str user ids, but the first"):
        write_user_shards(target, Elements(mixed))
    shapes = [
        (images[:2], labels[:2], [1, 2]),
        (np.zeros((2, 2, 2, 1)), [0, 1], [3, 4]),
    ]
    with pytest.raises(ValueError, match="inconsistent shapes or dtypes"):
        write_user_shards(target, Elements(shapes))
    with pytest.raises(ValueError, match="integers or strings, got floats"):
        write_user_shards(target, images, labels, user_ids + 0.5)
    with pytest.raises(ValueError, match="images_per_shard"):
        write_user_shards(target, images, labels, user_ids, images_per_shard=0)
    with pytest.raises(ValueError, match="add a channel axis"):
        write_user_shards(target, images[..., 0], labels, user_ids)
    assert not target.exists()
    assert os.listdir(tmp_path) == []


def test_a_failure_mid_write_leaves_no_directory(tmp_path):
    images, labels, user_ids = population(10, seed=2)
    parts = batches(images, labels, user_ids, size=4)

    class Broken(Elements):
        def __getitem__(self, index):
            if index == 2:
                raise OSError("disk unplugged")
            return super().__getitem__(index)

    with pytest.raises(OSError, match="disk unplugged"):
        write_user_shards(tmp_path / "out", Broken(parts))
    assert os.listdir(tmp_path) == []


def test_existing_directories(tmp_path):
    images, labels, user_ids = population(6, seed=3)
    target = tmp_path / "out"
    target.mkdir()  # Empty: fine.
    write_user_shards(target, images, labels, user_ids)
    with pytest.raises(FileExistsError, match=r"not empty\. Pass overwrite=True"):
        write_user_shards(target, images, labels, user_ids)
    shards = write_user_shards(
        target, images[:5], labels[:5], user_ids[:5], overwrite=True
    )
    assert shards.num_images == 5 and sorted(os.listdir(tmp_path)) == ["out"]
    other = tmp_path / "home"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a kdpemb user-shards dataset"):
        write_user_shards(other, images, labels, user_ids, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        write_user_shards(tmp_path / "file", images, labels, user_ids)


# ------------------------------------------------------ corrupt directories --


def test_corrupt_directories_are_refused(tmp_path):
    images, labels, user_ids = string_population(6, seed=4)
    source = write_user_shards(tmp_path / "good", images, labels, user_ids)
    manifest = json.loads((tmp_path / "good" / "manifest.json").read_text())
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        UserShards(tmp_path / "nowhere")
    with pytest.raises(DatasetNotFoundError, match=r"has no manifest\.json"):
        UserShards(tmp_path)

    def broken(change):
        directory = tmp_path / f"case{len(os.listdir(tmp_path))}"
        directory.mkdir()
        for name in os.listdir(source.directory):
            (directory / name).write_bytes((tmp_path / "good" / name).read_bytes())
        change(directory, json.loads(json.dumps(manifest)))
        return directory

    def edit(**fields):
        def change(directory, m):
            m.update(fields)
            (directory / "manifest.json").write_text(json.dumps(m))

        return change

    def remove(name):
        return lambda directory, m: os.remove(directory / name)

    def truncate(name):
        def change(directory, m):
            path = directory / name
            path.write_bytes(path.read_bytes()[:-3])

        return change

    def replace(name, array):
        return lambda directory, m: np.save(directory / name, array)

    shard, top = manifest["shards"][0], manifest["max_label"]
    cases = {
        "version 3, newer than the version 2": edit(version=3),
        "version 1, written by an older kdpemb": edit(version=1),
        "unknown format version 0": edit(version=0),
        "not a manifest of format": edit(format="tfrecord"),
        "num_images=-1, not a non-negative int": edit(num_images=-1),
        "has no 'shards'": lambda d, m: (
            m.pop("shards"),
            (d / "manifest.json").write_text(json.dumps(m)),
        ),
        f"{shard['images']} is missing": remove(shard["images"]),
        "users.npy is missing": remove("users.npy"),
        f"{shard['labels']} is truncated": truncate(shard["labels"]),
        f"{shard['images']} is truncated": truncate(shard["images"]),
        "user_keys.npy does not match users.npy": replace(
            "user_keys.npy", np.arange(source.num_users, dtype=np.uint64)
        ),
        "user_offsets.npy holds int64 of shape": replace(
            "user_offsets.npy", np.zeros(3, np.int64)
        ),
        "user_offsets run from": replace(
            "user_offsets.npy", np.asarray(source.user_offsets) + 1
        ),
        "num_images=2": edit(num_images=2),
        "image_dtype='<U3', not a number type": edit(image_dtype="<U3"),
        "unreadable index, shard list or image shape": edit(image_shape=[4, 0, 1]),
        "not valid JSON": lambda d, m: (d / "manifest.json").write_text("{"),
        "has no 'digests'": lambda d, m: (
            m.pop("digests"),
            (d / "manifest.json").write_text(json.dumps(m)),
        ),
        "has no digest of its layout or of some file": edit(digests={}),
        f"max_label={top}, not below num_classes={top}": edit(num_classes=top),
    }
    for message, change in cases.items():
        with pytest.raises(CorruptDatasetError, match=message):
            UserShards(broken(change))


def test_corrupt_shard_contents_are_refused_at_open(tmp_path):
    # Each field of a written dataset corrupted in turn: every case is a
    # CorruptDatasetError naming the file and the fix when opened, before
    # VirtualClients (or a backend) reads anything from it.
    images, labels, user_ids = population(6, seed=4)
    good = write_user_shards(tmp_path / "good", images, labels, user_ids)
    offsets, stored = np.asarray(good.user_offsets), np.asarray(good.labels[:])
    # An interior offset with more than one example on each side, moved by
    # one: still rising from 0 to num_images, one image changes user.
    u = next(
        u
        for u in range(1, good.num_users)
        if offsets[u] - offsets[u - 1] > 1 and offsets[u + 1] - offsets[u] > 1
    )
    shifted = offsets.copy()
    shifted[u] += 1
    name = json.loads((tmp_path / "good" / "manifest.json").read_text())["shards"][0][
        "labels"
    ]

    def with_label(value):
        changed = stored.copy()
        changed[3] = value
        return changed

    cases = {
        "user_offsets.npy was changed or corrupted .* another user": (
            "user_offsets.npy", shifted),
        rf"{name} holds label 10000 at row 3, outside \[0, max_label=": (
            name, with_label(10000)),
        rf"{name} holds label -1 at row 3": (name, with_label(-1)),
        rf"{name} was changed or corrupted": (name, with_label((stored[3] + 1) % 3)),
        rf"{name} holds int64 of shape": (name, stored.astype(np.int64)),
        rf"{name} holds int32 of shape \({len(stored) - 1},\)": (name, stored[1:]),
        "images.npy holds float64 of shape": (
            name.replace("labels", "images"), np.asarray(good.images[:], "float64")),
    }  # fmt: skip
    for k, (message, (file, array)) in enumerate(cases.items()):
        directory = tmp_path / f"case{k}"
        shutil.copytree(tmp_path / "good", directory)
        np.save(directory / file, array)
        with pytest.raises(CorruptDatasetError, match=message) as caught:
            UserShards(directory)
        assert "write_user_shards" in str(caught.value)
        assert str(directory) in str(caught.value)
    # Cut short: refused, never a deep error from NumPy or a backend.
    for file in ("user_offsets.npy", name):
        directory = tmp_path / f"short-{file}"
        shutil.copytree(tmp_path / "good", directory)
        data = (directory / file).read_bytes()
        (directory / file).write_bytes(data[: len(data) // 2])
        with pytest.raises(CorruptDatasetError, match=f"{file} is truncated"):
            UserShards(directory)


def test_shards_swapped_or_replaced_are_refused_at_open(tmp_path):
    # Four users of two images each, one a shard: every shard has the same
    # counts, so swapping two passes every structural check, yet gives one
    # user's images to another.
    images = np.arange(8, dtype=np.float32).reshape(8, 1, 1, 1)
    labels, user_ids = np.arange(8) % 3, np.repeat([10, 11, 12, 13], 2)
    write_user_shards(tmp_path / "good", images, labels, user_ids, images_per_shard=2)
    manifest = json.loads((tmp_path / "good" / "manifest.json").read_text())
    first, second = manifest["shards"][:2]
    assert first["num_images"] == second["num_images"] == 2

    def edited(**fields):
        def change(directory):
            m = json.loads(json.dumps(manifest))
            m.update(fields)
            (directory / "manifest.json").write_text(json.dumps(m))

        return change

    def swap_files(directory):
        a, b = directory / first["images"], directory / second["images"]
        a.rename(directory / "tmp.npy")
        b.rename(a)
        (directory / "tmp.npy").rename(b)

    edited_manifest = "manifest.json was edited since it was written"
    replaced = rf"{first['images']} was replaced, renamed or changed"
    cases = {
        "swapped in the manifest": (
            edited(shards=[second, first, *manifest["shards"][2:]]),
            edited_manifest),
        "num_classes": (edited(num_classes=manifest["num_classes"] + 5),
                        edited_manifest),
        "max_identities_per_user": (edited(max_identities_per_user=1),
                                    edited_manifest),
        "swapped on disk": (swap_files, replaced),
        "replaced": (lambda d: np.save(d / first["images"], images[:2] + 100),
                     replaced),
    }  # fmt: skip
    UserShards(tmp_path / "good")  # As written: opens.
    for k, (change, message) in enumerate(cases.values()):
        directory = tmp_path / f"case{k}"
        shutil.copytree(tmp_path / "good", directory)
        change(directory)
        with pytest.raises(CorruptDatasetError, match=message) as caught:
            UserShards(directory)
        assert "write_user_shards" in str(caught.value)


# ------------------------------------------------------------ ShardedArray --


def test_sharded_array_indexing_matches_numpy():
    whole = np.arange(40).reshape(10, 2, 2)
    rows = ShardedArray([whole[:3], whole[3:4], whole[4:]], [0, 3, 4, 10])
    assert rows.shape == (10, 2, 2) and len(rows) == 10 and rows.dtype == whole.dtype
    index = np.array([[9, 0, -1], [3, 3, 4]])
    for key in (5, -1, slice(2, 9, 3), slice(None), index, np.array([], int)):
        np.testing.assert_array_equal(rows[key], whole[key])
    mask = np.arange(10) % 3 == 0
    np.testing.assert_array_equal(rows[mask], whole[mask])
    for key in ((index, 1), (2, 1, 0), (slice(1, 5), 0), (mask, slice(None), 1)):
        np.testing.assert_array_equal(rows[key], whole[key])
    np.testing.assert_array_equal(np.asarray(rows), whole)
    for key in (10, np.array([0, -11]), np.array([0.5])):
        with pytest.raises(IndexError):
            rows[key]


def test_user_images_is_accepted_and_labels_with_it_refused(tmp_path):
    images, labels, user_ids = population(5, seed=6)
    data = UserImages(images, labels, user_ids)
    with pytest.raises(ValueError, match="either a UserImages"):
        write_user_shards(tmp_path / "x", data, labels)
    shards = write_user_shards(tmp_path / "y", data)
    assert_same_data(shards, images, labels, user_ids)

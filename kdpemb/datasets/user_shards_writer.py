"""Writing user shards: `write_user_shards`, streaming, in bounded memory.

Writes the format of `kdpemb.datasets.shard_format` (read back by
`kdpemb.datasets.UserShards`), checking the data as `VirtualClients`
checks it (`kdpemb.datasets.sources`). Imports no Keras.

Example:

>>> import tempfile, numpy as np
>>> shards = write_user_shards(tempfile.mkdtemp() + "/users",
...                            np.zeros((3, 2, 2, 1), np.uint8), [0, 1, 0], [5, 6, 5])
>>> shards.num_users, shards.user_offsets.tolist()
(2, [0, 2, 3])
"""

import contextlib
import json
import math
import numbers
import os
import secrets
import shutil

import numpy as np

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import _validation as validation
from kdpemb._atomic import PARTIAL_PREFIX
from kdpemb.datasets import shard_format, sources, user_hash
from kdpemb.datasets.user_shards_reader import UserShards
from kdpemb.version import __version__

# Pixel bytes of a shard by default (`images_per_shard=None`).
SHARD_BYTES = 2**30
# Rows of one temporary bucket the writer groups in memory at once: it
# holds their labels, user ids and sort order (about 20-40 bytes a row),
# never their pixels. A larger bucket is split again.
BUCKET_ROWS = 2**21
MAX_BUCKETS = 128
# Buckets for a stream of unknown length (split further when they grow).
STREAM_BUCKETS = 16
_MAX_SPLITS = 3
# Rows (and pixel bytes) copied at once, read from the input at once.
COPY_ROWS = 2**14
COPY_BYTES = 2**26


def write_user_shards(
    directory,
    images,
    labels=None,
    user_ids=None,
    *,
    images_per_shard=None,
    num_classes=None,
    overwrite=False,
):
    """Writes user data to `directory` as memory-mapped shards, streaming.

    Takes what `kdpemb.data.VirtualClients` takes, runs the same checks
    (finite pixels, labels, user ids), and writes the format of
    `kdpemb.datasets.shard_format`. Memory does not grow with the number of
    images: examples are first appended to temporary buckets on disk by a
    hash of their user id, then each bucket is grouped by user (memory:
    about `BUCKET_ROWS` rows of labels and ids, never pixels) and copied
    into the final shards in blocks, users in `np.unique` order. Only the
    per-user index (about 45 bytes a user) is held whole. The temporary
    buckets sit next to the target, so writing needs free disk for about
    twice the data.

    The directory appears whole or not at all: everything is written to a
    temporary sibling (`.partial-...`), renamed into place at the end, and
    removed on an error.

    Args:
        directory: path. Where to write; must not exist, or be empty.
        images: array `(N, H, W, C)`, a lazy array-like, a `UserImages`, a
            `tf.data.Dataset` or a `keras.utils.PyDataset` yielding
            `(images, labels, user_ids)`.
        labels: int array `(N,)`. Omit for a `UserImages` or a dataset.
        user_ids: int or str array `(N,)`. Omit likewise.
        images_per_shard: int or None. A shard holds the users whose first
            example falls in its block of this many rows (so a shard can be
            larger by one user's examples). Defaults to about 1 GiB of
            pixels per shard.
        num_classes: int or None. Number of identities, kept in the
            manifest; labels must be below it. Defaults to `max(labels) + 1`.
        overwrite: bool. Whether to replace an existing dataset (a
            directory holding a `manifest.json` of this format; any other
            non-empty directory is refused). Defaults to `False`.

    Returns:
        The `UserShards` of the new directory.

    Example:

    >>> import tempfile, numpy as np
    >>> directory = tempfile.mkdtemp() + "/users"
    >>> shards = write_user_shards(directory, np.zeros((6, 4, 4, 1), np.uint8),
    ...                            labels=[0, 1, 0, 2, 2, 1],
    ...                            user_ids=["bo", "al", "bo", "cy", "al", "cy"])
    >>> shards.num_images, shards.num_users, shards.num_classes
    (6, 3, 3)
    >>> shards.user_names.tolist(), shards.user_offsets.tolist()
    (['al', 'bo', 'cy'], [0, 2, 4, 6])
    >>> shards.labels[np.arange(6)].tolist()  # al's, then bo's, then cy's
    [1, 2, 0, 0, 2, 1]
    """
    directory = os.path.abspath(os.fspath(directory))
    _check_target(directory, overwrite)
    if images_per_shard is not None:
        images_per_shard = validation.check_positive_int(
            images_per_shard, "images_per_shard"
        )
    if num_classes is not None:
        num_classes = validation.check_positive_int(num_classes, "num_classes")
    source = sources.open_source(images, labels, user_ids, batch_size=COPY_ROWS)
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f"{PARTIAL_PREFIX}{secrets.token_hex(4)}-{name}")
    os.mkdir(staging)
    try:
        writer = _Writer(staging, images_per_shard, num_classes)
        writer.write(source)
        _install(staging, directory, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return UserShards(directory)


def _check_target(directory, overwrite):
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise FileExistsError(
            f"{directory} exists and is a file, not a directory. Choose another "
            "directory for the dataset, or remove the file."
        )
    if not os.listdir(directory):
        return
    if not overwrite:
        raise FileExistsError(
            f"{directory} already exists and is not empty. Pass overwrite=True "
            "to replace the dataset in it, or choose a new directory."
        )
    if not shard_format.is_dataset_directory(directory):
        raise FileExistsError(
            f"overwrite=True, but {directory} holds files that are not a kdpemb "
            f"user-shards dataset (no {shard_format.MANIFEST} of format "
            f"{shard_format.FORMAT!r}); they are not deleted. Choose a new or "
            "empty directory."
        )


def _install(staging, directory, overwrite):
    """Renames the finished `staging` directory onto `directory`."""
    _fsync(staging)
    _check_target(directory, overwrite)
    if os.path.isdir(directory) and os.listdir(directory):
        parent, name = os.path.split(directory)
        old = os.path.join(parent, f"{PARTIAL_PREFIX}old-{secrets.token_hex(4)}-{name}")
        os.rename(directory, old)
        os.rename(staging, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, directory)  # Onto nothing, or an empty directory.
    _fsync(os.path.dirname(directory))


def _fsync(path):
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    with contextlib.suppress(OSError):
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Bucket:
    """Examples appended to two temporary files: raw pixels and columns.

    The columns file holds, per appended block, `np.save`d labels then
    user ids (their width may vary from block to block).
    """

    def __init__(self, path, row_shape, dtype):
        self.path, self.row_shape, self.dtype = path, row_shape, np.dtype(dtype)
        self.count = 0
        self._pixels = open(path + ".pixels", "wb")  # noqa: SIM115 (kept open)
        self._columns = open(path + ".columns", "wb")  # noqa: SIM115

    def append(self, images, labels, ids):
        self._pixels.write(memoryview(np.ascontiguousarray(images, self.dtype)))
        np.save(self._columns, labels.astype(np.int32), allow_pickle=False)
        np.save(self._columns, ids, allow_pickle=False)
        self.count += len(labels)

    def close(self):
        self._pixels.close()
        self._columns.close()

    def images(self):
        return np.memmap(
            self.path + ".pixels", self.dtype, "r", shape=(self.count, *self.row_shape)
        )

    def column_blocks(self):
        """Yields `(labels, ids)` of each appended block, in order."""
        with open(self.path + ".columns", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            while f.tell() < size:
                labels = np.load(f, allow_pickle=False)
                yield labels, np.load(f, allow_pickle=False)

    def blocks(self):
        """Yields `(images, labels, ids)` blocks of what was appended."""
        images, start = self.images(), 0
        for labels, ids in self.column_blocks():
            stop = start + len(labels)
            yield np.asarray(images[start:stop]), labels, ids
            start = stop

    def remove(self):
        for suffix in (".pixels", ".columns"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path + suffix)


def _load_columns(bucket):
    """A bucket's labels and user ids, whole: the writer's largest arrays."""
    blocks = list(bucket.column_blocks())
    labels = np.concatenate([labels for labels, _ in blocks])
    ids = np.concatenate([ids for _, ids in blocks])
    return labels, ids


class _Grouped:
    """A bucket grouped by user: its users (sorted) and where their rows are."""

    def __init__(self, bucket, users, counts, order_path, labels_path):
        self.bucket, self.users, self.counts = bucket, users, counts
        self.order_path, self.labels_path = order_path, labels_path


class _Writer:
    def __init__(self, staging, images_per_shard, num_classes):
        self.staging = staging
        self.work = os.path.join(staging, "_work")
        os.mkdir(self.work)
        self.images_per_shard, self.num_classes = images_per_shard, num_classes
        self.row_shape = self.dtype = self.id_kind = None
        self.num_images, self.max_label, self.max_identities = 0, -1, 0
        self._names = 0
        # File name (or `shard_format.LAYOUT`): its digest, `shard_format`.
        self.digests = {}

    def _path(self):
        self._names += 1
        return os.path.join(self.work, f"bucket-{self._names:05d}")

    # -- pass 1: the input, checked, into buckets by a hash of the user --

    def write(self, source):
        blocks = self._checked_blocks(source)
        if source.num_examples is not None:
            wanted = math.ceil(source.num_examples / BUCKET_ROWS)
        else:
            wanted = STREAM_BUCKETS
        buckets = self._partition(blocks, min(max(wanted, 1), MAX_BUCKETS), level=0)
        grouped = []
        for bucket in buckets:
            grouped.extend(self._group(bucket, level=0))
        self._write_shards(grouped)
        shutil.rmtree(self.work)

    def _checked_blocks(self, source):
        """Yields checked `(images, labels, user_ids)` blocks of the input."""
        if source.kind == "array":
            # Labels and user ids are in memory already: checked whole, as
            # `VirtualClients` checks them; images a block at a time.
            whole = source.arrays()
            n = len(whole.images)
            sources.check_image_shape(whole.images.shape)
            labels, self.num_classes = sources.check_labels(
                whole.labels, n, self.num_classes
            )
            self.max_label = self._check_label_range(int(labels.max()), "labels")
            ids = self._id_column(sources.check_user_ids(whole.user_ids, n), "user_ids")
            step = self._rows_per_block(whole.images.shape[1:], source.dtype)
            for start in range(0, n, step):
                stop = min(start + step, n)
                where = f"images[{start}:{stop}]"
                images = self._checked_images(whole.images[start:stop], start, where)
                yield images, labels[start:stop], ids[start:stop]
            return
        for batch in source.batches():
            n = len(batch.images)
            images = self._checked_images(batch.images, self.num_images, batch.where)
            try:
                labels, _ = sources.check_labels(batch.labels, n, self.num_classes)
                ids = sources.check_user_ids(batch.user_ids, n)
            except ValueError as error:
                raise ValueError(f"In {batch.where}: {error}") from None
            top = self._check_label_range(int(labels.max()), batch.where)
            self.max_label = max(self.max_label, top)
            yield images, labels, self._id_column(ids, batch.where)

    @staticmethod
    def _check_label_range(top, where):
        if top >= 2**31:
            raise ValueError(
                f"{where} holds label {top}, but labels are stored as int32. "
                "Re-index the identities to 0..num_classes-1."
            )
        return top

    def _rows_per_block(self, row_shape, dtype):
        row_bytes = max(1, math.prod(row_shape) * np.dtype(dtype).itemsize)
        return max(1, min(COPY_ROWS, COPY_BYTES // row_bytes))

    def _checked_images(self, images, first, where):
        images = np.asarray(images)
        if self.row_shape is None:
            sources.check_image_shape(images.shape)
            self.row_shape, self.dtype = tuple(images.shape[1:]), images.dtype
        elif images.shape[1:] != self.row_shape or images.dtype != self.dtype:
            raise ValueError(
                "Images of inconsistent shapes or dtypes: the first images are "
                f"{self.row_shape} {self.dtype}, {where} has {images.shape[1:]} "
                f"{images.dtype}. Resize and cast them to one shape and dtype "
                "first (e.g. keras.layers.Resizing and a cast in a map)."
            )
        # As the float32 kdpemb's trainers cast pixels to (1e39 would turn
        # infinite), since a UserShards is not scanned again when read.
        finite_inputs.check_rows(
            images, "images", first=first, what="pixels", action="writing them",
            as_dtype="float32",
        )  # fmt: skip
        self.num_images += len(images)
        return images

    def _id_column(self, ids, where):
        """User ids as int64, str or bytes, of one kind for the whole input."""
        if ids.dtype.kind == "O":
            values = ids.tolist()
            for kind, test in (
                (str, lambda v: isinstance(v, str)),
                (bytes, lambda v: isinstance(v, bytes)),
                (np.int64, lambda v: isinstance(v, numbers.Integral)),
            ):
                if all(test(v) and not isinstance(v, bool) for v in values):
                    ids = np.array(values, dtype=kind)
                    break
            else:
                raise ValueError(
                    f"{where} mixes user id types that cannot be ordered (e.g. "
                    "ints and strings); use one type, e.g. str(user) for every id."
                )
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) >= 2**63:
            raise ValueError(
                f"{where} holds user id {int(ids.max())}, which does not fit "
                "in int64. Renumber the users below 2**63."
            )
        if ids.dtype.kind in "iu":
            ids = ids.astype(np.int64)
        kind = shard_format.ID_KINDS[ids.dtype.kind]
        if self.id_kind is None:
            self.id_kind = kind
        elif kind != self.id_kind:
            raise ValueError(
                f"{where} holds {kind} user ids, but the first ones are "
                f"{self.id_kind}. Use one type for every user id."
            )
        return ids

    def _bucket_of(self, ids, num_buckets, level):
        """The bucket of each id: a keyed hash of its user key, per level."""
        unique, inverse = np.unique(ids, return_inverse=True)
        keys = user_hash.user_keys(unique)
        hashed = user_hash.keyed_hash(keys, 0x5EED + level)
        return (hashed % np.uint64(num_buckets)).astype(np.int64)[inverse.reshape(-1)]

    def _partition(self, blocks, num_buckets, level):
        """Appends blocks of `(images, labels, ids)` to `num_buckets` buckets."""
        buckets = []
        try:
            for images, labels, ids in blocks:
                if not buckets:
                    buckets = [
                        _Bucket(self._path(), self.row_shape, self.dtype)
                        for _ in range(num_buckets)
                    ]
                which = self._bucket_of(ids, num_buckets, level)
                order = np.argsort(which, kind="stable")
                bounds = np.searchsorted(which[order], np.arange(num_buckets + 1))
                for b in np.flatnonzero(np.diff(bounds)):
                    rows = order[bounds[b] : bounds[b + 1]]
                    buckets[b].append(images[rows], labels[rows], ids[rows])
        finally:
            for bucket in buckets:
                bucket.close()
        return buckets

    # -- pass 2: each bucket grouped by user --

    def _group(self, bucket, level):
        """Yields `_Grouped` buckets (splitting one that is too large)."""
        if bucket.count == 0:
            bucket.remove()
            return
        if bucket.count > BUCKET_ROWS and level < _MAX_SPLITS:
            parts = min(MAX_BUCKETS, 2 * math.ceil(bucket.count / BUCKET_ROWS))
            children = self._partition(bucket.blocks(), parts, level + 1)
            bucket.remove()
            for child in children:
                yield from self._group(child, level + 1)
            return
        labels, ids = _load_columns(bucket)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
        users = ids[starts]
        counts = np.diff(np.append(starts, ids.size))
        del ids
        labels = labels[order]
        # Identities per user: distinct (user, label) pairs.
        rank = np.repeat(np.arange(users.size, dtype=np.int64), counts)
        width = int(labels.max()) + 1
        pairs = np.unique(rank * width + labels)
        most = int(np.bincount(pairs // width).max())
        self.max_identities = max(self.max_identities, most)
        order_path, labels_path = (
            bucket.path + ".order.npy",
            bucket.path + ".labels.npy",
        )
        np.save(order_path, order)
        np.save(labels_path, labels)
        yield _Grouped(bucket, users, counts, order_path, labels_path)

    # -- pass 3: users in np.unique order, into the final shards --

    def _save(self, name, array):
        np.save(os.path.join(self.staging, name), array)
        self.digests[name] = shard_format.digest(array)

    def _write_shards(self, grouped):
        num_classes = self.num_classes or self.max_label + 1
        # The per-user index, users sorted as np.unique sorts them (each
        # user is in one bucket). Arrays are dropped as soon as they are
        # used: at 10 million users each is 40 to 80 MB.
        sizes = [g.users.size for g in grouped]
        users = np.concatenate([g.users for g in grouped])
        for g in grouped:
            g.users = None
        index = np.argsort(users, kind="stable")
        users = users[index]
        num_users = users.size
        self._save(shard_format.INDEX_FILES["users"], users)
        keys = user_hash.user_keys(users)
        del users
        if self.id_kind != "int" and np.unique(keys).size != keys.size:
            raise ValueError(
                "Two user ids share a 64-bit key (a BLAKE2b collision of "
                "string ids); they would share a virtual client. Rename one "
                "user or use integer ids."
            )
        self._save(shard_format.INDEX_FILES["user_keys"], keys)
        del keys
        offsets = np.zeros(num_users + 1, np.int64)
        np.cumsum(np.concatenate([g.counts for g in grouped])[index], out=offsets[1:])
        self._save(shard_format.INDEX_FILES["user_offsets"], offsets)
        # Where each user's rows start in its bucket's grouped order.
        starts = np.concatenate([np.cumsum(g.counts) - g.counts for g in grouped])
        for g in grouped:
            g.counts = None
        starts = starts[index]
        bucket_of = np.repeat(np.arange(len(grouped), dtype=np.int32), sizes)[index]
        del index
        per_shard = self.images_per_shard or max(
            1, SHARD_BYTES // max(1, math.prod(self.row_shape) * self.dtype.itemsize)
        )
        # A user goes to the shard of the block of `per_shard` rows that
        # its first example falls in: the first users of the blocks.
        block_starts = np.arange(0, int(offsets[-1]), per_shard, dtype=np.int64)
        user_bounds = np.unique(np.searchsorted(offsets[:-1], block_starts))
        user_bounds = np.append(user_bounds[user_bounds < num_users], num_users)
        opened = [
            (g.bucket.images(), np.load(g.order_path, mmap_mode="r"),
             np.load(g.labels_path, mmap_mode="r"))
            for g in grouped
        ]  # fmt: skip
        shards = []
        step = self._rows_per_block(self.row_shape, self.dtype)
        for s in range(user_bounds.size - 1):
            first_user, end_user = int(user_bounds[s]), int(user_bounds[s + 1])
            low, high = int(offsets[first_user]), int(offsets[end_user])
            names = {
                "images": f"shard-{s:05d}-images.npy",
                "labels": f"shard-{s:05d}-labels.npy",
            }
            images_out = np.lib.format.open_memmap(
                os.path.join(self.staging, names["images"]),
                "w+",
                self.dtype,
                (high - low, *self.row_shape),
            )
            labels_out = np.lib.format.open_memmap(
                os.path.join(self.staging, names["labels"]),
                "w+",
                np.int32,
                (high - low,),
            )
            for start in range(low, high, step):
                rows = np.arange(start, min(start + step, high), dtype=np.int64)
                user = np.searchsorted(offsets, rows, side="right") - 1
                position = starts[user] + (rows - offsets[user])
                source = bucket_of[user]
                by_source = np.argsort(source, kind="stable")
                bounds = np.searchsorted(source[by_source], np.arange(len(opened) + 1))
                for b in np.flatnonzero(np.diff(bounds)):
                    take = by_source[bounds[b] : bounds[b + 1]]
                    images_b, order_b, labels_b = opened[b]
                    images_out[rows[take] - low] = images_b[order_b[position[take]]]
                    labels_out[rows[take] - low] = labels_b[position[take]]
            images_out.flush()
            labels_out.flush()
            self.digests[names["labels"]] = shard_format.digest(labels_out)
            self.digests[names["images"]] = shard_format.sampled_digest(
                images_out,
                os.path.getsize(os.path.join(self.staging, names["images"])),
            )
            del images_out, labels_out
            shards.append(
                {
                    **names,
                    "num_images": high - low,
                    "num_users": end_user - first_user,
                }
            )
        del opened
        manifest = {
            "format": shard_format.FORMAT,
            "version": shard_format.VERSION,
            "written_by": f"kdpemb {__version__}",
            "image_shape": list(self.row_shape),
            "image_dtype": self.dtype.str,
            "num_images": int(offsets[-1]),
            "num_users": int(num_users),
            "num_classes": int(num_classes),
            "max_label": int(self.max_label),
            "max_identities_per_user": int(self.max_identities),
            "user_id_kind": self.id_kind,
            "index": dict(shard_format.INDEX_FILES),
            "shards": shards,
        }
        self.digests[shard_format.LAYOUT] = shard_format.layout_digest(manifest)
        manifest["digests"] = self.digests
        for name in os.listdir(self.staging):
            path = os.path.join(self.staging, name)
            if os.path.isfile(path):
                _fsync_file(path)
        path = os.path.join(self.staging, shard_format.MANIFEST)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def _fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

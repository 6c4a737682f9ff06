"""Reading user shards: `UserShards` opens a directory, `ShardedArray` its rows.

The directory is in the format of `kdpemb.datasets.shard_format`, written
by `kdpemb.datasets.write_user_shards`. Opening memory-maps every file and
reads no pixel; indexing reads just the rows asked for.

Example:

>>> import numpy as np
>>> rows = ShardedArray([np.arange(3), np.arange(10, 12)], [0, 3, 5])
>>> rows[np.array([4, 0])].tolist(), len(rows)
([11, 0], 5)
"""

import math
import numbers
import os

import numpy as np

from kdpemb.datasets import shard_format, user_hash
from kdpemb.errors import CorruptDatasetError

# Users whose index entries one step of the opening check reads.
_INDEX_CHUNK = 2**20
# User ids whose keys are checked against `user_keys.npy` at open.
_KEY_SAMPLE = 64


class UserShards:
    """A user-shards directory (see `shard_format`), opened lazily.

    Opening reads the manifest and memory-maps the index and the shards;
    no pixel, label or per-user array is read into memory, so its memory
    does not grow with the number of images or users (the operating
    system pages the files in as they are read). It checks what it can
    cheaply: the format and version, that every file is there with the
    shape and dtype the manifest says (a truncated file is refused), that
    shard and user boundaries agree, that a sample of the stored user
    keys are the keys of the stored user ids, that every label is in
    [0, max_label] (below `num_classes`), and that the index and labels
    files are those written (their digests, `shard_format.digest`: a user
    offset moved by one would give an image to another user), as are the
    manifest's fields (shards swapped in it) and each images file's size
    and first, middle and last image (a file swapped or replaced). That is
    one pass over about 4 bytes an image and 30 a user, in blocks, and
    three images a shard; a pixel re-written in another image is not seen.

    `VirtualClients(UserShards(directory), ...)` trains on it with no
    per-example array in memory. `images` and `labels` are lazy
    array-likes over the global rows (users in index order, each user's
    examples contiguous): `shape`, `dtype`, `len()`, and indexing with an
    int, a slice or an integer array of any shape, which gathers from each
    shard in turn.

    Args:
        directory: path. Written by `write_user_shards`.

    Attributes:
        image_shape: tuple `(H, W, C)`.
        num_images, num_users, num_classes: int.
        max_label: int. The largest label.
        max_identities_per_user: int. Most identities one user holds.
        user_names: memory-mapped array `[num_users]` of user ids, sorted.
        user_offsets: memory-mapped int64 `[num_users + 1]`: user u's rows
            are `user_offsets[u]:user_offsets[u + 1]`.
        user_keys: memory-mapped uint64 `[num_users]`, the users'
            `kdpemb.datasets.user_hash.user_keys`.
        images, labels: lazy array-likes `[num_images, ...]`.
        index_nbytes: int. Bytes of the per-user index files on disk.

    Raises:
        DatasetNotFoundError: if there is no `manifest.json`.
        CorruptDatasetError: if the manifest or a file is missing, of
            another format or version, truncated, or inconsistent.

    Example:

    >>> import tempfile, numpy as np
    >>> directory = tempfile.mkdtemp() + "/users"
    >>> images = np.arange(5 * 2 * 2).reshape(5, 2, 2, 1).astype(np.float32)
    >>> from kdpemb.datasets import write_user_shards
    >>> _ = write_user_shards(directory, images, labels=[0, 1, 2, 1, 0],
    ...                       user_ids=[9, 4, 9, 4, 7], images_per_shard=2)
    >>> shards = UserShards(directory)
    >>> shards.num_users, shards.num_shards, shards.images.shape
    (3, 2, (5, 2, 2, 1))
    >>> shards.user_names.tolist(), shards.user_offsets.tolist()
    ([4, 7, 9], [0, 2, 3, 5])
    >>> shards.images[np.array([[4], [0]])][:, 0, 0, 0, 0].tolist()  # users 9, then 4
    [8.0, 4.0]
    """

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        manifest = shard_format.read_manifest(self.directory)
        self.image_shape = tuple(manifest["image_shape"])
        self.dtype = np.dtype(manifest["image_dtype"])
        self.num_images = manifest["num_images"]
        self.num_users = manifest["num_users"]
        self.num_classes = manifest["num_classes"]
        self.max_label = manifest["max_label"]
        self.max_identities_per_user = manifest["max_identities_per_user"]
        self.user_id_kind = manifest["user_id_kind"]
        index = manifest["index"]
        id_kind = {v: k for k, v in shard_format.ID_KINDS.items()}[self.user_id_kind]
        self.user_names = self._open(index["users"], (self.num_users,), id_kind)
        self.user_offsets = self._open(
            index["user_offsets"], (self.num_users + 1,), np.dtype(np.int64)
        )
        self.user_keys = self._open(
            index["user_keys"], (self.num_users,), np.dtype(np.uint64)
        )
        self.index_nbytes = sum(
            os.path.getsize(os.path.join(self.directory, index[name]))
            for name in shard_format.INDEX_FILES
        )
        images, labels = [], []
        for shard in manifest["shards"]:
            n = shard["num_images"]
            images.append(
                self._open(shard["images"], (n, *self.image_shape), self.dtype)
            )
            labels.append(self._open(shard["labels"], (n,), np.dtype(np.int32)))
        self.num_shards = len(images)
        starts = np.concatenate([[0], np.cumsum([len(a) for a in labels])])
        if starts[-1] != self.num_images:
            raise self._corrupt(
                f"its shards hold {int(starts[-1])} images, but the manifest says "
                f"num_images={self.num_images}"
            )
        self._check_index(manifest["shards"], starts)
        self._check_contents(manifest, images, labels)
        self.images = ShardedArray(images, starts)
        self.labels = ShardedArray(labels, starts)

    def _corrupt(self, what):
        return CorruptDatasetError(
            f"{self.directory} is not a valid user-shards dataset: {what}. "
            "Write it again with kdpemb.datasets.write_user_shards."
        )

    def _open(self, name, shape, dtype):
        """Memory-maps one file and checks its shape and dtype."""
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise self._corrupt(f"the manifest names a file {name!r}")
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            raise self._corrupt(f"{name} is missing")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:
            raise self._corrupt(
                f"{name} is truncated or unreadable ({error})"
            ) from None
        kind_ok = (
            array.dtype.kind == dtype
            if isinstance(dtype, str)
            else array.dtype == dtype
        )
        if array.shape != tuple(shape) or not kind_ok:
            raise self._corrupt(
                f"{name} holds {array.dtype} of shape {array.shape}, the manifest "
                f"says {dtype} of shape {tuple(shape)}"
            )
        return array

    def _check_index(self, shards, starts):
        offsets = self.user_offsets
        if offsets[0] != 0 or offsets[-1] != self.num_images:
            raise self._corrupt(
                f"user_offsets run from {int(offsets[0])} to {int(offsets[-1])}, "
                f"not 0 to num_images={self.num_images}"
            )
        first_users = np.concatenate([[0], np.cumsum([s["num_users"] for s in shards])])
        if first_users[-1] != self.num_users or (offsets[first_users] != starts).any():
            raise self._corrupt("its shard boundaries are not user boundaries")
        sample = np.unique(
            np.linspace(0, self.num_users - 1, min(_KEY_SAMPLE, self.num_users))
            .round()
            .astype(np.int64)
        )
        names = np.asarray(self.user_names[sample])
        # Every user's range, in order (one pass over the index in chunks:
        # a shifted offset would give one user's examples to another).
        for start in range(0, self.num_users, _INDEX_CHUNK):
            stop = min(start + _INDEX_CHUNK, self.num_users)
            if not (np.diff(offsets[start : stop + 1]) > 0).all():
                raise self._corrupt("user_offsets give a user no examples")
            ids = np.asarray(self.user_names[max(start - 1, 0) : stop])
            if (ids[1:] <= ids[:-1]).any():
                raise self._corrupt("users.npy is not sorted")
        expected = user_hash.user_keys(names)
        stored = np.asarray(self.user_keys[sample])
        if (expected != stored).any():
            i = int(np.flatnonzero(expected != stored)[0])
            raise self._corrupt(
                f"user_keys.npy does not match users.npy (user "
                f"{names[i].item()!r} has key {int(stored[i])}, its id gives "
                f"{int(expected[i])})"
            )

    def _check_contents(self, manifest, images, labels):
        """The manifest's fields, each images file's size and sampled rows,
        and labels in [0, max_label], the index and labels files read once
        in blocks: each against the digest the writer recorded."""
        digests = manifest["digests"]
        if shard_format.layout_digest(manifest) != digests[shard_format.LAYOUT]:
            raise self._corrupt(
                f"{shard_format.MANIFEST} was edited since it was written (its "
                "fields, e.g. the shards' order, names or counts, do not match "
                "their digest, digests['layout']); shards swapped in it would "
                "give one user's images to another"
            )
        for shard, array in zip(manifest["shards"], images, strict=True):
            name = shard["images"]
            size = os.path.getsize(os.path.join(self.directory, name))
            if shard_format.sampled_digest(array, size) != digests[name]:
                raise self._corrupt(
                    f"{name} was replaced, renamed or changed since it was "
                    "written (its size or first, middle or last image does not "
                    "match its digest in the manifest)"
                )
        files = [
            (manifest["index"][key], array, None)
            for key, array in (
                ("users", self.user_names),
                ("user_offsets", self.user_offsets),
                ("user_keys", self.user_keys),
            )
        ]
        for shard, array in zip(manifest["shards"], labels, strict=True):
            files.append((shard["labels"], array, self._label_check(shard["labels"])))
        for name, array, check in files:
            if shard_format.digest(array, check) != digests[name]:
                hint = (
                    "; a user offset moved by one gives an image to another user"
                    if name == manifest["index"]["user_offsets"]
                    else ""
                )
                raise self._corrupt(
                    f"{name} was changed or corrupted since it was written (its "
                    f"data does not match its digest in the manifest{hint})"
                )

    def _label_check(self, name):
        def check(block, start):
            bad = (block < 0) | (block > self.max_label)
            if bad.any():
                row = start + int(np.flatnonzero(bad)[0])
                raise self._corrupt(
                    f"{name} holds label {int(block[row - start])} at row {row}, "
                    f"outside [0, max_label={self.max_label}] (num_classes="
                    f"{self.num_classes}, as written)"
                )

        return check

    def __len__(self):
        return self.num_images

    def __repr__(self):
        return (
            f"UserShards({self.directory!r}: {self.num_images} images "
            f"{self.image_shape} of {self.num_users} users, {self.num_shards} "
            "shard(s))"
        )


class ShardedArray:
    """A read-only array-like over shards, rows numbered across them.

    `shape`, `dtype`, `ndim`, `len()`; indexing with an int, a slice or an
    integer array of any shape (negative values count from the end), or a
    boolean mask, returns a new `np.ndarray`; an integer array is grouped
    by shard (`np.searchsorted` on the shard starts) and each shard read
    once. `np.asarray` reads everything. Usually `UserShards.images` or
    `UserShards.labels`.

    Args:
        parts: list of arrays (memory maps) of the same row shape and dtype.
        starts: int array `[len(parts) + 1]`: the first row of each part,
            then the total.

    Example:

    >>> import numpy as np
    >>> rows = ShardedArray([np.arange(3), np.arange(10, 14)], [0, 3, 7])
    >>> rows.shape, rows[np.array([[6, 0], [3, -1]])].tolist(), rows[2:5].tolist()
    ((7,), [[13, 0], [10, 13]], [2, 10, 11])
    """

    def __init__(self, parts, starts):
        self._parts = list(parts)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._row_shape = tuple(self._parts[0].shape[1:])
        self.dtype = np.dtype(self._parts[0].dtype)
        self.shape = (int(self._starts[-1]), *self._row_shape)

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: math.prod(self.shape))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, tuple):
            if not key:
                return np.asarray(self)
            rows, first = self[key[0]], key[0]
            if isinstance(first, numbers.Integral):
                axes = 0
            elif isinstance(first, slice) or np.asarray(first).dtype == bool:
                axes = 1
            else:
                axes = np.ndim(first)
            return rows[(slice(None),) * axes + key[1:]]
        n = self.shape[0]
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            if not -n <= key < n:
                raise IndexError(f"index {key} is out of bounds for {n} rows.")
            return self._take(np.array([int(key) % n]))[0]
        if isinstance(key, slice):
            return self._take(np.arange(*key.indices(n), dtype=np.int64))
        index = np.asarray(key)
        if index.dtype == bool:
            if index.shape != (n,):
                raise IndexError(
                    f"a boolean mask must have shape ({n},), one entry per row, "
                    f"got {index.shape}."
                )
            return self._take(np.flatnonzero(index))
        if index.size == 0:
            return self._take(np.zeros(index.shape, np.int64))
        if not np.issubdtype(index.dtype, np.integer):
            raise IndexError(
                "index with an int, a slice, an integer array or a boolean mask, "
                f"got dtype {index.dtype}."
            )
        low, high = int(index.min()), int(index.max())
        if low < -n or high >= n:
            raise IndexError(
                f"index {low if low < -n else high} is out of bounds for {n} rows."
            )
        index = index.astype(np.int64)
        return self._take(np.where(index < 0, index + n, index))

    def _take(self, index):
        """Rows at in-range non-negative indices (any shape)."""
        flat = index.reshape(-1)
        out = np.empty((flat.size, *self._row_shape), self.dtype)
        if len(self._parts) == 1:
            out[...] = self._parts[0][flat]
        elif flat.size:
            part = np.searchsorted(self._starts, flat, side="right") - 1
            order = np.argsort(part, kind="stable")
            bounds = np.searchsorted(part[order], np.arange(len(self._parts) + 1))
            for p in np.flatnonzero(np.diff(bounds)):
                rows = order[bounds[p] : bounds[p + 1]]
                out[rows] = self._parts[p][flat[rows] - self._starts[p]]
        return out.reshape(*index.shape, *self._row_shape)

    def __array__(self, dtype=None, copy=None):
        if copy is False:
            raise ValueError(
                "A ShardedArray reads its rows from disk, so converting it to an "
                "array always makes a new array; use copy=None."
            )
        array = np.concatenate([np.asarray(part) for part in self._parts])
        return array if dtype is None else array.astype(dtype, copy=False)

    def __repr__(self):
        return f"ShardedArray(shape={self.shape}, dtype={self.dtype})"

"""The user-shards format: user data on disk, grouped by user, memory-mapped.

`kdpemb.datasets.write_user_shards(directory, data)` writes what
`VirtualClients` takes (arrays, a lazy array-like, a `UserImages`, a
`tf.data.Dataset` or a `keras.utils.PyDataset`) to a directory, streaming
(`user_shards_writer`); `kdpemb.datasets.UserShards(directory)` opens it
(`user_shards_reader`), and `VirtualClients(UserShards(directory), ...)`
trains on it with no per-example array in memory, so a dataset larger
than RAM trains. This module holds what both agree on: the names, the
version and the manifest, read and checked by `read_manifest`.

Why this format:

- No new dependency: `.npy` files and a JSON manifest, read and written by
  NumPy alone, the same on the TensorFlow and JAX backends (the
  TensorFlow-free JAX machines cannot read TFRecord, which is also read in
  sequence, without an index).
- O(1) random access to any image, with no decoding: each shard is a
  `.npy` file opened with `np.load(mmap_mode="r")`, so gathering a round
  reads just its images, and the operating system's page cache does the
  caching (shared between processes, released under memory pressure).
- The index is a few small arrays, one entry per user (memory-mapped too):
  examples are stored grouped by user, users in the order `np.unique`
  gives their ids, so a user's examples are one contiguous range.

The price: pixels are stored raw (no JPEG compression: 112×112×3 uint8 is
37.6 kB an image, typically several times its JPEG), and every image has the
same shape and dtype (resize before writing).

A directory holds (format `kdpemb-user-shards`, version 2):

- `manifest.json`: format and version, `image_shape`, `image_dtype`,
  `num_images`, `num_users`, `num_classes`, `max_label`,
  `max_identities_per_user`, `user_id_kind` (`int`, `str` or `bytes`),
  the index files, the shards (file names, images and users in each),
  and `digests`, checked when the directory is opened: under `layout`,
  the BLAKE2b-128 digest of every other field of the manifest
  (`layout_digest`: the shards' order, names and counts, `num_classes`,
  `max_identities_per_user`, ...); for each index and labels file, that
  of its data (`digest`); for each images file, that of its size and of
  its first, middle and last rows (`sampled_digest`: cheap, so a pixel
  re-written elsewhere in the file is not detected).
- `users.npy`: `[num_users]` user ids in index order, sorted as
  `np.unique` sorts them (int64, or fixed-width unicode or bytes).
- `user_offsets.npy`: int64 `[num_users + 1]`; user u's examples are the
  global rows `offsets[u]:offsets[u + 1]`.
- `user_keys.npy`: uint64 `[num_users]`,
  `kdpemb.datasets.user_hash.user_keys(users)`, so that opening hashes no
  ids (a sample is checked against the ids).
- `shard-00000-images.npy`: `[n, H, W, C]` images of consecutive users
  (each user wholly in one shard; the shards in order are the global
  rows), and `shard-00000-labels.npy`: int32 `[n]` identity labels.

Within a user, examples keep their input order, so `VirtualClients` over
the directory samples exactly the rounds it samples over the data itself.

Version 2 added the digests: an offset moved by one passes every
structural check (offsets still rise from 0 to `num_images`) yet gives an
image to another user, which matters when the privacy unit is the user;
so do two shards of equal counts swapped in the manifest, or two images
files swapped on disk. Version 1 directories are refused; write them
again. A digest detects accidents and edits, not an attacker: anyone who
can write the directory can compute a new one.

Example:

>>> import tempfile
>>> is_dataset_directory(tempfile.mkdtemp()), FORMAT, MANIFEST
(False, 'kdpemb-user-shards', 'manifest.json')
"""

import hashlib
import json
import os

import numpy as np

from kdpemb.errors import CorruptDatasetError, DatasetNotFoundError

FORMAT = "kdpemb-user-shards"
VERSION = 2
MANIFEST = "manifest.json"
INDEX_FILES = {
    "users": "users.npy",
    "user_offsets": "user_offsets.npy",
    "user_keys": "user_keys.npy",
}
# The dtype kinds of user ids, and their names in the manifest.
ID_KINDS = {"i": "int", "U": "str", "S": "bytes"}
# Rows of a file that `digest` reads at once.
DIGEST_ROWS = 2**20
# The key in `digests` of the digest of the manifest's other fields.
LAYOUT = "layout"


def digest(array, check=None):
    """The hex BLAKE2b-128 digest of the data of a 1-D `array`, read in
    blocks of `DIGEST_ROWS` rows (a memory map is paged in, not loaded);
    `check(block, start)`, if given, sees each block first.

    Example:

    >>> import numpy as np
    >>> a = np.arange(5, dtype=np.int64)
    >>> digest(a) == digest(a.copy()), digest(a) == digest(a + (a == 2))
    (True, False)
    """
    hasher = hashlib.blake2b(digest_size=16)
    for start in range(0, len(array), DIGEST_ROWS):
        block = np.ascontiguousarray(array[start : start + DIGEST_ROWS])
        if check is not None:
            check(block, start)
        hasher.update(block.reshape(-1).view(np.uint8))
    return hasher.hexdigest()


def sampled_digest(array, size):
    """The hex BLAKE2b-128 digest of a file's `size` in bytes and of rows
    0, n // 2 and n - 1 of its `array` (n rows): reads three rows, so a
    swapped or replaced images file is caught at open, a pixel changed in
    another row is not.

    Example:

    >>> import numpy as np
    >>> a = np.arange(12).reshape(4, 3)
    >>> b = a.copy()
    >>> b[1, 0] = -1  # Not a sampled row.
    >>> sampled_digest(a, 96) == sampled_digest(b, 96), (
    ...     sampled_digest(a, 96) == sampled_digest(a, 97))
    (True, False)
    """
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(int(size).to_bytes(8, "little"))
    n = len(array)
    for row in sorted({0, n // 2, n - 1}) if n else ():
        hasher.update(np.ascontiguousarray(array[row]).reshape(-1).view(np.uint8))
    return hasher.hexdigest()


def layout_digest(manifest):
    """The hex BLAKE2b-128 digest of every field of `manifest` but its
    `digests`, as canonical JSON: a manifest edited since it was written
    (shards swapped or renamed, `num_classes` changed) no longer matches.

    Example:

    >>> m = {"num_classes": 3, "shards": [{"images": "a"}, {"images": "b"}]}
    >>> swapped = {**m, "shards": m["shards"][::-1]}
    >>> layout_digest(m) == layout_digest({**m, "digests": {}}), (
    ...     layout_digest(m) == layout_digest(swapped))
    (True, False)
    """
    fields = {key: value for key, value in manifest.items() if key != "digests"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def digested_files(manifest):
    """The files whose `digests` a manifest holds: every file it names."""
    shards = manifest["shards"]
    labels = [shard["labels"] for shard in shards]
    return [*manifest["index"].values(), *labels, *(s["images"] for s in shards)]


def is_dataset_directory(directory):
    """Whether `directory` holds a `manifest.json` of this format."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(directory):
    """The manifest of `directory`, checked; a `DatasetNotFoundError` or
    `CorruptDatasetError` where it is missing or not of this format."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        what = (
            "does not exist" if not os.path.exists(directory) else f"has no {MANIFEST}"
        )
        raise DatasetNotFoundError(
            f"{directory} {what}: it is not a user-shards dataset. Write one "
            "with kdpemb.datasets.write_user_shards(directory, data)."
        )

    def corrupt(what):
        return CorruptDatasetError(
            f"{path} {what}. Write the dataset again with "
            "kdpemb.datasets.write_user_shards."
        )

    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as error:
        raise corrupt(f"is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise corrupt(f"is not a manifest of format {FORMAT!r} (format {got!r})")
    version = manifest.get("version")
    if version != VERSION:
        known = isinstance(version, int) and not isinstance(version, bool)
        if known and version > VERSION:
            raise CorruptDatasetError(
                f"{path} is of format version {version}, newer than the version "
                f"{VERSION} this kdpemb reads. Upgrade kdpemb, or write the "
                "dataset again with this version."
            )
        if known and version >= 1:
            raise CorruptDatasetError(
                f"{path} is of format version {version}, written by an older "
                f"kdpemb; this one reads version {VERSION}, whose digests of the "
                "index and labels detect a shifted user offset (an image given "
                "to another user). Write the dataset again from its source "
                "data with kdpemb.datasets.write_user_shards."
            )
        raise corrupt(f"has an unknown format version {version!r} (expected {VERSION})")
    ints = (
        "num_images",
        "num_users",
        "num_classes",
        "max_label",
        "max_identities_per_user",
    )
    fields = ("image_shape", "image_dtype", "user_id_kind", "index", "shards")
    for key in (*ints, *fields, "digests"):
        if key not in manifest:
            raise corrupt(f"has no {key!r}")
    for key in ints:
        value = manifest[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise corrupt(f"has {key}={value!r}, not a non-negative int")
    shards, index = manifest["shards"], manifest["index"]
    if (
        manifest["user_id_kind"] not in ID_KINDS.values()
        or not isinstance(index, dict)
        or set(index) != set(INDEX_FILES)
        or not isinstance(shards, list)
        or not shards
        or not all(
            isinstance(s, dict)
            and {"images", "labels", "num_images", "num_users"} <= set(s)
            for s in shards
        )
        or not isinstance(manifest["image_shape"], list)
        or len(manifest["image_shape"]) != 3
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0
            for d in manifest["image_shape"]
        )
    ):
        raise corrupt("has an unreadable index, shard list or image shape")
    if manifest["max_label"] >= manifest["num_classes"]:
        raise corrupt(
            f"has max_label={manifest['max_label']}, not below "
            f"num_classes={manifest['num_classes']}"
        )
    digests = manifest["digests"]
    if not isinstance(digests, dict) or not all(
        isinstance(digests.get(name), str)
        for name in (LAYOUT, *digested_files(manifest))
        if isinstance(name, str)  # Other names are refused when opened.
    ):
        raise corrupt("has no digest of its layout or of some file ('digests')")
    try:
        dtype = np.dtype(manifest["image_dtype"])
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "uif":
        raise corrupt(f"has image_dtype={manifest['image_dtype']!r}, not a number type")
    return manifest

"""Synthetic identities: the embedded default dataset, rendered on demand.

A benchmark in the spirit of DigiFace-1M's synthetic faces: every identity is
a latent code that a fixed random generator renders into a structured
picture, and every image of that identity varies by nuisance, so an embedding
has to learn invariance to learn identity. Nothing is downloaded and no pixel
is stored: pixels are computed from the seed when they are indexed, so a
million identities cost no more memory than ten (apart from the labels).
`kdpemb.datasets.identity_renderer` renders the pixels; this module serves
them as a lazy array, with labels and user ids.

What it is:

- A shared "face-like" template (head ellipse, hair, brows, two eyes and a
  mouth on a background), so identities differ in their parts, not in what
  kind of picture they are.
- Identity-specific parts drawn from the latent: skin tone, head shape,
  hairline and hair colour, eye spacing, size and colour, mouth shape and
  colour, four soft blobs ("marks") with positions, sizes and signed colours,
  and a low-frequency texture of three sinusoids.
- Per-image nuisance: shift (±10% of the image side), scale (0.85-1.15) and
  rotation (±15°), rendered by evaluating the analytic pattern at
  inverse-affine-transformed pixel coordinates (no interpolation); a random
  grey-ish background; a lighting gradient (up to ±15%); contrast (0.8-1.2)
  and brightness (±0.05) changes; with probability 0.25 an occluding
  rectangle of random size, place and colour; and additive pixel noise of
  standard deviation 8/255 (triangular: the sum of two random bytes).

Two domains (`domain=`). "private" (the default) is the model above.
"public" stands for the public photos one pre-trains on before private
fine-tuning, which show other people under other conditions:

- Other identities: the identity stream has another salt, so public
  identity `k` is unrelated to private identity `k` (for any seed and
  `first_identity`), and no public identity is a private one (up to the
  chance of two 64-bit hashes colliding).
- Posed, studio-like nuisance: shift ±5% (not ±10%), scale 0.95-1.25
  (closer up), rotation ±8° (not ±15°); lighter backgrounds (grey
  0.5-0.8, not 0.35-0.65); a stronger lighting gradient (up to ±30%);
  contrast 0.9-1.3; brightness +0.03 to +0.11 (not ±0.05); a warm tint
  (red × 1.08, blue × 0.9 before contrast); occlusion with probability
  0.1 (not 0.25). Pixel noise is the same. Measured over 400 images at
  32×32×3 (seed 0), public images are brighter (mean pixel about 160
  against 122 of 255) and warmer (mean red minus blue about +57 against
  +24).

The template and the identity latent are shared, so features learnt on
public identities carry over, but a model pre-trained on them has not seen
the private identities nor their nuisance.

What it is not: a face dataset. No real person is depicted, the pictures do
not look like photographs, and accuracies, ε-utility curves or tuned
hyper-parameters measured on it show that a pipeline works and how methods
compare, but do not transfer numerically to real faces. As a yardstick, a
nearest-centroid classifier on raw pixels (10 images per identity as
centroids) identifies 42-49% of held-out images among 50 identities at
32×32×3 (chance: 2%; seeds 0-4), and 25-28% in grayscale.

Randomness is counter-based (a vectorised splitmix64 hash of the seed, the
identity, the image's index within its identity and a slot number), so an
image depends only on `(seed, identity, index within identity)`, the image
size and the channels: it is the same bytes whether rendered alone or in any
batch, whatever the chunking, and identity `k` looks the same for any
`num_identities` or `images_per_identity`. Rendering is vectorised NumPy
on one core, in chunks of 256 images (at 32×32) that reuse a per-thread
workspace of about 22 MB: 10,000 images of 32×32×3 take 0.7-1.2 s on a
2-core x86-64 VM (NumPy 2.4; 0.7 s when the machine is idle, more when other
jobs share it), and 0.5-0.7 s in grayscale.
"""

import numbers

import numpy as np

from kdpemb.datasets.identity_renderer import DOMAINS, IdentityRenderer, check_domain
from kdpemb.datasets.user_images import UserImages

__all__ = ["DOMAINS", "SyntheticImages", "synthetic_identities"]

# Pixels per float32 plane (M images, H*W each) while rendering: 1 MB each.
_CHUNK_PIXELS = 1 << 18
_MAX_CHUNK = 1024
_MAX_IDENTITY = 1 << 62


def _check_int(name, value, minimum, fix, maximum=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}; {fix}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(
            f"{name} must be an int in [{minimum}, {maximum}], got {value!r}; {fix}"
            if maximum is not None
            else f"{name} must be an int >= {minimum}, got {value!r}; {fix}"
        )
    return int(value)


def _check_channels(channels):
    if isinstance(channels, bool) or channels not in (1, 3):
        raise ValueError(
            f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}; "
            "pass channels=1 or channels=3."
        )
    return int(channels)


class SyntheticImages:
    """Lazy uint8 array of synthetic identity images, rendered when indexed.

    It behaves like a read-only NumPy array of shape
    `(num_identities * images_per_identity, image_size, image_size,
    channels)` ordered identity-major (identity 0's images first), without
    storing any pixels: `len()`, `.shape`, `.dtype`, `.ndim`, `.size` and
    `.nbytes` need no rendering, and indexing with an int, a slice, an
    integer array (any order, repeats and negative values allowed) or a
    boolean mask renders just those images, in chunks of bounded memory.
    `np.asarray(images)` or `materialize()` renders all of them. Image `i`
    shows identity `first_identity + i // images_per_identity` and depends
    only on the seed, that identity and `i % images_per_identity`, so it is
    the same bytes however it is requested. Usually made by
    `synthetic_identities`, which also builds the labels and user ids.

    Args:
        num_identities: int. Number of identities (classes), at least 1.
        images_per_identity: int. Images rendered per identity, at least 1.
        image_size: int. Height and width in pixels, at least 8. Defaults
            to `32`.
        channels: int. 3 for RGB or 1 for grayscale (the luminance of the
            RGB rendering). Defaults to `3`.
        seed: int. Non-negative seed below 2**64; different seeds give
            unrelated identities. Defaults to `0`.
        first_identity: int. Index of the first identity rendered, so that
            `first_identity=1000` gives identities disjoint from those of
            `first_identity=0, num_identities=1000` under the same seed.
            Defaults to `0`.
        domain: str. "private" (default) or "public": the public domain
            renders other identities (identity `k` of a seed differs in the
            two domains) under other conditions (see the module docstring),
            for pre-training. Defaults to `"private"`.
        chunk_size: int or None. Most images rendered at once; `None`
            picks `2**18 // image_size**2` (256 at 32×32; from 1 to 1024),
            which keeps each float32 temporary near 1 MB. It changes memory
            and speed, never the pixels.
            Defaults to `None`.

    Returns:
        An array-like; indexing returns `np.ndarray`s of dtype uint8.

    Example:

    >>> import numpy as np
    >>> images = SyntheticImages(num_identities=3, images_per_identity=2,
    ...                          image_size=16)
    >>> len(images), images.shape, images.dtype
    (6, (6, 16, 16, 3), dtype('uint8'))
    >>> images[np.array([4, 0, 4])].shape
    (3, 16, 16, 3)
    >>> bool((images[4] == np.asarray(images)[4]).all())
    True
    """

    def __init__(
        self,
        num_identities,
        images_per_identity,
        image_size=32,
        channels=3,
        seed=0,
        first_identity=0,
        chunk_size=None,
        domain="private",
    ):
        self.num_identities = _check_int(
            "num_identities",
            num_identities,
            1,
            "pass the number of distinct identities to render, e.g. 100.",
        )
        self.images_per_identity = _check_int(
            "images_per_identity",
            images_per_identity,
            1,
            "pass how many images to render per identity, e.g. 20.",
        )
        self.image_size = _check_int(
            "image_size",
            image_size,
            8,
            "the face parts need at least 8x8 pixels; pass e.g. image_size=32.",
        )
        self.channels = _check_channels(channels)
        self.domain = check_domain(domain)
        self.seed = _check_int(
            "seed", seed, 0, "pass a non-negative int such as 0.", (1 << 64) - 1
        )
        self.first_identity = _check_int(
            "first_identity",
            first_identity,
            0,
            "pass the non-negative index of the first identity, e.g. 0.",
            _MAX_IDENTITY - self.num_identities,
        )
        values = self.image_size * self.image_size * self.channels
        if chunk_size is None:
            chunk_size = max(1, min(_MAX_CHUNK, _CHUNK_PIXELS // self.image_size**2))
        self.chunk_size = _check_int(
            "chunk_size", chunk_size, 1, "pass e.g. chunk_size=256, or None."
        )
        self._length = self.num_identities * self.images_per_identity
        self.shape = (self._length, self.image_size, self.image_size, self.channels)
        self.dtype = np.dtype(np.uint8)
        self.ndim = 4
        self.size = self._length * values
        self.nbytes = self.size
        self._renderer = IdentityRenderer(
            self.image_size, self.channels, self.seed, self.domain
        )
        self._domain = self._renderer.parameters

    def __len__(self):
        return self._length

    def __repr__(self):
        return (
            f"SyntheticImages(num_identities={self.num_identities}, "
            f"images_per_identity={self.images_per_identity}, "
            f"image_size={self.image_size}, channels={self.channels}, "
            f"seed={self.seed}, first_identity={self.first_identity}, "
            f"domain={self.domain!r})"
        )

    def __getitem__(self, key):
        if isinstance(key, tuple):
            if not key:
                return self.materialize()
            rest = key[1:]
            if any(
                not isinstance(k, (slice, type(Ellipsis), numbers.Integral))
                and k is not None
                for k in rest
            ):
                raise IndexError(
                    "SyntheticImages supports arrays only as the first index; "
                    "index the images first, then the pixels: images[idx][...]."
                )
            first = self[key[0]]
            if isinstance(key[0], numbers.Integral) and not isinstance(key[0], bool):
                return first[rest]
            return first[(slice(None), *rest)]
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            index = int(key)
            if not -self._length <= index < self._length:
                raise IndexError(
                    f"index {index} is out of bounds for SyntheticImages with "
                    f"{self._length} images."
                )
            return self._render(np.array([index % self._length], np.int64))[0]
        if isinstance(key, slice):
            return self._render(np.arange(*key.indices(self._length), dtype=np.int64))
        return self._render(self._check_index_array(key))

    def _check_index_array(self, key):
        index = np.asarray(key)
        if index.dtype == bool:
            if index.shape != (self._length,):
                raise IndexError(
                    f"a boolean mask must have shape ({self._length},), one "
                    f"entry per image, got {index.shape}."
                )
            return np.flatnonzero(index).astype(np.int64)
        if index.size == 0:
            return np.zeros(index.shape, np.int64)
        if not np.issubdtype(index.dtype, np.integer):
            raise IndexError(
                "SyntheticImages can be indexed with an int, a slice, an "
                f"integer array or a boolean mask, got dtype {index.dtype}."
            )
        low, high = index.min(), index.max()
        if low < -self._length or high >= self._length:
            bad = low if low < -self._length else high
            raise IndexError(
                f"index {int(bad)} is out of bounds for SyntheticImages with "
                f"{self._length} images."
            )
        index = index.astype(np.int64)
        return np.where(index < 0, index + self._length, index)

    def __array__(self, dtype=None, copy=None):
        if copy is False:
            raise ValueError(
                "SyntheticImages renders its pixels on demand, so converting "
                "it to an array always makes a new array; use copy=None."
            )
        array = self.materialize()
        return array if dtype is None else array.astype(dtype, copy=False)

    def materialize(self):
        """Render every image into one NumPy array.

        The same as `np.asarray(images)`: a new uint8 array of shape
        `images.shape` (`images.nbytes` bytes), filled chunk by chunk.

        Returns:
            `np.ndarray` of uint8, shape `(N, H, W, C)`.

        Example:

        >>> images = SyntheticImages(2, 3, image_size=8, channels=1)
        >>> images.materialize().shape
        (6, 8, 8, 1)
        """
        return self._render(np.arange(self._length, dtype=np.int64))

    def _render(self, index):
        """Images at the given in-range non-negative int64 indices (any shape)."""
        flat = index.reshape(-1)
        identity = flat // self.images_per_identity + self.first_identity
        within = flat % self.images_per_identity
        out = self._renderer.render(identity, within, self.chunk_size)
        return out.reshape(*index.shape, *self.shape[1:])

    def _identity_keys(self, identity):
        """uint64 key of each identity (int64 array): all its latent code."""
        return self._renderer.identity_keys(identity)


def synthetic_identities(
    num_identities,
    images_per_identity,
    image_size=32,
    channels=3,
    seed=0,
    identities_per_user=1,
    first_identity=0,
    domain="private",
):
    """Synthetic identity images with labels and user ids, no download.

    Renders `num_identities` identities with `images_per_identity` images
    each (see the module docstring for the image model). The images are a
    lazy `SyntheticImages` array, ordered identity-major, so construction is
    instant even for millions of identities; only the labels and user ids
    (two int64 arrays of `N = num_identities * images_per_identity` entries)
    are stored. Label `k` is the `k`-th identity rendered (identity
    `first_identity + k` of the seed). Each user holds `identities_per_user`
    consecutive identities: `user_id = label // identities_per_user` (the
    last user holds fewer when `num_identities` is not a multiple), so with
    the default of 1 every identity is its own user, as in user-level DP for
    face recognition where a person contributes all photos of themselves.

    Args:
        num_identities: int. Number of identities (classes), at least 1.
        images_per_identity: int. Images per identity, at least 1.
        image_size: int. Height and width in pixels, at least 8. Defaults
            to `32`.
        channels: int. 3 for RGB or 1 for grayscale. Defaults to `3`.
        seed: int. Non-negative seed below 2**64; the same seed gives the
            same bytes. Defaults to `0`.
        identities_per_user: int. Consecutive identities grouped into one
            user, at least 1. Defaults to `1`.
        first_identity: int. Index of the first identity rendered; use it
            to draw disjoint identity sets from one seed (e.g. public
            pre-training identities and private ones). Defaults to `0`.
        domain: str. "private" (default), or "public" for pre-training
            data that differs from the private data the way public data
            does: other identities (a separate identity stream, so public
            identity `k` is not private identity `k`) under other
            conditions (posed, brighter, warmer, rarely occluded; see the
            module docstring).

    Returns:
        `UserImages` with `images` a `SyntheticImages` of uint8, shape
        `(N, image_size, image_size, channels)`, `labels` int64 `(N,)` in
        `0..num_identities-1` and `user_ids` int64 `(N,)`.

    Raises:
        ValueError: if an argument is not an int in its range,
            `channels` is not 1 or 3, or `domain` is unknown.

    Example:

    >>> data = synthetic_identities(num_identities=4, images_per_identity=3,
    ...                             image_size=16, identities_per_user=2)
    >>> images, labels, user_ids = data
    >>> images.shape, images.dtype
    ((12, 16, 16, 3), dtype('uint8'))
    >>> labels.tolist()
    [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    >>> user_ids.tolist()
    [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    >>> data.num_classes, data.num_users
    (4, 2)
    >>> images[[0, 11]].shape
    (2, 16, 16, 3)
    """
    identities_per_user = _check_int(
        "identities_per_user",
        identities_per_user,
        1,
        "pass how many consecutive identities one user holds, e.g. 1.",
    )
    images = SyntheticImages(
        num_identities,
        images_per_identity,
        image_size=image_size,
        channels=channels,
        seed=seed,
        first_identity=first_identity,
        domain=domain,
    )
    labels = np.repeat(
        np.arange(images.num_identities, dtype=np.int64), images.images_per_identity
    )
    return UserImages(images, labels, labels // identities_per_user)

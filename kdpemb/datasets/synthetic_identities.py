"""Synthetic identities: the embedded default dataset, rendered on demand.

A benchmark in the spirit of DigiFace-1M's synthetic faces: every identity is
a latent code that a fixed random generator renders into a structured
picture, and every image of that identity varies by nuisance, so an embedding
has to learn invariance to learn identity. Nothing is downloaded and no pixel
is stored: pixels are computed from the seed when they are indexed, so a
million identities cost no more memory than ten (apart from the labels).

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
import threading
from typing import NamedTuple

import numpy as np

from kdpemb.datasets.user_images import UserImages

__all__ = ["DOMAINS", "SyntheticImages", "synthetic_identities"]

# splitmix64 constants (Steele, Lea and Flood, 2014).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
# Salts that separate the hash streams of seeds, identities, images and noise.
_SALT_SEED = np.uint64(0x243F6A8885A308D3)
_SALT_IMAGE = np.uint64(0xA4093822299F31D0)
_SALT_NOISE = np.uint64(0x082EFA98EC4E6C89)

_NUM_BLOBS = 4
_NUM_WAVES = 3
# Uniforms per identity: 23 for the template, 6 per blob, 4 per wave, 3 tint.
_IDENTITY_SLOTS = 23 + 6 * _NUM_BLOBS + 4 * _NUM_WAVES + 3
_IMAGE_SLOTS = 20

_NOISE_STD = 8.0 / 255.0
# Scale of the sum of two random bytes (std 256 / sqrt(6)) to std 8 in 0..255.
_NOISE_SCALE = np.float32(255.0 * _NOISE_STD * np.sqrt(6.0) / 256.0)


class _Domain(NamedTuple):
    """The identity stream and nuisance distribution of a domain."""

    identity_salt: np.uint64  # Separates the domains' identity streams.
    shift: float  # Half-range of the shift, in [-1, 1] image coordinates.
    scale: tuple  # Range of the scale.
    rotation: float  # Half-range of the rotation, radians.
    background: tuple  # Range of the background's grey shade.
    occlusion: float  # Probability of an occluding rectangle.
    lighting: float  # Largest strength of the lighting gradient.
    contrast: tuple  # Range of the contrast.
    brightness: tuple  # Range of the brightness offset (fraction of 255).
    tint: tuple | None  # Per-channel (RGB) gain of the scene, or None.


_DOMAINS = {
    "private": _Domain(
        identity_salt=np.uint64(0x13198A2E03707344),
        shift=0.2,  # ±10% of the side.
        scale=(0.85, 1.15),
        rotation=float(np.deg2rad(15.0)),
        background=(0.35, 0.65),
        occlusion=0.25,
        lighting=0.15,
        contrast=(0.8, 1.2),
        brightness=(-0.05, 0.05),
        tint=None,
    ),
    # Studio-like public photos: posed (less rotation and shift, closer up),
    # lighter backgrounds, brighter and warmer, stronger side lighting,
    # rarely occluded.
    "public": _Domain(
        identity_salt=np.uint64(0xBE5466CF34E90C6C),
        shift=0.1,  # ±5% of the side.
        scale=(0.95, 1.25),
        rotation=float(np.deg2rad(8.0)),
        background=(0.5, 0.8),
        occlusion=0.1,
        lighting=0.3,
        contrast=(0.9, 1.3),
        brightness=(0.03, 0.11),
        tint=(1.08, 1.0, 0.9),
    ),
}
DOMAINS = tuple(_DOMAINS)
"""The image domains of `synthetic_identities(domain=...)`: "private" (the
default) and "public", which renders other identities differently, for
pretraining or clip norms that must not see the private data.

Example:

>>> from kdpemb.datasets import synthetic_identities
>>> from kdpemb.datasets.synthetic_identities import DOMAINS
>>> DOMAINS
('private', 'public')
>>> synthetic_identities(2, 1, image_size=8, domain="public").images.shape
(2, 8, 8, 3)
"""
_LUMA = (0.299, 0.587, 0.114)
# Pixels per float32 plane (M images, H*W each) while rendering: 1 MB each.
_CHUNK_PIXELS = 1 << 18
_MAX_CHUNK = 1024
_NUM_PLANES = 17  # Float32 planes a chunk needs at once (see _render_chunk).
_MAX_IDENTITY = 1 << 62


def _mix_in_place(z, scratch):
    """splitmix64's finaliser on a uint64 array, in place (uses `scratch`)."""
    z ^= np.right_shift(z, np.uint64(30), out=scratch)
    z *= _MUL1
    z ^= np.right_shift(z, np.uint64(27), out=scratch)
    z *= _MUL2
    z ^= np.right_shift(z, np.uint64(31), out=scratch)
    return z


def _mix(z):
    """splitmix64's finaliser on a uint64 array (returns a new array)."""
    return _mix_in_place(z.copy(), np.empty_like(z))


def _uniforms(keys, count):
    """`(M, count)` float64 uniforms in [0, 1) from `(M,)` uint64 keys."""
    slots = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
    bits = _mix(keys[:, None] + slots[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _column(values):
    """`(M,)` values (or a scalar) as a float32 column `(M, 1)`."""
    return np.asarray(values, np.float32).reshape(-1, 1)


def _soft_inside(q):
    """Opacity 1 inside the ellipse `q < 1` (in place), 0 outside, soft edge."""
    q *= -6.0
    q += 6.0
    return np.clip(q, 0.0, 1.0, out=q)


def _bump(q):
    """Opacity `max(0, 1 - q)**2` (in place): like a Gaussian, without exp."""
    np.subtract(1.0, q, out=q)
    np.clip(q, 0.0, 1.0, out=q)
    q *= q
    return q


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


def _check_domain(domain):
    if domain not in _DOMAINS:
        raise ValueError(
            f"domain must be one of {DOMAINS}, got {domain!r}; pass "
            "domain='private' for the data to protect or domain='public' for "
            "pre-training data from other identities and conditions."
        )
    return domain


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
        self.domain = _check_domain(domain)
        self._domain = _DOMAINS[self.domain]
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
        self._seed_key = _mix(np.array([self.seed], np.uint64) ^ _SALT_SEED)
        # Pixel-centre coordinates in [-1, 1], x to the right and y downwards.
        side = self.image_size
        centres = ((np.arange(side) + 0.5) * (2.0 / side) - 1.0).astype(np.float32)
        self._x = np.tile(centres, side)
        self._y = np.repeat(centres, side)
        self._pixel_column = np.tile(np.arange(side, dtype=np.float32), side)
        self._pixel_row = np.repeat(np.arange(side, dtype=np.float32), side)

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
        out = np.empty((flat.size, *self.shape[1:]), np.uint8)
        if flat.size:
            capacity = min(self.chunk_size, flat.size)
            workspace = _workspace(capacity, self.image_size**2, self.channels)
            for start in range(0, flat.size, self.chunk_size):
                stop = min(start + self.chunk_size, flat.size)
                self._render_chunk(flat[start:stop], out[start:stop], workspace)
        return out.reshape(*index.shape, *self.shape[1:])

    def _colour(self, red, green, blue):
        """One float32 column `(M, 1)` per channel, from `(M,)` RGB values."""
        if self.channels == 1:
            return [_column(_LUMA[0] * red + _LUMA[1] * green + _LUMA[2] * blue)]
        return [_column(red), _column(green), _column(blue)]

    def _identity_keys(self, identity):
        """uint64 key of each identity (int64 array): all its latent code."""
        salt = self._domain.identity_salt
        return _mix(self._seed_key ^ _mix(identity.astype(np.uint64) * _GOLDEN + salt))

    def _render_chunk(self, index, out, workspace):
        """Renders `(M,)` image indices into `out`, uint8 `(M, H, W, C)`.

        Planes are float32 `(M, H*W)` arrays, one image per row, taken from
        the workspace; every operation is row-wise, so a row depends only on
        its own index.
        """
        count = index.size
        domain = self._domain
        identity = index // self.images_per_identity + self.first_identity
        within = index % self.images_per_identity
        identity_key = self._identity_keys(identity)
        image_key = _mix(
            identity_key ^ _mix(within.astype(np.uint64) * _GOLDEN + _SALT_IMAGE)
        )
        latent = iter(_uniforms(identity_key, _IDENTITY_SLOTS).T)
        nuisance = iter(_uniforms(image_key, _IMAGE_SLOTS).T)
        planes = iter(workspace.planes[:, :count])
        tmp, tmp2 = next(planes), next(planes)

        def uniform(source, low, high):
            return low + (high - low) * next(source)

        def affine(a, b, c, result):
            """`result = a * x + b * y + c` for per-image columns a, b, c."""
            np.multiply(_column(a), self._x, out=result)
            np.multiply(_column(b), self._y, out=tmp2)
            result += tmp2
            result += _column(c)
            return result

        def quadratic(u, v, u_centre, v_centre, u_radius, v_radius):
            """((u - u_centre) / u_radius)**2 + ((v - v_centre) / v_radius)**2."""
            result = next(planes)
            np.subtract(u, _column(u_centre), out=result)
            result *= _column(1.0 / u_radius)
            result *= result
            second = np.subtract(v, _column(v_centre), out=tmp)
            second *= _column(1.0 / v_radius)
            second *= second
            result += second
            return result

        # Inverse affine map from output pixels to pattern coordinates:
        # p = R(-angle) (x - shift) / scale.
        shift_x = uniform(nuisance, -domain.shift, domain.shift)
        shift_y = uniform(nuisance, -domain.shift, domain.shift)
        scale = uniform(nuisance, *domain.scale)
        angle = uniform(nuisance, -domain.rotation, domain.rotation)
        cos, sin = np.cos(angle) / scale, np.sin(angle) / scale
        px = affine(cos, sin, -(cos * shift_x + sin * shift_y), next(planes))
        py = affine(-sin, cos, sin * shift_x - cos * shift_y, next(planes))

        # The shared template, with geometry and colours from the latent code.
        half_width = uniform(latent, 0.56, 0.7)
        half_height = uniform(latent, 0.72, 0.86)
        lightness = uniform(latent, 0.4, 1.1)
        skin = self._colour(
            lightness * uniform(latent, 0.75, 0.95),
            lightness * uniform(latent, 0.55, 0.72),
            lightness * uniform(latent, 0.42, 0.6),
        )
        hairline = _column(uniform(latent, -0.55, -0.15))
        hair_shade = uniform(latent, 0.05, 0.8)
        hair = self._colour(
            hair_shade * uniform(latent, 0.8, 1.2),
            hair_shade * uniform(latent, 0.6, 0.9),
            hair_shade * uniform(latent, 0.3, 0.7),
        )
        eye_x = _column(uniform(latent, 0.18, 0.32))
        eye_y = uniform(latent, -0.22, -0.05)
        eye_size = uniform(latent, 0.11, 0.18)
        eye = self._colour(
            uniform(latent, 0.05, 0.35),
            uniform(latent, 0.05, 0.35),
            uniform(latent, 0.05, 0.45),
        )
        mouth_y = uniform(latent, 0.3, 0.48)
        mouth_width = uniform(latent, 0.15, 0.3)
        mouth_height = uniform(latent, 0.05, 0.09)
        mouth = self._colour(
            uniform(latent, 0.45, 0.8),
            uniform(latent, 0.1, 0.35),
            uniform(latent, 0.1, 0.35),
        )
        head = _soft_inside(quadratic(px, py, 0.0, 0.05, half_width, half_height))
        hair_alpha = _soft_inside(
            quadratic(px, py, 0.0, -0.02, half_width * 1.12, half_height * 1.1)
        )
        np.subtract(hairline, py, out=tmp)  # Hair only above the hairline.
        tmp *= 10.0
        hair_alpha *= np.clip(tmp, 0.0, 1.0, out=tmp)
        side = np.abs(px, out=next(planes))  # Both eyes (and brows): x -> |x|.
        side -= eye_x
        eye_alpha = _bump(quadratic(side, py, 0.0, eye_y, eye_size, eye_size))
        brow_alpha = _bump(
            quadratic(
                side, py, 0.0, eye_y - 1.2 * eye_size, 1.6 * eye_size, 0.45 * eye_size
            )
        )
        brow_alpha *= 0.85
        mouth_alpha = _bump(quadratic(px, py, 0.0, mouth_y, mouth_width, mouth_height))
        mouth_alpha *= 0.8

        # Identity-specific marks (blobs) and a low-frequency texture.
        fields = []
        for _ in range(_NUM_BLOBS):
            centre_x = uniform(latent, -0.45, 0.45)
            centre_y = uniform(latent, -0.45, 0.6)
            radius = uniform(latent, 0.17, 0.55)
            colour = self._colour(
                uniform(latent, -0.3, 0.3),
                uniform(latent, -0.3, 0.3),
                uniform(latent, -0.3, 0.3),
            )
            blob = _bump(quadratic(px, py, centre_x, centre_y, radius, radius))
            fields.append((blob, colour))
        texture = next(planes)
        texture[...] = 0.0
        for _ in range(_NUM_WAVES):
            frequency = uniform(latent, 3.0, 9.0)
            direction = uniform(latent, 0.0, np.pi)
            phase = uniform(latent, 0.0, 2.0 * np.pi)
            amplitude = _column(uniform(latent, 0.3, 1.0))
            wave = affine(
                frequency * np.cos(direction), frequency * np.sin(direction), phase, tmp
            )
            np.sin(wave, out=wave)
            wave *= amplitude
            texture += wave
        tint = self._colour(
            uniform(latent, -0.05, 0.05),
            uniform(latent, -0.05, 0.05),
            uniform(latent, -0.05, 0.05),
        )
        fields.append((texture, tint))

        # Per-image background and occluding rectangle (in output pixels).
        shade = uniform(nuisance, *domain.background)
        background = self._colour(
            shade + uniform(nuisance, -0.06, 0.06),
            shade + uniform(nuisance, -0.06, 0.06),
            shade + uniform(nuisance, -0.06, 0.06),
        )
        side_pixels = float(self.image_size)
        occluded = next(nuisance) < domain.occlusion
        width = np.floor(uniform(nuisance, 0.2, 0.45) * side_pixels)
        height = np.floor(uniform(nuisance, 0.2, 0.45) * side_pixels)
        left = np.floor(next(nuisance) * (side_pixels - width + 1))
        top = np.floor(next(nuisance) * (side_pixels - height + 1))
        fill = self._colour(next(nuisance), next(nuisance), next(nuisance))
        inside = None
        if occluded.any():
            inside, test = workspace.masks[:, :count]
            np.greater_equal(self._pixel_column, _column(left), out=inside)
            inside &= np.less(self._pixel_column, _column(left + width), out=test)
            inside &= np.greater_equal(self._pixel_row, _column(top), out=test)
            inside &= np.less(self._pixel_row, _column(top + height), out=test)
            inside &= occluded[:, None]

        # Lighting gradient, contrast and brightness as one gain and offset
        # (in 0..255); the offset also centres the noise and adds the 0.5
        # that makes the final truncation round to nearest.
        light = uniform(nuisance, 0.0, 2.0 * np.pi)
        strength = uniform(nuisance, 0.0, domain.lighting)
        contrast = uniform(nuisance, *domain.contrast)
        brightness = uniform(nuisance, *domain.brightness)
        gain = affine(
            255.0 * contrast * strength * np.cos(light),
            255.0 * contrast * strength * np.sin(light),
            255.0 * contrast,
            next(planes),
        )
        noise = _noise_bytes(image_key, workspace, count)
        offset = _column(
            255.0 * (0.5 - 0.5 * contrast + brightness) + 0.5 - 255.0 * _NOISE_SCALE
        )

        layers = (
            (hair_alpha, hair),
            (brow_alpha, [h * 0.7 for h in hair]),
            (eye_alpha, eye),
            (mouth_alpha, mouth),
        )
        tint = None if domain.tint is None else self._colour(*domain.tint)
        plane = next(planes)
        pixels = out.reshape(count, -1, self.channels)
        size = plane.shape[1]
        for c in range(self.channels):
            plane[...] = skin[c]
            for field, colour in fields:
                np.multiply(field, colour[c], out=tmp)
                plane += tmp
            plane -= background[c]  # The head over the background.
            plane *= head
            plane += background[c]
            for alpha, colour in layers:
                np.subtract(colour[c], plane, out=tmp)
                tmp *= alpha
                plane += tmp
            if inside is not None:
                np.copyto(plane, fill[c], where=inside)
            if tint is not None:
                plane *= tint[c]
            plane *= gain
            np.multiply(noise[:, c * size : (c + 1) * size], _NOISE_SCALE, out=tmp)
            plane += tmp
            plane += offset
            np.clip(plane, 0.0, 255.0, out=plane)
            pixels[:, :, c] = plane  # Truncation; the offset rounds.


class _Workspace:
    """Buffers for rendering up to `capacity` images of `pixels` pixels."""

    def __init__(self, capacity, pixels, channels):
        self.shape = (pixels, channels)
        self.capacity = capacity
        self.planes = np.empty((_NUM_PLANES, capacity, pixels), np.float32)
        self.masks = np.empty((2, capacity, pixels), bool)
        words = (channels * pixels + 3) // 4
        self.bits = np.empty((2, capacity, words), np.uint64)
        self.counters = np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN


# One workspace per thread, reused between calls: freshly allocated
# temporaries cost a page fault per 4 kB on every chunk, which doubled the
# rendering time on a 2-core VM. It holds about 22 MB at 32x32 pixels.
_THREAD_LOCAL = threading.local()


def _workspace(capacity, pixels, channels):
    workspace = getattr(_THREAD_LOCAL, "workspace", None)
    if (
        workspace is None
        or workspace.shape != (pixels, channels)
        or workspace.capacity < capacity
    ):
        _THREAD_LOCAL.workspace = None  # Free the old buffers first.
        workspace = _Workspace(capacity, pixels, channels)
        _THREAD_LOCAL.workspace = workspace
    return workspace


def _noise_bytes(image_key, workspace, count):
    """Noise values `(M, >= C*H*W)` uint16 for the images with these keys.

    Each value is the sum of two random bytes (a triangular distribution on
    0..510, close to a Gaussian); one 64-bit hash of (image key, counter)
    makes four values.
    """
    bits, scratch = workspace.bits[:, :count]
    np.add(_mix(image_key ^ _SALT_NOISE)[:, None], workspace.counters, out=bits)
    _mix_in_place(bits, scratch)
    pairs = bits.astype("<u8", copy=False).view("<u2")
    total = scratch.view("<u2")
    np.bitwise_and(pairs, np.uint16(0xFF), out=total)
    pairs >>= np.uint16(8)
    total += pairs
    return total


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

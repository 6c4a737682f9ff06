"""The pixels of `synthetic_identities`: identities rendered from a seed.

`IdentityRenderer` draws an identity's latent code and an image's
nuisance from counter-based hashes and renders the analytic face-like
pattern; `DOMAINS` names the nuisance distributions. The image model is
described in `kdpemb.datasets.synthetic_identities`, which serves these
images as a lazy array.

Example:

>>> import numpy as np
>>> renderer = IdentityRenderer(image_size=8, channels=3, seed=0, domain="public")
>>> renderer.render(np.array([0]), np.array([0]), chunk_size=256).shape
(1, 8, 8, 3)
"""

import threading
from typing import NamedTuple

import numpy as np

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
_NUM_PLANES = 17  # Float32 planes a chunk needs at once (see _render_chunk).


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


def check_domain(domain):
    """`domain` if it is one of `DOMAINS`, else a ValueError naming them."""
    if domain not in _DOMAINS:
        raise ValueError(
            f"domain must be one of {DOMAINS}, got {domain!r}; pass "
            "domain='private' for the data to protect or domain='public' for "
            "pre-training data from other identities and conditions."
        )
    return domain


class IdentityRenderer:
    """Renders the images of identities of one seed, size, channels and domain.

    An image is a function of `(identity, index within the identity)` alone
    (see `kdpemb.datasets.synthetic_identities` for the image model), so
    it is the same bytes however it is requested.

    Args:
        image_size: int. Height and width in pixels (at least 8).
        channels: int. 3 (RGB) or 1 (the luminance of the RGB rendering).
        seed: int in [0, 2**64).
        domain: str. One of `DOMAINS`.

    Example:

    >>> import numpy as np
    >>> renderer = IdentityRenderer(image_size=8, channels=1, seed=0, domain="private")
    >>> images = renderer.render(np.array([5, 5]), np.array([0, 1]), chunk_size=1)
    >>> images.shape, images.dtype, bool((images[0] != images[1]).any())
    ((2, 8, 8, 1), dtype('uint8'), True)
    """

    def __init__(self, image_size, channels, seed, domain):
        self.image_size, self.channels = image_size, channels
        self.parameters = _DOMAINS[check_domain(domain)]
        self._seed_key = _mix(np.array([seed], np.uint64) ^ _SALT_SEED)
        # Pixel-centre coordinates in [-1, 1], x to the right and y downwards.
        side = image_size
        centres = ((np.arange(side) + 0.5) * (2.0 / side) - 1.0).astype(np.float32)
        self._x = np.tile(centres, side)
        self._y = np.repeat(centres, side)
        self._pixel_column = np.tile(np.arange(side, dtype=np.float32), side)
        self._pixel_row = np.repeat(np.arange(side, dtype=np.float32), side)

    def render(self, identity, within, chunk_size):
        """uint8 images `(M, H, W, C)` of `(M,)` int64 identities and indices
        within them, rendered `chunk_size` at a time."""
        count = identity.size
        out = np.empty(
            (count, self.image_size, self.image_size, self.channels), np.uint8
        )
        if count:
            capacity = min(chunk_size, count)
            workspace = _workspace(capacity, self.image_size**2, self.channels)
            for start in range(0, count, chunk_size):
                stop = min(start + chunk_size, count)
                self._render_chunk(
                    identity[start:stop], within[start:stop], out[start:stop], workspace
                )
        return out

    def _colour(self, red, green, blue):
        """One float32 column `(M, 1)` per channel, from `(M,)` RGB values."""
        if self.channels == 1:
            return [_column(_LUMA[0] * red + _LUMA[1] * green + _LUMA[2] * blue)]
        return [_column(red), _column(green), _column(blue)]

    def identity_keys(self, identity):
        """uint64 key of each identity (int64 array): all its latent code."""
        salt = self.parameters.identity_salt
        return _mix(self._seed_key ^ _mix(identity.astype(np.uint64) * _GOLDEN + salt))

    def _render_chunk(self, identity, within, out, workspace):
        """Renders `(M,)` identities and indices within them into `out`, uint8
        `(M, H, W, C)`.

        Planes are float32 `(M, H*W)` arrays, one image per row, taken from
        the workspace; every operation is row-wise, so a row depends only on
        its own index.
        """
        count = identity.size
        domain = self.parameters
        identity_key = self.identity_keys(identity)
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

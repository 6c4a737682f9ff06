"""Gaussian noise for releases computed on the host, in float64 NumPy.

The closed-form last-layer methods compute their statistics (Gram
matrices, class sums, logistic gradients and Hessians) in float64 NumPy
and release each with Gaussian noise. The noise scale always comes from
the statistic's `GaussianRelease` (`noise_std`, built from a noise
multiplier and a sensitivity by `GaussianRelease.from_noise_multiplier`),
never from a number configured apart from it.

Every call draws fresh noise from `rng`, one independent draw per
coordinate (per matrix of a stack, per class) and per call. Pass a
`numpy.random.Generator` seeded from OS entropy for a release.

This module does not import Keras.
"""

import numpy as np

from kdpemb.privacy.gaussian_release import GaussianRelease


def _checked(release, rng):
    if not isinstance(release, GaussianRelease):
        raise TypeError(
            "The noise scale comes from the statistic's GaussianRelease (e.g. "
            "GaussianRelease.from_noise_multiplier(z, sensitivity, name)), got "
            f"{type(release).__name__}."
        )
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            "rng must be a numpy.random.Generator (a fixed integer seed would "
            f"repeat the same noise), got {type(rng).__name__}."
        )
    return float(release.noise_std)


def gaussian_noise(release, shape, rng):
    """N(0, noise_std²) per coordinate of a statistic of `shape` (float64).

    Args:
        release: `GaussianRelease` of the statistic.
        shape: tuple. The statistic's shape.
        rng: `numpy.random.Generator`. Advanced by every draw.

    Returns:
        float64 array of `shape` (zeros when `noise_std` is 0).

    Example:

    >>> release = GaussianRelease.from_noise_multiplier(2.0, 0.5, "sums")
    >>> noise = gaussian_noise(release, (3, 2), np.random.default_rng(0))
    >>> noise.shape, noise.dtype.name
    ((3, 2), 'float64')
    """
    stddev = _checked(release, rng)
    if stddev == 0.0:
        return np.zeros(shape)
    return rng.normal(0.0, stddev, shape)


def symmetric_noise(release, size, rng, count=None):
    """N(0, noise_std²) on the upper triangle (diagonal included), mirrored.

    A symmetric statistic such as `XᵀX` is released through its upper
    triangle, whose norm is at most that of the whole matrix, so the
    matrix's sensitivity carries over.

    Args:
        release: `GaussianRelease` of the matrix (or of the whole stack).
        size: int. The matrix is `size × size`.
        rng: `numpy.random.Generator`. Advanced by every draw.
        count: int or None. Stack that many independent matrices
            (`[count, size, size]`).

    Example:

    >>> release = GaussianRelease.from_noise_multiplier(1.0, 1.0, "gram")
    >>> noise = symmetric_noise(release, 3, np.random.default_rng(0), count=2)
    >>> noise.shape, bool((noise == noise.swapaxes(1, 2)).all())
    ((2, 3, 3), True)
    """
    shape = (size, size) if count is None else (count, size, size)
    upper = np.triu(gaussian_noise(release, shape, rng))
    return upper + np.swapaxes(np.triu(upper, 1), -1, -2)

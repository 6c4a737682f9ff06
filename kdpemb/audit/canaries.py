"""Canaries for white-box audits: contributions that point one fixed way.

A gradient-direction canary is a contribution (a client update or an
example's gradient) along a fixed unit direction; a white-box auditor, who
sees the released noisy sum, scores a release by its projection on that
direction. Other contributions are drawn orthogonal to it, so that only
the canary and the noise move the score.

Example:

>>> import numpy as np
>>> canary = direction_canary(4, norm=2.0, seed=0)
>>> round(float(np.linalg.norm(canary.vector)), 6)
2.0
>>> others = canary.orthogonal_contributions(3, seed=1)
>>> bool(np.allclose(canary.score(others), 0.0))
True
"""

import dataclasses

import numpy as np

from kdpemb import _validation as validation

__all__ = ["DirectionCanary", "direction_canary"]


@dataclasses.dataclass(frozen=True)
class DirectionCanary:
    """A contribution `norm · direction` and its membership score.

    Attributes:
        direction: float64 array `[dim]` of L2 norm 1.
        norm: float. The canary's L2 norm (before any clipping).

    Example:

    >>> import numpy as np
    >>> from kdpemb import audit
    >>> canary = audit.direction_canary(4, norm=10.0, seed=0)
    >>> isinstance(canary, audit.DirectionCanary), canary.norm
    (True, 10.0)
    >>> round(float(np.linalg.norm(canary.direction)), 6)
    1.0
    """

    direction: np.ndarray
    norm: float

    @property
    def vector(self):
        """The canary contribution, `norm · direction`."""
        return self.norm * self.direction

    def score(self, releases):
        """Projections of releases (`[..., dim]`) on the canary direction."""
        return np.asarray(releases, np.float64) @ self.direction

    def orthogonal_contributions(self, count, scale=1.0, seed=None):
        """`count` random contributions `[count, dim]` orthogonal to the canary."""
        rng = np.random.default_rng(seed)
        rows = scale * rng.normal(size=(count, self.direction.size))
        return rows - np.outer(rows @ self.direction, self.direction)


def direction_canary(dim, norm, seed=None):
    """A `DirectionCanary` along a uniformly random unit direction of `dim`.

    Args:
        dim: int >= 1. Size of one contribution.
        norm: float > 0. The canary's L2 norm; above the clip norm it
            is clipped to it, and without clipping it moves the sum by
            `norm` (what an audit of "clipping removed" detects).
        seed: int or None. The direction's seed.

    Example:

    >>> import numpy as np
    >>> from kdpemb import audit
    >>> canary = audit.direction_canary(4, norm=10.0, seed=0)
    >>> canary.direction.shape, round(float(np.linalg.norm(canary.vector)), 6)
    ((4,), 10.0)
    """
    dim = validation.check_positive_int(dim, "dim")
    norm = validation.check_positive(norm, "norm")
    direction = np.random.default_rng(seed).normal(size=dim)
    return DirectionCanary(direction / np.linalg.norm(direction), norm)

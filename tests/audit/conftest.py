"""Broken variants of kdpemb's mechanisms, for audits that must catch them.

Each fixture patches the library function that every model's traced step
calls, so build the model (or run the audit) after requesting it.
"""

import keras
import pytest

from kdpemb.privacy import gaussian_sum, host_noise


@pytest.fixture
def noise_divided_by_10(monkeypatch):
    """The in-graph Gaussian noise of DP-SGD steps and independent-noise
    FedEmb rounds is a tenth (tree noise, not audited, draws elsewhere)."""
    real = gaussian_sum.gaussian_noise

    def weak(clipped_sum, noise_multiplier, seed_generator):
        return [n / 10 for n in real(clipped_sum, noise_multiplier, seed_generator)]

    monkeypatch.setattr(gaussian_sum, "gaussian_noise", weak)


@pytest.fixture
def clipping_removed(monkeypatch):
    """Every clip factor is 1 (0 stays 0): `clip_factors` is where all of
    kdpemb's clipping (clip_and_sum, ghost clipping, the DP-SGD head, FedEmb
    rounds) turns norms into factors."""
    real = gaussian_sum.clip_factors

    def unclipped(norms, clip_norm, mask=None):
        factors, finite = real(norms, clip_norm, mask)
        return keras.ops.cast(keras.ops.where(factors > 0, 1.0, 0.0), "float32"), finite

    monkeypatch.setattr(gaussian_sum, "clip_factors", unclipped)


@pytest.fixture
def host_noise_divided_by_10(monkeypatch):
    """The host-side noise of the closed-form last-layer methods is a tenth
    (`symmetric_noise`, the Gram matrix's, draws through `gaussian_noise`)."""
    real = host_noise.gaussian_noise
    monkeypatch.setattr(
        host_noise, "gaussian_noise", lambda *a, **k: real(*a, **k) / 10
    )

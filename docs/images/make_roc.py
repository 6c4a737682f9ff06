"""Regenerates docs/images/roc.png: `python docs/images/make_roc.py`."""

import pathlib

import numpy as np

from kdpemb import plots
from kdpemb.metrics import verification_roc

rng = np.random.default_rng(0)
labels = np.repeat(np.arange(200), 5)
centres = rng.normal(size=(200, 32))
curves = {
    f"noise {s}": verification_roc(
        centres[labels] + s * rng.normal(size=(1000, 32)), labels, max_far=1.0
    )
    for s in (0.6, 1.0, 1.4)
}
plots.roc(curves, pathlib.Path(__file__).with_name("roc.png"), mark_far=(1e-3, 1e-2))

"""Counts in the progress bar print as integers (`private_steps: 12`, not
`private_steps: 12.0000`); other values and other callbacks are unchanged."""

import re

import keras
import numpy as np
import pytest

from kdpemb.callbacks.count_progbar import (
    CountProgbarLogger,
    as_counts,
    with_count_progbar,
)
from kdpemb.models import DPModel


def test_as_counts_marks_only_finite_counts():
    logs = {"private_steps": 47.0, "loss": 0.25, "nonfinite_updates": float("nan")}
    shown = as_counts(logs)
    assert f"{shown['private_steps']:.4f}" == "47"
    assert f"{shown['private_steps'] / 1:.4f}" == "47"  # as the bar averages
    assert shown["loss"] == 0.25 and not isinstance(
        shown["loss"], type(shown["private_steps"])
    )
    assert np.isnan(shown["nonfinite_updates"])
    assert logs["private_steps"] == 47.0 and type(logs["private_steps"]) is float


def test_with_count_progbar_keeps_a_given_progress_logger():
    given = keras.callbacks.ProgbarLogger()
    assert with_count_progbar([given]) == [given]
    added = with_count_progbar(None)
    assert len(added) == 1 and isinstance(added[0], CountProgbarLogger)


@pytest.mark.parametrize("verbose", [1, 2])
def test_dp_model_fit_prints_private_steps_as_an_integer(capsys, verbose):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = DPModel(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        clip_norm=1.0,
        noise_multiplier=1.0,
    )
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=8, epochs=2, verbose=verbose)
    printed = capsys.readouterr().out
    assert re.findall(r"private_steps: (\S+)", printed)[-1] == "8"
    assert not re.search(r"private_steps: \d+\.\d", printed)

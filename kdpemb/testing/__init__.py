"""Test utilities: a minimal DP model and a minimal round reader.

Example:

>>> import kdpemb
>>> model = kdpemb.testing.ToyDPRegressor(
...     num_examples=16, num_features=2, noise_multiplier=1.0,
...     sampling_probability=0.5)
>>> isinstance(model, kdpemb.privacy.PrivateModel)
True
"""

from kdpemb.testing.round_consumer import RoundConsumer
from kdpemb.testing.toy_dp_regressor import (
    FullBatchSequence,
    ToyDPRegressor,
    toy_regression_data,
)

__all__ = [
    "FullBatchSequence",
    "RoundConsumer",
    "ToyDPRegressor",
    "toy_regression_data",
]

"""Test utilities: a minimal DP model and a minimal round reader."""

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

"""Test utilities: a minimal DP model that implements the privacy protocol."""

from kdpemb.testing.toy_dp_regressor import (
    FullBatchSequence,
    ToyDPRegressor,
    toy_regression_data,
)

__all__ = ["FullBatchSequence", "ToyDPRegressor", "toy_regression_data"]

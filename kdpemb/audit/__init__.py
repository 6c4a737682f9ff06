"""Empirical privacy auditing: lower bounds on ε from canaries.

`bounds` turns membership-test counts into ε lower bounds (no Keras).
"""

from kdpemb.audit.bounds import (
    clopper_pearson,
    epsilon_lower_bound,
    one_run_epsilon_lower_bound,
)

__all__ = [
    "clopper_pearson",
    "epsilon_lower_bound",
    "one_run_epsilon_lower_bound",
]

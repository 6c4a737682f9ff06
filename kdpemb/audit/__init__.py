"""Empirical privacy auditing: lower bounds on ε from canaries.

`bounds` turns membership-test counts into ε lower bounds (no Keras);
`canaries` builds canaries; `audit` runs white-box audits of kdpemb's
mechanisms. Nothing in kdpemb imports this package.
"""

from kdpemb.audit.audit import (
    AuditResult,
    audit_gaussian_sum,
    audit_last_layer_dp_ls,
    audit_scores,
)
from kdpemb.audit.bounds import (
    clopper_pearson,
    epsilon_lower_bound,
    one_run_epsilon_lower_bound,
)
from kdpemb.audit.canaries import DirectionCanary, direction_canary

__all__ = [
    "AuditResult",
    "DirectionCanary",
    "audit_gaussian_sum",
    "audit_last_layer_dp_ls",
    "audit_scores",
    "clopper_pearson",
    "direction_canary",
    "epsilon_lower_bound",
    "one_run_epsilon_lower_bound",
]

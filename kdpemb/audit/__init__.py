"""Empirical privacy auditing: lower bounds on ε from canaries.

`bounds` turns membership-test counts into ε lower bounds (no Keras);
`canaries` builds canaries; `audit` scores releases and audits kdpemb's
Gaussian sum; `model_audits` audits the models through their own
training (white-box and black-box). Nothing in kdpemb imports this
package.
"""

from kdpemb.audit.audit import (
    AuditResult,
    audit_gaussian_sum,
    audit_releases,
    audit_scores,
)
from kdpemb.audit.bounds import (
    clopper_pearson,
    epsilon_lower_bound,
    one_run_epsilon_lower_bound,
)
from kdpemb.audit.canaries import DirectionCanary, direction_canary
from kdpemb.audit.model_audits import (
    audit_dp_model,
    audit_fedemb_round,
    audit_last_layer_dp_ls,
    audit_last_layer_dp_sgd,
)

__all__ = [
    "AuditResult",
    "DirectionCanary",
    "audit_dp_model",
    "audit_fedemb_round",
    "audit_gaussian_sum",
    "audit_last_layer_dp_ls",
    "audit_last_layer_dp_sgd",
    "audit_releases",
    "audit_scores",
    "clopper_pearson",
    "direction_canary",
    "epsilon_lower_bound",
    "one_run_epsilon_lower_bound",
]

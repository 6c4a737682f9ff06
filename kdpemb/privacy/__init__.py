"""Privacy accounting for kdpemb's training schemes, on dp-accounting.

Describe a schedule with a builder (`dp_sgd`, `full_batch`,
`virtual_clients`, `gaussian_releases`, `zcdp`, `tree_aggregation`) or
from a `Schedule` (who is sampled how often), then
compute ε with `epsilon` or an `Accountant`, find the noise for a target
with `calibrate_noise_multiplier`, and state the result with
`PrivacyStatement`; `simulated_deployment` states the ε of a larger
deployment that a run stands for (never the run's own). This package
does not import Keras.

Example:

>>> from kdpemb import privacy
>>> m = privacy.virtual_clients(noise_multiplier=1.0, clients_per_round=100,
...                             num_users=100_000, users_per_client=1)
>>> round(privacy.epsilon(m, steps=2_000, delta=1e-6), 2)
0.25
"""

from kdpemb.errors import (  # noqa: F401 (see kdpemb.errors)
    CalibrationError,
    UnsupportedMechanismError,
)
from kdpemb.privacy.accountant import ACCOUNTANTS, Accountant, delta, epsilon
from kdpemb.privacy.adaptive_clipping import AdaptiveClipping
from kdpemb.privacy.calibration import calibrate_noise_multiplier
from kdpemb.privacy.deployment import (
    DeploymentStatement,
    RunDescription,
    calibrate_run_noise,
    deployment_schedule,
    simulated_deployment,
)
from kdpemb.privacy.gaussian_release import GaussianRelease
from kdpemb.privacy.ledger import ledger_statement
from kdpemb.privacy.loss_release import LossRelease
from kdpemb.privacy.mechanism_builders import (
    dp_sgd,
    full_batch,
    gaussian_releases,
    tree_aggregation,
    virtual_clients,
    zcdp,
)
from kdpemb.privacy.mechanisms import (
    ZCDP,
    GaussianReleases,
    Mechanism,
    SampledGaussian,
    TreeAggregation,
)
from kdpemb.privacy.protocol import PrivateModel, privacy_statement
from kdpemb.privacy.schedule import Schedule
from kdpemb.privacy.statement import PrivacyStatement

__all__ = [
    "ACCOUNTANTS",
    "ZCDP",
    "Accountant",
    "AdaptiveClipping",
    "DeploymentStatement",
    "GaussianRelease",
    "GaussianReleases",
    "LossRelease",
    "Mechanism",
    "PrivacyStatement",
    "PrivateModel",
    "RunDescription",
    "SampledGaussian",
    "Schedule",
    "TreeAggregation",
    "calibrate_noise_multiplier",
    "calibrate_run_noise",
    "delta",
    "deployment_schedule",
    "dp_sgd",
    "epsilon",
    "full_batch",
    "gaussian_releases",
    "ledger_statement",
    "privacy_statement",
    "simulated_deployment",
    "tree_aggregation",
    "virtual_clients",
    "zcdp",
]

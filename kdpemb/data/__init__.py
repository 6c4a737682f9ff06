"""Training rounds of virtual clients for user-level DP (DP-FedEmb).

`VirtualClients` groups users into virtual clients, samples them per round
and yields fixed-shape rounds for `model.fit`; `PoissonBatches` and
`PoissonIndices` sample examples for example-level DP-SGD. See `docs/data.md`.
"""

from kdpemb.data.assignment import assign_virtual_clients, user_keys
from kdpemb.data.poisson_batches import PoissonBatches, PoissonIndices
from kdpemb.data.round_size import max_clients_per_round, overflow_probability
from kdpemb.data.virtual_clients import (
    ClientPlan,
    ReproducibleSamplingWarning,
    RoundTruncationError,
    VirtualClients,
)

__all__ = [
    "ClientPlan",
    "PoissonBatches",
    "PoissonIndices",
    "ReproducibleSamplingWarning",
    "RoundTruncationError",
    "VirtualClients",
    "assign_virtual_clients",
    "max_clients_per_round",
    "overflow_probability",
    "user_keys",
]

"""Training rounds of virtual clients for user-level DP (DP-FedEmb).

`VirtualClients` groups users into virtual clients, samples them per round
and yields fixed-shape rounds for `model.fit`; `PoissonBatches` and
`PoissonIndices` sample examples for example-level DP-SGD, `UserBatches`
and `UserIndices` users (at most k examples each) for user-level DP-SGD.
See `docs/data.md`.

Example:

>>> import kdpemb
>>> batches = kdpemb.data.PoissonIndices(100, batch_size=10, steps=2, seed=0)
>>> len(batches)  # steps
2
"""

from kdpemb.data.poisson_batches import PoissonBatches, PoissonIndices
from kdpemb.data.user_batches import UserBatches, UserIndices
from kdpemb.data.virtual_clients import VirtualClients

__all__ = [
    "PoissonBatches",
    "PoissonIndices",
    "UserBatches",
    "UserIndices",
    "VirtualClients",
]

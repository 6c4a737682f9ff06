"""DP-FedEmb, DP-FedAvg and DP-FTRL: `FedEmbModel`, one round a step.

The model (`fedemb_model`) delegates: construction and config to
`fedemb_config`, argument checks to `fedemb_checks`, `fit`'s planning to
`fedemb_fit`, the train step to `fedemb_step`, its round in `keras.ops`
to `fedemb_round`, schedule and privacy to `fedemb_privacy`, and the
agreement of several hosts to `fedemb_multi_host`.

Example:

>>> from kdpemb.models.fedemb import AGGREGATIONS, FedEmbModel
>>> AGGREGATIONS
('partial', 'full')
"""

# The settings' choices, importable here as before the package.
from kdpemb.models.fedemb.fedemb_config import AGGREGATIONS as AGGREGATIONS
from kdpemb.models.fedemb.fedemb_config import HEAD_INITS as HEAD_INITS
from kdpemb.models.fedemb.fedemb_model import FedEmbModel

__all__ = ["FedEmbModel"]

"""Last-layer DP: `LastLayerDPClassifier`, a private linear head on frozen
features.

The classifier (`last_layer_classifier`) is a front over four methods:
"dp-sgd" (`last_layer_dp_sgd_head`) and the closed-form solvers "dp-ls",
"dp-newton", "dp-fc" (`last_layer_solvers`, float64 statistics in
`last_layer_stats`). Its target-ε plan is `last_layer_plan`; its input
checks `last_layer_inputs`; user-level privacy (`unit="user"`) and the
DP-SGD sampler `last_layer_users`.

Example:

>>> from kdpemb.models.last_layer import METHODS
>>> METHODS
('dp-sgd', 'dp-ls', 'dp-newton', 'dp-fc')
"""

# The settings' choices, importable here as before the package.
from kdpemb.models.last_layer.last_layer_classifier import HEAD_INITS as HEAD_INITS
from kdpemb.models.last_layer.last_layer_classifier import (
    METHOD_CLASSES as METHOD_CLASSES,
)
from kdpemb.models.last_layer.last_layer_classifier import METHODS as METHODS
from kdpemb.models.last_layer.last_layer_classifier import (
    ClipFeatures,
    LastLayerDPClassifier,
)
from kdpemb.models.last_layer.last_layer_dp_sgd_head import dense_gradient_norms

__all__ = ["ClipFeatures", "LastLayerDPClassifier", "dense_gradient_norms"]

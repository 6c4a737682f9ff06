"""DP-SGD for any Keras model: `DPModel`.

The model (`dp_model`) takes the clipped sum of per-example gradients
from `clipped_gradients`, which plans per layer: ghost norms where a
layer allows them (`ghost_norms`), vectorised per-example gradients
otherwise.

Example:

>>> from kdpemb.models.dp_sgd import DPModel
>>> import kdpemb
>>> DPModel is kdpemb.DPModel
True
"""

from kdpemb.models.dp_sgd.dp_model import DPModel

__all__ = ["DPModel"]

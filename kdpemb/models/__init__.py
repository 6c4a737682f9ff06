"""Private training models (their DP `train_step`s), baselines and backbones.

Example:

>>> import kdpemb
>>> backbone = kdpemb.models.small_cnn(
...     (8, 8, 1), embedding_dim=4, width=4, groups=2)
>>> backbone.output_shape
(None, 4)
>>> kdpemb.FedEmbModel is kdpemb.models.FedEmbModel  # also at the top level
True
"""

from kdpemb.errors import (  # noqa: F401 (see kdpemb.errors)
    ReproducibleNoiseWarning,
    UnsupportedLayerError,
)
from kdpemb.models.backbone_checks import check_backbone
from kdpemb.models.backbones import resnet_gn, small_cnn
from kdpemb.models.batchnorm_replacement import replace_batchnorm
from kdpemb.models.centralized import CentralizedBaseline
from kdpemb.models.clip_suggestions import suggest_clip_norm, suggest_feature_clip_norm
from kdpemb.models.dp_sgd import DPModel
from kdpemb.models.fedemb import FedEmbModel
from kdpemb.models.heads import CosineHead
from kdpemb.models.hub_backbones import hub_backbone
from kdpemb.models.last_layer import (
    ClipFeatures,
    LastLayerDPClassifier,
    dense_gradient_norms,
)
from kdpemb.models.pretraining import pretrain

__all__ = [
    "CentralizedBaseline",
    "ClipFeatures",
    "CosineHead",
    "DPModel",
    "FedEmbModel",
    "LastLayerDPClassifier",
    "check_backbone",
    "dense_gradient_norms",
    "hub_backbone",
    "pretrain",
    "replace_batchnorm",
    "resnet_gn",
    "small_cnn",
    "suggest_clip_norm",
    "suggest_feature_clip_norm",
]

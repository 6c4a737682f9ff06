"""Private training models (their DP `train_step`s), baselines and backbones."""

from kdpemb.models.backbone_checks import UnsupportedLayerError, check_backbone
from kdpemb.models.backbones import small_cnn
from kdpemb.models.centralized import CentralizedBaseline
from kdpemb.models.fedemb import FedEmbModel, ReproducibleNoiseWarning

__all__ = [
    "CentralizedBaseline",
    "FedEmbModel",
    "ReproducibleNoiseWarning",
    "UnsupportedLayerError",
    "check_backbone",
    "small_cnn",
]

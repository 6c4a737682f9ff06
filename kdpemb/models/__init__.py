"""Private training models (their DP `train_step`s) and the checks they run."""

from kdpemb.models.backbone_checks import UnsupportedLayerError, check_backbone

__all__ = ["UnsupportedLayerError", "check_backbone"]

"""Keras callbacks of kdpemb. Importing this module imports Keras."""

from kdpemb.callbacks.privacy_budget import PrivacyBudget, PrivacyBudgetExhaustedError
from kdpemb.callbacks.recall_at_far import RecallAtFAR
from kdpemb.callbacks.rich_progress import RichProgress

__all__ = [
    "PrivacyBudget",
    "PrivacyBudgetExhaustedError",
    "RecallAtFAR",
    "RichProgress",
]

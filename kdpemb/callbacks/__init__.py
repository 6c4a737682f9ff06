"""Keras callbacks of kdpemb. Importing this module imports Keras."""

from kdpemb.callbacks.privacy_budget import PrivacyBudget, PrivacyBudgetExhaustedError

__all__ = ["PrivacyBudget", "PrivacyBudgetExhaustedError"]

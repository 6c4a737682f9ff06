"""Keras callbacks of kdpemb. Importing this module imports Keras.

Example:

>>> import kdpemb
>>> budget = kdpemb.callbacks.PrivacyBudget(delta=1e-5, target_epsilon=2.0)
>>> # model.fit(data, epochs=..., callbacks=[budget]) stops before ε > 2.
"""

from kdpemb.callbacks.atomic_backup import AtomicBackupAndRestore
from kdpemb.callbacks.privacy_budget import PrivacyBudget
from kdpemb.callbacks.privacy_ledger import PrivacyLedger
from kdpemb.callbacks.recall_at_far import RecallAtFAR
from kdpemb.callbacks.rich_progress import RichProgress
from kdpemb.errors import PrivacyBudgetExhaustedError  # noqa: F401 (see errors)

__all__ = [
    "AtomicBackupAndRestore",
    "PrivacyBudget",
    "PrivacyLedger",
    "RecallAtFAR",
    "RichProgress",
]

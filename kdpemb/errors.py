"""kdpemb's error and warning classes, in one place (the bottom floor).

Every error a user may want to catch, and every warning a user may want to
filter, is defined here and imports nothing from kdpemb. The modules that
raise them re-export them under their old names.

Example:

>>> import warnings
>>> from kdpemb import errors
>>> issubclass(errors.ReproducibleNoiseWarning, errors.PrivacyWarning)
True
>>> warnings.simplefilter("error", errors.PrivacyWarning)  # fail on any
>>> warnings.resetwarnings()
"""

__all__ = [
    "CalibrationError",
    "DataDependentScheduleWarning",
    "DatasetNotFoundError",
    "DegenerateFeaturesWarning",
    "LostReleaseError",
    "NonFiniteFeaturesError",
    "PrivacyBudgetExhaustedError",
    "PrivacyWarning",
    "ReproducibleNoiseWarning",
    "ReproducibleSamplingWarning",
    "RoundTruncationError",
    "RoundsOutOfEpochError",
    "SmallPopulationWarning",
    "UnsupportedBackendError",
    "UnsupportedLayerError",
    "UnsupportedMechanismError",
]


class PrivacyWarning(UserWarning):
    """Something weakens or voids the privacy guarantee: read before release."""


class ReproducibleNoiseWarning(PrivacyWarning):
    """A fixed seed makes the DP noise predictable: for tests only."""


class ReproducibleSamplingWarning(PrivacyWarning):
    """A fixed seed makes the sampling of users or examples predictable."""


class DataDependentScheduleWarning(PrivacyWarning):
    """A public hyperparameter of the schedule is derived from private data.

    E.g. the number of virtual clients P = ceil(N / k) computed from the
    private user count N: pass `num_clients` from a public count instead.
    """


class SmallPopulationWarning(PrivacyWarning):
    """The population is a single unit (user or example).

    Its neighbouring dataset is the empty one, so the guarantee is about
    all of the data: the model is useless or discloses that unit's data,
    and δ < 1/population rules out nothing.
    """


class UnsupportedBackendError(ImportError):
    """Keras is set to a backend kdpemb does not support."""


class UnsupportedLayerError(ValueError):
    """The backbone holds a layer that would leak private data."""


class NonFiniteFeaturesError(ValueError):
    """A backbone gave NaN or infinite features (or embeddings).

    `summary` says how many rows, and the first.
    """

    def __init__(self, message, summary=""):
        super().__init__(message)
        self.summary = summary


class DegenerateFeaturesWarning(UserWarning):
    """Most feature rows are (near) zero at the clip scale: a private head
    would learn nothing (e.g. an untrained backbone's features)."""


class CalibrationError(ValueError):
    """No noise multiplier in the allowed range meets the target ε."""


class UnsupportedMechanismError(ValueError):
    """The chosen accountant cannot express this mechanism and relation."""


class PrivacyBudgetExhaustedError(RuntimeError):
    """Training was asked to continue with no privacy budget left."""


class LostReleaseError(RuntimeError):
    """A one-off release that the accounting counts once is missing from a
    model that has already taken private steps: releasing it again would
    spend privacy that no statement counts."""


class RoundTruncationError(RuntimeError):
    """A round sampled more virtual clients than its fixed shape holds."""


class RoundsOutOfEpochError(RuntimeError):
    """Rounds without sampling did not line up with the model's epochs.

    They were not trained (nothing was released and they were not
    counted): a user could otherwise take part twice in one epoch.
    """


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are in none of the places searched.

    The message lists every place looked at, why each failed, and how to
    provide the files.
    """

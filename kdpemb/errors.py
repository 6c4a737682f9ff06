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
    "AccountingError",
    "CalibrationError",
    "CorruptDatasetError",
    "CostlyReleaseWarning",
    "DataDependentScheduleWarning",
    "DatasetNotFoundError",
    "DegenerateFeaturesWarning",
    "HostsDisagreeError",
    "LostReleaseError",
    "NonFiniteFeaturesError",
    "NonFiniteInputError",
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
    """Something weakens or voids the privacy guarantee: read before release.

    Example:

    >>> import warnings
    >>> from kdpemb.errors import PrivacyWarning, ReproducibleSamplingWarning
    >>> issubclass(ReproducibleSamplingWarning, PrivacyWarning)
    True
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error", PrivacyWarning)  # fail on any of them
    ...     warnings.warn("demo", ReproducibleSamplingWarning)
    Traceback (most recent call last):
        ...
    kdpemb.errors.ReproducibleSamplingWarning: demo
    """


class ReproducibleNoiseWarning(PrivacyWarning):
    """A fixed seed makes the DP noise predictable: for tests only.

    Example:

    >>> import warnings
    >>> import kdpemb
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     model = kdpemb.testing.ToyDPRegressor(
    ...         num_examples=64, num_features=3, noise_multiplier=1.0,
    ...         sampling_probability=0.1, seed=0)
    >>> [w.category.__name__ for w in caught]
    ['ReproducibleNoiseWarning']
    """


class ReproducibleSamplingWarning(PrivacyWarning):
    """A fixed seed makes the sampling of users or examples predictable.

    Example:

    >>> import warnings
    >>> import numpy as np
    >>> from kdpemb.data import VirtualClients
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     clients = VirtualClients(np.zeros((8, 4, 4, 1)), labels=np.arange(8),
    ...                              user_ids=np.arange(8) // 2,
    ...                              clients_per_round=2, seed=0)
    >>> [w.category.__name__ for w in caught]
    ['ReproducibleSamplingWarning']
    """


class DataDependentScheduleWarning(PrivacyWarning):
    """A public hyperparameter of the schedule is derived from private data.

    E.g. the number of virtual clients P = ceil(N / k) computed from the
    private user count N: pass `num_clients` from a public count instead.

    Example:

    >>> import warnings
    >>> import numpy as np
    >>> from kdpemb.data import VirtualClients
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     clients = VirtualClients(np.zeros((8, 4, 4, 1)), labels=np.arange(8),
    ...                              user_ids=np.arange(8) // 2,
    ...                              clients_per_round=2, sampling="epochs")
    ...     steps = clients.schedule.steps_per_epoch  # R = ceil(4 users / 2)
    >>> steps, [w.category.__name__ for w in caught]
    (2, ['DataDependentScheduleWarning'])
    """


class SmallPopulationWarning(PrivacyWarning):
    """The population is a single unit (user or example).

    Its neighbouring dataset is the empty one, so the guarantee is about
    all of the data: the model is useless or discloses that unit's data,
    and δ < 1/population rules out nothing.

    Example:

    >>> import warnings
    >>> from kdpemb import privacy
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     mechanism = privacy.dp_sgd(
    ...         noise_multiplier=1.0, batch_size=1, num_examples=1)
    >>> [w.category.__name__ for w in caught]
    ['SmallPopulationWarning']
    """


class UnsupportedBackendError(ImportError):
    """Keras is set to a backend kdpemb does not support.

    Example:

    Raised by `import kdpemb` with, e.g., `KERAS_BACKEND=torch`. It is an
    `ImportError`, so code that treats kdpemb as optional catches it:

    >>> from kdpemb.errors import UnsupportedBackendError
    >>> issubclass(UnsupportedBackendError, ImportError)
    True
    """


class UnsupportedLayerError(ValueError):
    """The backbone holds a layer that would leak private data.

    Example:

    >>> import keras
    >>> import kdpemb
    >>> backbone = keras.Sequential([keras.Input((4, 4, 1)),
    ...                              keras.layers.BatchNormalization(),
    ...                              keras.layers.Flatten()])
    >>> kdpemb.models.check_backbone(backbone)
    Traceback (most recent call last):
        ...
    kdpemb.errors.UnsupportedLayerError: The backbone has 1 trainable ...
    """


class NonFiniteInputError(ValueError):
    """Data holds NaN or infinite values: refused before training uses it.

    One rule in every trainer (`DPModel`, `LastLayerDPClassifier`,
    `FedEmbModel` through `VirtualClients`, `CentralizedBaseline`) and in
    `kdpemb.features.extract` and `write_user_shards`: non-finite inputs
    (pixels, features, float targets) are refused, never dropped, since
    dropping them would silently change the data the guarantee is about.
    Arrays are checked before the first step; streams batch by batch as
    they are read, before the batch is used. Nothing was trained or spent.
    `row` is the first offending row (an int, or None where unknown).

    Example:

    >>> import numpy as np
    >>> from kdpemb.errors import NonFiniteInputError
    >>> from kdpemb.models.last_layer.last_layer_inputs import check_data
    >>> try:
    ...     check_data(np.array([[0.0], [np.inf]]), np.array([0, 1]), 2)
    ... except NonFiniteInputError as error:
    ...     print(error.row, str(error)[:40])
    1 features[1] holds NaN or infinite values
    """

    def __init__(self, message, row=None):
        super().__init__(message)
        self.row = row


class NonFiniteFeaturesError(NonFiniteInputError):
    """A backbone gave NaN or infinite features (or embeddings).

    `summary` says how many rows, and the first. A `NonFiniteInputError`:
    such features are the input of a last-layer fit.

    Example:

    Raised by `kdpemb.features.extract` and the `RecallAtFAR` callback; it
    is a `ValueError`:

    >>> from kdpemb.errors import NonFiniteFeaturesError
    >>> error = NonFiniteFeaturesError("NaN features", summary="1 of 4 rows")
    >>> isinstance(error, ValueError), error.summary
    (True, '1 of 4 rows')
    """

    def __init__(self, message, summary="", row=None):
        super().__init__(message, row)
        self.summary = summary


class DegenerateFeaturesWarning(UserWarning):
    """Most feature rows are (near) zero at the clip scale: a private head
    would learn nothing (e.g. an untrained backbone's features).

    Example:

    >>> import warnings
    >>> import numpy as np
    >>> from kdpemb.models.last_layer.last_layer_inputs import warn_if_degenerate
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_if_degenerate(np.zeros((4, 3)), 1.0, "clip_norm")
    >>> [w.category.__name__ for w in caught]
    ['DegenerateFeaturesWarning']
    """


class CostlyReleaseWarning(UserWarning):
    """An opt-in release beside the gradient is noised less than the
    gradient itself, so it spends most of each step's budget (e.g.
    `AdaptiveClipping`'s count at its default noise σ_b = B / 20 with a
    small batch B): the guarantee holds, but the gradient gets less.

    Example:

    >>> import warnings
    >>> import keras
    >>> from kdpemb.models import DPModel
    >>> from kdpemb.models.dp_sgd.step_releases import warn_costly_count
    >>> from kdpemb.privacy import AdaptiveClipping, Schedule
    >>> network = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> model = DPModel(network, noise_multiplier=1.0,
    ...                 adaptive_clipping=AdaptiveClipping(),
    ...                 schedule=Schedule.examples(1_000, 8).get_config())
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_costly_count(model)  # σ_b = 8 / 20: 2σ_b = 0.8 < z = 1.
    >>> [w.category.__name__ for w in caught]
    ['CostlyReleaseWarning']
    """


class CalibrationError(ValueError):
    """No noise multiplier in the allowed range meets the target ε.

    Example:

    >>> from kdpemb import privacy
    >>> mechanism = privacy.dp_sgd(
    ...     noise_multiplier=1.0, batch_size=10, num_examples=100)
    >>> privacy.calibrate_noise_multiplier(
    ...     mechanism, 100, 1e-5, target_epsilon=1e-4, max_noise_multiplier=2.0)
    Traceback (most recent call last):
        ...
    kdpemb.errors.CalibrationError: target_epsilon=0.0001 cannot be met ...
    """


class UnsupportedMechanismError(ValueError):
    """The chosen accountant cannot express this mechanism and relation.

    Example:

    >>> from kdpemb import privacy
    >>> mechanism = privacy.zcdp(rho=0.1, population=100)
    >>> privacy.epsilon(mechanism, steps=10, delta=1e-5, accountant="pld")
    Traceback (most recent call last):
        ...
    kdpemb.errors.UnsupportedMechanismError: The PLD accountant cannot account ...
    """


class PrivacyBudgetExhaustedError(RuntimeError):
    """Training was asked to continue with no privacy budget left.

    Example:

    `kdpemb.callbacks.PrivacyBudget` raises it when `fit` is called again on
    a model whose step budget is spent; it is a `RuntimeError`:

    >>> import kdpemb
    >>> from kdpemb.errors import PrivacyBudgetExhaustedError
    >>> kdpemb.callbacks.PrivacyBudgetExhaustedError is PrivacyBudgetExhaustedError
    True
    >>> issubclass(PrivacyBudgetExhaustedError, RuntimeError)
    True
    """


class LostReleaseError(RuntimeError):
    """A one-off release that the accounting counts once is missing from a
    model that has already taken private steps: releasing it again would
    spend privacy that no statement counts.

    Example:

    `LastLayerDPClassifier(method="dp-fc")` raises it before any release
    when it resumes (its `private_steps` raised by
    `kdpemb.callbacks.PrivacyLedger`) from a checkpoint older than the
    release of its feature covariance:

    >>> from kdpemb.errors import LostReleaseError
    >>> issubclass(LostReleaseError, RuntimeError)
    True
    """


class RoundTruncationError(RuntimeError):
    """A round sampled more virtual clients than its fixed shape holds.

    Example:

    `kdpemb.data.VirtualClients` raises it while iterating when a Poisson
    round samples more than `max_clients_per_round` clients (with the
    probability `truncation_probability` per round):

    >>> from kdpemb.errors import RoundTruncationError
    >>> issubclass(RoundTruncationError, RuntimeError)
    True
    """


class RoundsOutOfEpochError(RuntimeError):
    """Rounds without sampling did not line up with the model's epochs.

    They were not trained (nothing was released and they were not
    counted): a user could otherwise take part twice in one epoch.

    Example:

    `kdpemb.FedEmbModel.fit` raises it; it is a `RuntimeError`:

    >>> from kdpemb.errors import RoundsOutOfEpochError
    >>> issubclass(RoundsOutOfEpochError, RuntimeError)
    True
    """


class CorruptDatasetError(ValueError):
    """A dataset directory is incomplete, truncated or of an unknown format.

    Raised by `kdpemb.datasets.UserShards` before any training: the
    message names the file and what is wrong with it. Write the dataset
    again (`kdpemb.datasets.write_user_shards`).

    Example:

    >>> from kdpemb.errors import CorruptDatasetError
    >>> issubclass(CorruptDatasetError, ValueError)
    True
    """


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are in none of the places searched.

    The message lists every place looked at, why each failed, and how to
    provide the files.

    Example:

    >>> from kdpemb import datasets
    >>> datasets.load_mnist("/no/such/dir", download=False)
    Traceback (most recent call last):
        ...
    kdpemb.errors.DatasetNotFoundError: MNIST was not found. Looked in:
      - path='/no/such/dir': does not exist
    ...
    """


class HostsDisagreeError(RuntimeError):
    """The hosts of a multi-host job do not hold the same round plan,
    weights or step count, so a round would mix samples or models.

    Raised on every host before the first round; nothing was trained.

    Example:

    >>> issubclass(HostsDisagreeError, RuntimeError)
    True
    """


class AccountingError(ValueError):
    """dp-accounting failed to account for a mechanism at these values.

    The message says which accountant, the mechanism's noise and steps,
    dp-accounting's reason in one line and what to try; `detail` keeps
    dp-accounting's whole message. Nothing was stated or spent.

    Example:

    >>> from kdpemb.errors import AccountingError
    >>> error = AccountingError("The RDP accountant failed", detail="...")
    >>> isinstance(error, ValueError), error.detail
    (True, '...')
    """

    def __init__(self, message, detail=""):
        super().__init__(message)
        self.detail = detail

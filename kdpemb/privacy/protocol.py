"""The small protocol through which a model exposes its DP schedule.

`kdpemb.callbacks.PrivacyBudget` (and `privacy_statement`) work with any
Keras model that has:

- `private_steps`: a non-trainable integer `keras.Variable` owned by the
  model, counting the private steps (rounds) taken so far. Being model
  state, it is saved by `model.save`, `save_weights` and checkpoints, so a
  restored model or a second `fit` keeps counting. Each call of
  `train_step` adds exactly 1 (a step that reads private data) or 0.
- `privacy_mechanism()`: returns the `kdpemb.privacy.Mechanism` of one such
  step. Every step counted by `private_steps` must have used it.
- optionally `delta`: the model's δ (a float, or None). δ is given once,
  to the model: `PrivacyBudget` and `privacy_statement` use it when they
  are not given one.
- optionally `ledger_resume_steps(counted)`: the `private_steps` a run
  resumes from when `kdpemb.callbacks.PrivacyLedger` counted `counted`
  steps begun before a crash (at least `counted`; see `resume_steps`).

kdpemb's DP models implement it. Example of a minimal implementation:

    class MyDPModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.private_steps = self.add_weight(
                shape=(), dtype="int32", initializer="zeros",
                trainable=False, name="private_steps")

        def privacy_mechanism(self):
            return kdpemb.privacy.dp_sgd(1.1, batch_size=256,
                                         num_examples=60_000)

        def train_step(self, data):
            ...  # clip, add noise once, update
            self.private_steps.assign_add(1)
"""

import typing

import numpy as np

from kdpemb.privacy.mechanisms import Mechanism
from kdpemb.privacy.statement import PrivacyStatement


@typing.runtime_checkable
class PrivateModel(typing.Protocol):
    """A model that counts its private steps and states its mechanism.

    Example:

    >>> import kdpemb
    >>> model = kdpemb.testing.ToyDPRegressor(
    ...     num_examples=64, num_features=3, noise_multiplier=1.5,
    ...     sampling_probability=0.1)
    >>> isinstance(model, kdpemb.privacy.PrivateModel)
    True
    >>> isinstance(object(), kdpemb.privacy.PrivateModel)
    False
    """

    private_steps: typing.Any

    def privacy_mechanism(self) -> Mechanism: ...


def check_private_model(model):
    """Returns the model's mechanism; a clear error if it lacks the protocol."""
    missing = [
        name
        for name in ("private_steps", "privacy_mechanism")
        if not hasattr(model, name)
    ]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not expose a DP schedule: it lacks "
            f"{' and '.join(missing)}. PrivacyBudget needs a model that "
            "implements kdpemb's privacy protocol (see "
            "kdpemb.privacy.protocol): a kdpemb DP model, or your own model "
            "with a `private_steps` variable and a `privacy_mechanism()` "
            "method."
        )
    mechanism = model.privacy_mechanism()
    if not isinstance(mechanism, Mechanism):
        raise TypeError(
            f"{type(model).__name__}.privacy_mechanism() must return a "
            f"kdpemb.privacy.Mechanism, got {type(mechanism).__name__}."
        )
    return mechanism


def read_private_steps(model):
    """The model's private step count as a Python int.

    On JAX the model's variables are only synced at train begin and at
    epoch boundaries; read it there (mid-epoch it may be stale or purged).
    """
    value = getattr(model.private_steps, "value", model.private_steps)
    # A tf.distribute variable read in its strategy's scope refuses
    # `np.asarray` ("__array__ method not producing an array"); `numpy()` works.
    steps = int(np.asarray(value.numpy() if hasattr(value, "numpy") else value))
    if steps < 0:
        raise ValueError(f"{type(model).__name__}.private_steps is negative: {steps}.")
    return steps


def resume_steps(model, counted):
    """The `private_steps` to resume from after a crash that left `counted`
    steps begun: `counted`, or more where the model's accounting has
    coarser units (`FedEmbModel` with rounds without sampling counts a
    partial epoch as a whole one). Never fewer than `counted`."""
    hook = getattr(model, "ledger_resume_steps", None)
    steps = counted if hook is None else int(hook(counted))
    if steps < counted:
        raise ValueError(
            f"{type(model).__name__}.ledger_resume_steps({counted}) returned "
            f"{steps}: a resumed run must count at least the {counted} steps "
            "begun."
        )
    return steps


def model_delta(model, delta=None, who="privacy_statement"):
    """`delta` if given, else the model's own `delta`; a clear error if neither."""
    if delta is None:
        delta = getattr(model, "delta", None)
    if delta is None:
        cls = type(model).__name__
        raise ValueError(
            f"{who} needs δ, and this {cls} has none: build it with "
            f"{cls}(..., delta=...) (δ is given once per model), or pass "
            "delta=... here. Choose δ well below 1/population."
        )
    return delta


def privacy_statement(model, delta=None, accountant=None):
    """The `PrivacyStatement` of a model that implements the protocol.

    Args:
        model: a model with `private_steps` and `privacy_mechanism()`.
        delta: float or None. The δ; None takes the model's `delta`.
        accountant: str or None. "pld" or "rdp"; None (default): "pld"
            where it models the mechanism, else "rdp".

    Example:

    >>> import kdpemb
    >>> model = kdpemb.testing.ToyDPRegressor(
    ...     num_examples=64, num_features=3, noise_multiplier=1.5,
    ...     sampling_probability=0.1)
    >>> statement = kdpemb.privacy.privacy_statement(model, delta=1e-3)
    >>> statement.steps, statement.epsilon  # nothing trained yet
    (0, 0.0)
    """
    mechanism = check_private_model(model)
    return PrivacyStatement.compute(
        mechanism, read_private_steps(model), model_delta(model, delta), accountant
    )

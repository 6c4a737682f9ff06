"""Settings that cannot change after construction.

A DP model's accounting of past steps (and its traced `train_step`)
depends on settings such as the clip norm or the noise multiplier: a change
after construction would make ε describe another training. Models list
those settings in `_FROZEN_SETTINGS` and call `_freeze_settings()` at the
end of `__init__`.
"""

import contextlib


class FrozenSettings:
    """Mixin: assigning a name in `_FROZEN_SETTINGS` after `_freeze_settings()`
    raises `AttributeError` with the fix."""

    _FROZEN_SETTINGS = frozenset()

    def _freeze_settings(self):
        object.__setattr__(self, "_settings_frozen", True)

    @contextlib.contextmanager
    def _settings_unfrozen(self):
        """For the model itself, e.g. to adopt counts validated at `fit`."""
        object.__setattr__(self, "_settings_frozen", False)
        try:
            yield
        finally:
            object.__setattr__(self, "_settings_frozen", True)

    def __setattr__(self, name, value):
        if name in self._FROZEN_SETTINGS and getattr(self, "_settings_frozen", False):
            cls = type(self).__name__
            raise AttributeError(
                f"{cls}.{name} is fixed at construction: the steps already "
                "traced and the privacy accounting of past steps depend on it. "
                f"Build a new {cls} (e.g. from model.get_config() with the new "
                "value, then copy the weights)."
            )
        super().__setattr__(name, value)


# The settings a trainer's own `fit` may fix (its target-ε plan) or undo.
PLAN_SETTINGS = frozenset(
    {"schedule", "planned_steps", "calibrated_noise_multiplier", "noise_multiplier"}
)


def adopt_plan(model, **values):
    """Sets `model`'s plan settings (`PLAN_SETTINGS` only) from the plan its
    own `fit` checked, calibrated or undoes: for kdpemb's trainers."""
    unknown = sorted(set(values) - PLAN_SETTINGS)
    if unknown:
        raise ValueError(f"{unknown} are not plan settings; they stay fixed.")
    with model._settings_unfrozen():
        for name, value in values.items():
            setattr(model, name, value)

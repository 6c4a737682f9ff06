"""The closed-form last-layer methods: DP least squares, DP-Newton, DP-FC.

Each solver owns what it releases (its statistics, their sensitivities
and, through `GaussianRelease.from_noise_multiplier`, their noise), how it
is accounted (`mechanism`) and the step that turns the noisy statistics
into head weights. Statistics and noise are float64 NumPy on the host
(`last_layer_stats`, `kdpemb.privacy.host_noise`).

A step costs what one Gaussian of multiplier z costs: its two releases
split that cost in zCDP, the second-order statistic taking `budget_split`
(its multiplier is z / √s, the first-order one's z / √(1 − s)). DP-FC's
one covariance release takes `budget_split` of the whole planned run's
budget (z / √(s T)).

At user level (`examples_per_user` set) every statistic sums the users'
means over at most k of their examples (`row_weights` of 1 / n_u), whose
sensitivities per user are those of one example; λ scales with U.
"""

import math

import keras
import numpy as np
from keras import ops

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.errors import LostReleaseError
from kdpemb.models.last_layer import last_layer_stats as stats
from kdpemb.privacy import host_noise, protocol
from kdpemb.privacy.gaussian_release import GaussianRelease


class ClosedFormSolver:
    """What the three closed-form solvers share: settings, ridge, accounting.

    Args:
        num_classes: int. K.
        feature_clip_norm: float. C_x, which sets every sensitivity.
        budget_split: float in (0, 1). The second-order statistic's share.
        l2: float or None. The ridge penalty (see `ridge`).
        examples_per_user: int or None. k at user level: each statistic
            sums the users' means over at most k of their examples
            (`step`'s `row_weights`), with the sensitivities of one example.
    """

    name = None
    use_bias = False
    clips_gradients = False  # Clips the features instead.
    needs_feature_clip_norm = True
    sampled = False  # All the data, one host step per epoch.
    single_step = False

    def __init__(
        self, num_classes, feature_clip_norm, budget_split, l2, examples_per_user=None
    ):
        self.num_classes = num_classes
        self.feature_clip_norm = feature_clip_norm
        self.budget_split = budget_split
        self.l2 = l2
        self.examples_per_user = examples_per_user

    @classmethod
    def from_settings(
        cls, *, num_classes, feature_clip_norm, budget_split, l2,
        examples_per_user=None, **settings,
    ):  # fmt: skip
        """From the classifier's settings (DP-SGD's `clip_norm` is not used)."""
        del settings
        return cls(num_classes, feature_clip_norm, budget_split, l2, examples_per_user)

    def _named(self, name):
        """A release's name; at user level it names the users' means and k."""
        if self.examples_per_user is None:
            return name
        return f"{name} of user means (at most {self.examples_per_user} examples each)"

    def releases(self, noise_multiplier, planned_steps):
        """`(setup, per_step)`: tuples of `GaussianRelease`, second-order first."""
        raise NotImplementedError

    def mechanism(self, noise_multiplier, schedule, planned_steps):
        """The `GaussianReleases` of one step on `schedule.population` units."""
        setup, per_step = self.releases(noise_multiplier, planned_steps)
        return privacy.gaussian_releases(
            per_step,
            schedule.population,
            setup=setup,
            clip_norm=self.feature_clip_norm,
            unit=schedule.unit,
        )

    def noise_multiplier_of(self, calibrated):
        """The step's z from the multiplier calibrated on `mechanism(1.0, …)`."""
        return calibrated

    def _split(self, noise_multiplier):
        """(second-order, first-order) noise multipliers of one step."""
        z, s = noise_multiplier, self.budget_split
        return z / math.sqrt(s), z / math.sqrt(1 - s)

    def _split_releases(self, noise_multiplier, second, first):
        """The step's two releases, `(sensitivity, name)` each, splitting z."""
        return tuple(
            GaussianRelease.from_noise_multiplier(z, sensitivity, name)
            for z, (sensitivity, name) in zip(
                self._split(noise_multiplier), (second, first), strict=True
            )
        )

    def ridge(self, second_order, num_examples, dim):
        """λ: `l2 · N`, or by default `2 σ √d` of the second-order noise.

        The default is data-independent (σ is public), with a floor of
        `1e-6 · N` when there is no noise. N is the population: examples,
        or users at user level (each user's weights sum to 1).
        """
        if self.l2 is not None:
            return self.l2 * num_examples
        return max(2.0 * second_order.noise_std * math.sqrt(dim), 1e-6 * num_examples)

    def build(self, model, dim):
        """Adds the solver's own state to `model` (none by default)."""

    def step(
        self, model, features, labels, rng, noise_multiplier, planned_steps,
        row_weights=None,
    ):  # fmt: skip
        """One private step: releases its statistics and updates the head.

        `row_weights` [N]: each example's weight (1 / n_u for a user's
        chosen examples, at user level); None: 1 each.
        """
        raise NotImplementedError

    def _newton_like_step(self, model, gradient, curvature, second_order, n):
        """Solves `(H_c + λ I) Δ_c = g_c + λ w_c` per class; optimizer applies Δ.

        `curvature` is `[K, d, d]`, one matrix per class, or one `[d, d]`
        matrix shared by every class (solved once for all K columns).
        """
        weights = _kernel(model)
        ridge = self.ridge(second_order, n, weights.shape[0])
        right_hand_side = gradient + ridge * weights
        if curvature.ndim == 2:
            direction = stats.solve_ridge(curvature, right_hand_side, ridge)
        else:
            direction = np.stack(
                [
                    stats.solve_ridge(curvature[c], right_hand_side[:, c], ridge)
                    for c in range(self.num_classes)
                ],
                axis=1,
            )
        model.optimizer.apply(
            [ops.convert_to_tensor(direction.astype("float32"))], [model.head.kernel]
        )


def _kernel(model):
    return np.asarray(keras.ops.convert_to_numpy(model.head.kernel), np.float64)


class DPLeastSquares(ClosedFormSolver):
    """Ridge least squares on one-hot targets: noisy `X̃ᵀX̃` and `X̃ᵀY`, once.

    Example:

    >>> solver = DPLeastSquares(3, feature_clip_norm=2.0, budget_split=0.5, l2=None)
    >>> [(r.name, r.sensitivity) for r in solver.releases(1.0, 1)[1]]
    [('Gram matrix', 4.0), ('per-class feature sums', 2.0)]
    """

    name = "dp-ls"
    single_step = True  # A further fit would release the statistics again.

    def releases(self, noise_multiplier, planned_steps):
        cx = self.feature_clip_norm
        return (), self._split_releases(
            noise_multiplier,
            (stats.GRAM_SENSITIVITY * cx**2, self._named("Gram matrix")),
            (stats.CLASS_SUMS_SENSITIVITY * cx, self._named("per-class feature sums")),
        )

    def step(
        self, model, features, labels, rng, noise_multiplier, planned_steps,
        row_weights=None,
    ):  # fmt: skip
        _, (gram_release, sums_release) = self.releases(noise_multiplier, planned_steps)
        dim = features.shape[1]
        cx = self.feature_clip_norm
        gram = stats.gram(features, cx, row_weights)
        gram += host_noise.symmetric_noise(gram_release, dim, rng)
        sums = stats.class_sums(features, labels, self.num_classes, cx, row_weights)
        sums += host_noise.gaussian_noise(sums_release, sums.shape, rng)
        ridge = self.ridge(gram_release, model.schedule.population, dim)
        kernel = stats.solve_ridge(stats.make_psd(gram), sums, ridge)
        model.head.kernel.assign(kernel.astype("float32"))


class DPNewton(ClosedFormSolver):
    """Newton steps from a noisy logistic gradient and noisy Hessian blocks.

    Example:

    >>> solver = DPNewton(3, feature_clip_norm=2.0, budget_split=0.5, l2=None)
    >>> [round(r.noise_multiplier, 4) for r in solver.releases(1.0, 1)[1]]
    [1.4142, 1.4142]
    """

    name = "dp-newton"

    def releases(self, noise_multiplier, planned_steps):
        cx = self.feature_clip_norm
        return (), self._split_releases(
            noise_multiplier,
            (stats.HESSIANS_SENSITIVITY * cx**2, self._named("per-class Hessians")),
            (stats.GRADIENT_SENSITIVITY * cx, self._named("logistic gradient")),
        )

    def step(
        self, model, features, labels, rng, noise_multiplier, planned_steps,
        row_weights=None,
    ):  # fmt: skip
        _, (hessians_release, gradient_release) = self.releases(
            noise_multiplier, planned_steps
        )
        dim = features.shape[1]
        gradient, hessians = stats.logistic_statistics(
            features, labels, _kernel(model), self.feature_clip_norm, hessians=True,
            row_weights=row_weights,
        )  # fmt: skip
        gradient += host_noise.gaussian_noise(gradient_release, gradient.shape, rng)
        hessians += host_noise.symmetric_noise(
            hessians_release, dim, rng, count=self.num_classes
        )
        self._newton_like_step(
            model, gradient, stats.make_psd(hessians), hessians_release,
            model.schedule.population,
        )  # fmt: skip


class DPFeatureCovariance(ClosedFormSolver):
    """The feature covariance, released once, preconditions noisy gradients.

    The Hessian blocks of a zero head are `p(1 − p) X̃ᵀX̃` with p = 1/K:
    the released covariance stands in for all of them at every step. It is
    model state (`feature_covariance`, `covariance_released`), so a
    resumed or reloaded fit reuses it instead of paying for it again. A
    model that has taken private steps but holds no covariance (restored
    from a checkpoint older than its first step, with `PrivacyLedger`
    counting the steps after it) raises `LostReleaseError` before any
    release: the lost covariance was counted once, and a second one would
    not be.

    Example:

    >>> solver = DPFeatureCovariance(3, 2.0, budget_split=0.5, l2=None)
    >>> (covariance,), (gradient,) = solver.releases(1.0, planned_steps=2)
    >>> covariance.name, round(covariance.noise_multiplier, 6), gradient.name
    ('feature covariance', 1.0, 'logistic gradient')
    """

    name = "dp-fc"

    def releases(self, noise_multiplier, planned_steps):
        planned_steps = validation.check_positive_int(planned_steps, "planned_steps")
        second, first = self._split(noise_multiplier)
        cx = self.feature_clip_norm
        covariance = GaussianRelease.from_noise_multiplier(
            second / math.sqrt(planned_steps),
            stats.GRAM_SENSITIVITY * cx**2,
            self._named("feature covariance"),
        )
        gradient = GaussianRelease.from_noise_multiplier(
            first, stats.GRADIENT_SENSITIVITY * cx, self._named("logistic gradient")
        )
        return (covariance,), (gradient,)

    def mechanism(self, noise_multiplier, schedule, planned_steps):
        setup, per_step = self.releases(noise_multiplier, planned_steps)
        return _ScaledReleases(
            releases=per_step,
            population=schedule.population,
            unit=schedule.unit,
            clip_norm=self.feature_clip_norm,
            setup=setup,
        )

    def noise_multiplier_of(self, calibrated):
        # Calibration finds the gradient's multiplier, z / √(1 − s).
        return calibrated * math.sqrt(1 - self.budget_split)

    def build(self, model, dim):
        model.covariance = model.add_weight(
            shape=(dim, dim), initializer="zeros", trainable=False,
            name="feature_covariance",
        )  # fmt: skip
        model.covariance_released = model.add_weight(
            shape=(), dtype="int32", initializer="zeros", trainable=False,
            name="covariance_released",
        )  # fmt: skip

    def step(
        self, model, features, labels, rng, noise_multiplier, planned_steps,
        row_weights=None,
    ):  # fmt: skip
        released = int(keras.ops.convert_to_numpy(model.covariance_released))
        taken = protocol.read_private_steps(model)
        if not released and taken:
            raise LostReleaseError(
                f"This dp-fc model has taken {taken} private step(s) but holds "
                "no released feature covariance: the covariance an earlier "
                "run released (once, as its accounting counts) was lost, e.g. "
                "by restoring a checkpoint saved before its first step. "
                "Releasing it again would spend privacy that no statement "
                "counts. Restore a checkpoint saved after the first step, or "
                "train a new model (its ε adds to what this data has spent)."
            )
        (covariance_release,), (gradient_release,) = self.releases(
            noise_multiplier, planned_steps
        )
        dim = features.shape[1]
        gradient, _ = stats.logistic_statistics(
            features, labels, _kernel(model), self.feature_clip_norm, hessians=False,
            row_weights=row_weights,
        )  # fmt: skip
        gradient += host_noise.gaussian_noise(gradient_release, gradient.shape, rng)
        if not released:
            covariance = stats.gram(features, self.feature_clip_norm, row_weights)
            covariance += host_noise.symmetric_noise(covariance_release, dim, rng)
            model.covariance.assign(stats.make_psd(covariance).astype("float32"))
            model.covariance_released.assign(1)
        k = self.num_classes
        shared = np.asarray(keras.ops.convert_to_numpy(model.covariance), np.float64)
        shared = shared * ((1.0 / k) * (1.0 - 1.0 / k))  # Every class's block.
        self._newton_like_step(
            model, gradient, shared, covariance_release, model.schedule.population
        )


SOLVERS = {
    solver.name: solver for solver in (DPLeastSquares, DPNewton, DPFeatureCovariance)
}


class _ScaledReleases(privacy.GaussianReleases):
    """DP-FC's releases: calibration scales the one-off covariance too.

    Its share of the budget is fixed by `budget_split`, so the covariance
    noise moves with the gradient noise (`GaussianReleases` keeps setup
    releases fixed).
    """

    def with_noise_multiplier(self, noise_multiplier):
        noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
        scale = noise_multiplier / self.noise_multiplier
        return type(self)(
            releases=tuple(r.scaled(scale) for r in self.releases),
            population=self.population,
            unit=self.unit,
            clip_norm=self.clip_norm,
            setup=tuple(r.scaled(scale) for r in self.setup),
        )


def fit_loop(model, step, epochs, initial_epoch, verbose, callbacks):
    """Keras' epoch loop for one host step per epoch, with callbacks.

    Calls the callbacks as `Model.fit` does (train begin, epoch begin,
    batch begin and end, epoch end, train end; `History` and a progress
    bar) and stops when a callback sets `model.stop_training`.
    """
    callback_list = keras.callbacks.CallbackList(
        callbacks,
        add_history=True,
        add_progbar=verbose != 0,
        model=model,
        verbose=1 if verbose == "auto" else verbose,
        epochs=epochs,
        steps=1,
    )
    model.stop_training = False
    callback_list.on_train_begin()
    # A callback (BackupAndRestore) may have restored a later start.
    initial_epoch = getattr(model, "_initial_epoch", None) or initial_epoch
    logs = {}
    for epoch in range(initial_epoch, epochs):
        callback_list.on_epoch_begin(epoch)
        callback_list.on_train_batch_begin(0)
        logs = step()
        callback_list.on_train_batch_end(0, logs)
        epoch_logs = dict(logs)
        callback_list.on_epoch_end(epoch, epoch_logs)
        logs = epoch_logs
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history

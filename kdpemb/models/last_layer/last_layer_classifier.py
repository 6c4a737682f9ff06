"""`LastLayerDPClassifier`: a private linear head on frozen features.

Four methods (Mehta et al. 2022, 2023), each a small class that owns its
step, its releases and its accounting:

- "dp-sgd" (`last_layer_dp_sgd_head.DPSGDHead`): DP-SGD (or DP-Adam, DP-LAMB: any
  Keras optimizer) on a softmax head, a `train_step` run by Keras' `fit`.
  Each example's exact gradient norm comes from the features and
  residuals, so no per-example gradient is ever materialised. Poisson
  sampling with expected batch B, or one full batch per epoch.
- "dp-ls", "dp-newton", "dp-fc" (`last_layer_solvers`): ridge least
  squares, Newton steps and covariance-preconditioned steps from noisy
  float64 statistics computed on the host, one step per epoch.

This module is the front: settings, the schedule fixed by the first
`fit`, the privacy budget of a target ε, saving and prediction. With
`unit="user"` the guarantee is per user (`last_layer_users`).
"""

import math
import secrets

import keras
import numpy as np
from keras import ops

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import _validation as validation
from kdpemb.models._shared import (
    backends,
    data_parallel,
    frozen_settings,
    plan_resume,
    privacy_plan,
    private_state,
)
from kdpemb.models._shared.device_rows import DeviceRows
from kdpemb.models._shared.frozen_settings import FrozenSettings
from kdpemb.models._shared.optimizer_restore import RestoresOptimizer
from kdpemb.models.last_layer import (
    last_layer_inputs,
    last_layer_plan,
    last_layer_shipping,
    last_layer_users,
)
from kdpemb.models.last_layer.last_layer_dp_sgd_head import (
    DPSGDHead,
    dense_gradient_norms,
)
from kdpemb.models.last_layer.last_layer_solvers import SOLVERS, fit_loop
from kdpemb.privacy import protocol

METHOD_CLASSES = {DPSGDHead.name: DPSGDHead, **SOLVERS}
METHODS = tuple(METHOD_CLASSES)  # "dp-sgd", "dp-ls", "dp-newton", "dp-fc"
HEAD_INITS = ("zeros", "random")
__all__ = ["ClipFeatures", "LastLayerDPClassifier", "dense_gradient_norms"]


def _check_devices(model):
    """The devices a DP-SGD batch of `model` splits over (1 without a
    strategy or distribution), after refusing an engine DP-SGD does not
    support (`data_parallel.check_engine`) and a job of several hosts,
    before any step. The closed forms run on the host whatever the engine."""
    hosts = data_parallel.check_engine(
        model, "LastLayerDPClassifier", model._method.clips_gradients
    )
    if hosts.count > 1:
        raise ValueError(
            f"LastLayerDPClassifier trains on the devices of one host; this job "
            f"spans {hosts.count} hosts, each of which would fit (and noise) "
            "the head on its own. A linear head on features is cheap: extract "
            "the features where the images are (kdpemb.features.extract), "
            "bring them to one host and fit there (with its devices, or none)."
        )
    return data_parallel.device_count(model)


@keras.saving.register_keras_serializable(package="kdpemb")
class ClipFeatures(keras.layers.Layer):
    """Scales each feature vector to L2 norm at most `clip_norm`.

    >>> clipped = ClipFeatures(1.0)(np.array([[3.0, 4.0]], "float32"))
    >>> ops.convert_to_numpy(clipped).astype("float64").round(3).tolist()
    [[0.6, 0.8]]
    """

    def __init__(self, clip_norm, **kwargs):
        # In float32 under a mixed policy too, as the shipped model's ops.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.clip_norm = float(clip_norm)

    def call(self, features):
        return last_layer_shipping.clip_to_norm(features, self.clip_norm)

    def get_config(self):
        return {**super().get_config(), "clip_norm": self.clip_norm}


@keras.saving.register_keras_serializable(package="kdpemb")
class LastLayerDPClassifier(RestoresOptimizer, FrozenSettings, keras.Model):
    """A linear classifier on frozen features with example- or user-level DP.

    Args:
        num_classes: int >= 2. K, the number of classes.
        method: "dp-sgd" (default), "dp-ls", "dp-newton" or "dp-fc".
        clip_norm: float. DP-SGD's per-example gradient clip norm C.
            Defaults to 1.0 (dp-sgd only).
        feature_clip_norm: float or None. C_x: features are scaled to norm
            at most C_x in training and prediction. Required by the
            closed-form methods (their sensitivities are in C_x); optional
            for DP-SGD.
        noise_multiplier: float. Noise of one step over its sensitivity
            (DP-SGD: std z · C on the clipped sum). For the closed-form
            methods one step costs what a Gaussian with this multiplier
            costs, split between its statistics by `budget_split`. Give
            this or `target_epsilon` (then it holds the calibrated one
            after the first `fit`, None before).
        target_epsilon: float. Calibrate the smallest noise multiplier that
            keeps the run planned by the first `fit` within this ε at
            `delta`. Later fits may only take the planned steps not yet
            taken: a fit that would go past the target is refused.
        delta: float. δ for `target_epsilon` and the default δ of
            `privacy_statement` (below 1 / number of examples).
        head_init: "zeros" (default) or "random": kernel entries drawn
            from N(0, 1/d), as FedEmb's random heads.
        l2: float or None. Ridge penalty: the objective is the mean loss
            plus `l2 / 2 · ‖W‖²`. None: 0 for DP-SGD; for the closed-form
            methods a penalty at the scale of the noise on the
            second-order statistic (`2 σ √d`, data-independent).
        budget_split: float in (0, 1). The share of the budget spent on
            the second-order statistic (Gram matrix, Hessians, feature
            covariance); the rest goes to the first-order one (class sums,
            gradient). DP-FC spends `budget_split` of the whole planned
            run's budget on its one covariance release. Defaults to 0.5.
        unit: "example" (default) or "user": the guarantee covers all of
            one person's examples; `fit` then takes `users=` and each step
            gives each user one contribution, the mean over at most
            `examples_per_user` of their examples (chosen at random).
        examples_per_user: int. k, the public cap, with `unit="user"` only.
        seed: int or None. None draws the noise (and the sampling) from OS
            entropy; an int makes them reproducible and predictable, for
            tests only (warns `ReproducibleNoiseWarning`).
        schedule, planned_steps, calibrated_noise_multiplier: set by the
            first `fit` and saved with the model; not for you to pass.
            `schedule` is a `kdpemb.privacy.Schedule` (examples N, batch
            size B; or users U, B_u per step), `planned_steps` the steps
            the first fit planned, and `calibrated_noise_multiplier` the z
            found for `target_epsilon`.

    `fit(features, labels, batch_size=None, epochs=1)`: `batch_size=None`
    is one full-batch step per epoch; DP-SGD with an int samples batches of
    expected size `batch_size` (Poisson) for `round(N / batch_size)` steps
    per epoch. DP-Newton and DP-FC take one step per epoch; DP-LS takes its
    single step in one epoch. `compile(optimizer)` sets the optimizer of
    the iterative methods; the default is `SGD(1.0)` (a Newton step for
    DP-Newton). With `unit="user"`, `fit(features, labels, users=ids,
    batch_size=B_u)`: `batch_size` is the expected number of users per
    step (q = B_u / U over the U distinct ids; None: every user every step).
    Built in a `MirroredStrategy`'s scope (or under a JAX `DataParallel`),
    DP-SGD splits each batch over the devices, noised once; the closed
    forms compute on the host as on one device. One host only.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> labels = rng.integers(0, 3, 600)
    >>> features = rng.normal(size=(600, 8)) + 2 * np.eye(3, 8)[labels]
    >>> model = LastLayerDPClassifier(3, "dp-ls", feature_clip_norm=4.0,
    ...                               target_epsilon=1.0, delta=1e-4)
    >>> history = model.fit(features, labels, verbose=0)
    >>> accuracy = (model.predict(features, verbose=0).argmax(1) == labels).mean()
    >>> bool(accuracy > 0.6), round(model.privacy_statement().epsilon, 1)
    (True, 1.0)
    """

    _FROZEN_SETTINGS = frozenset(
        {
            "num_classes",
            "method",
            "clip_norm",
            "feature_clip_norm",
            "noise_multiplier",
            "target_epsilon",
            "delta",
            "head_init",
            "l2",
            "budget_split",
            "seed",
            "schedule",
            "planned_steps",
            "calibrated_noise_multiplier",
            "use_bias",
            "unit",
            "examples_per_user",
        }
    )

    def __init__(
        self,
        num_classes,
        method="dp-sgd",
        *,
        clip_norm=None,
        feature_clip_norm=None,
        noise_multiplier=None,
        target_epsilon=None,
        delta=None,
        head_init="zeros",
        l2=None,
        budget_split=0.5,
        seed=None,
        schedule=None,
        planned_steps=None,
        calibrated_noise_multiplier=None,
        unit="example",
        examples_per_user=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.unit, self.examples_per_user = last_layer_users.check_unit(
            unit, examples_per_user
        )
        self.num_classes = validation.check_positive_int(
            num_classes, "num_classes", "It is the number of classes, at least 2."
        )
        if self.num_classes < 2:
            raise ValueError(
                f"num_classes={num_classes!r}: a softmax head over one class "
                "predicts it for every input and learns nothing. Pass the "
                "number of classes, at least 2 (for a yes/no task, 2 with labels "
                "0 and 1)."
            )
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        self.method = method
        method_class = METHOD_CLASSES[method]
        if clip_norm is not None and not method_class.clips_gradients:
            raise ValueError(
                f"clip_norm is DP-SGD's gradient clip; {method} clips the "
                "features instead: pass feature_clip_norm."
            )
        self.clip_norm = validation.check_clip_norm(
            1.0 if clip_norm is None else clip_norm
        )
        if feature_clip_norm is None and method_class.needs_feature_clip_norm:
            raise ValueError(
                f"{method} releases sums of features, whose sensitivity is set "
                "by the feature norm: pass feature_clip_norm (C_x), e.g. a "
                "typical feature norm of public data."
            )
        self.feature_clip_norm = (
            None
            if feature_clip_norm is None
            else validation.check_positive(feature_clip_norm, "feature_clip_norm")
        )
        target_epsilon = privacy_plan.check_noise_or_target(
            noise_multiplier, target_epsilon, delta
        )
        delta = None if delta is None else validation.check_delta(delta)
        self.noise_multiplier = (
            None
            if noise_multiplier is None
            else validation.check_noise_multiplier(noise_multiplier)
        )
        self.target_epsilon = target_epsilon
        self.delta = delta
        if not isinstance(head_init, str) or head_init not in HEAD_INITS:
            raise ValueError(
                f"head_init must be one of {HEAD_INITS}, got {head_init!r}."
            )
        self.head_init = head_init
        if l2 is not None and not (
            validation.is_real(l2) and math.isfinite(l2) and l2 >= 0
        ):
            raise ValueError(f"l2 must be None or a finite float >= 0, got {l2!r}.")
        self.l2 = None if l2 is None else float(l2)
        if not (validation.is_real(budget_split) and 0 < budget_split < 1):
            raise ValueError(
                f"budget_split must be a float in (0, 1), got {budget_split!r}: the "
                "share of each step's budget spent on the second-order statistic "
                "(e.g. 0.5)."
            )
        self.budget_split = float(budget_split)
        self.seed = seed
        # Fixed by the first fit; later fits must keep N and B.
        (
            self.schedule,
            self.planned_steps,
            self.calibrated_noise_multiplier,
        ) = last_layer_plan.restored_plan(
            schedule, planned_steps, calibrated_noise_multiplier, noise_multiplier,
            self.examples_per_user,
        )  # fmt: skip
        if target_epsilon is not None:  # As DPModel's and FedEmbModel's.
            self.noise_multiplier = self.calibrated_noise_multiplier
        self._method = method_class.from_settings(
            num_classes=self.num_classes,
            clip_norm=self.clip_norm,
            feature_clip_norm=self.feature_clip_norm,
            budget_split=self.budget_split,
            l2=self.l2,
            examples_per_user=self.examples_per_user,
        )
        self.use_bias = self._method.use_bias
        self.head = keras.layers.Dense(
            self.num_classes,
            use_bias=self.use_bias,
            kernel_initializer=(
                "zeros"
                if head_init == "zeros"
                else keras.initializers.VarianceScaling(
                    1.0, "fan_in", "untruncated_normal"
                )  # N(0, 1/d)
            ),
            name="head",
        )
        self.clip_features = (
            None
            if self.feature_clip_norm is None
            else ClipFeatures(self.feature_clip_norm, name="clip_features")
        )
        self.private_steps = private_state.add_private_steps(self)
        (self.noise_seed,) = private_state.noise_seed_generators(
            seed, ("noise_seed",), "LastLayerDPClassifier"
        )
        self.covariance = None
        self._rows = DeviceRows()  # DP-SGD's training rows; never saved.
        self._loss_mean = keras.metrics.Mean(name="loss")
        self._accuracy_mean = keras.metrics.Mean(name="accuracy")
        self._freeze_settings()

    def build(self, input_shape):
        dim = int(input_shape[-1])
        self.head.build((None, dim))
        if self.clip_features is not None:
            self.clip_features.build((None, dim))
        self._method.build(self, dim)
        self.built = True

    def call(self, features, training=False):
        """Class scores (logits) of `features`, clipped as in training."""
        features = ops.cast(features, "float32")
        if self.clip_features is not None:
            features = self.clip_features(features)
        return self.head(features)

    def stack_on(self, backbone):
        """`backbone`, the feature clipping and a copy of the head: images → scores.

        A functional `keras.Model` of built-in Keras layers and ops only
        (the clipping is written with `keras.ops`, not `ClipFeatures`): its
        `.keras` file loads with `keras.saving.load_model` where kdpemb is
        not installed. The backbone's features must be as wide as the
        features the head was fitted on.
        """
        if not self.built:
            raise ValueError("Fit the classifier before stacking it on a backbone.")
        return last_layer_shipping.stack(backbone, self.head, self.feature_clip_norm)

    # -------------------------------------------------------- privacy --

    @property
    def step_noise_multiplier(self):
        """z of every step: `noise_multiplier` (the one given, or the one
        calibrated by the first fit for a `target_epsilon`)."""
        return self.noise_multiplier

    def privacy_mechanism(self):
        """The mechanism of one step (`kdpemb.privacy`); known after the first fit."""
        if self.schedule is None:
            raise ValueError(
                "The mechanism depends on the number of examples and the batch "
                "size: fit the classifier first."
            )
        return self._method.mechanism(
            self.step_noise_multiplier, self.schedule, self.planned_steps
        )

    def privacy_statement(self, delta=None, accountant=None):
        """The `PrivacyStatement` (unit: example, or user) of the steps taken so far.

        `delta` defaults to the model's `delta`.
        """
        return protocol.privacy_statement(self, delta, accountant)

    def _adopt_plan(self, plan):
        """Fixes the first fit's plan (set once, after the fit is accepted)."""
        schedule, planned, calibrated = plan
        if self.target_epsilon is not None:
            privacy_plan.adopt_first_plan(self, planned, calibrated, schedule=schedule)
        else:  # A fixed noise is planned too: the schedule, its steps.
            frozen_settings.adopt_plan(self, schedule=schedule, planned_steps=planned)

    # ------------------------------------------------------- training --

    def compile(self, optimizer=None, **kwargs):
        """`optimizer` drives DP-SGD, DP-Newton and DP-FC; defaults to SGD(1.0)."""
        if kwargs.get("loss") is not None:
            raise ValueError(
                "LastLayerDPClassifier computes its own loss; compile it without loss."
            )
        if optimizer is None:
            optimizer = keras.optimizers.SGD(1.0)
        kwargs["auto_scale_loss"] = False
        super().compile(optimizer=optimizer, **kwargs)

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_data=None,
        initial_epoch=0,
        users=None,
        **kwargs,
    ):
        """Trains the head on `x` (features [N, d]) and `y` (labels in [0, K));
        with `unit="user"`, `users` holds each example's user id."""
        privacy_plan.refuse_fit_arguments(
            kwargs, privacy_plan.SAMPLING_ARGUMENTS, "LastLayerDPClassifier"
        )
        devices = _check_devices(self)
        features, labels = last_layer_inputs.check_data(x, y, self.num_classes)
        if self.built and features.shape[1] != self.head.kernel.shape[0]:
            raise ValueError(
                f"features have {features.shape[1]} columns but this head was "
                f"built for {self.head.kernel.shape[0]}; pass features of the "
                "backbone it was trained on, or build a new LastLayerDPClassifier."
            )
        users, num_users = last_layer_users.check_users(self.unit, users, len(features))
        if self._method.clips_gradients:  # The noise is z · clip_norm.
            scale, scale_name = self.clip_norm, "clip_norm"
        else:
            scale, scale_name = self.feature_clip_norm, "feature_clip_norm"
        last_layer_inputs.warn_if_degenerate(features, scale, scale_name)
        epochs = last_layer_inputs.check_epochs(epochs, initial_epoch, self._method)
        if not self._method.sampled and (validation_data is not None or kwargs):
            raise ValueError(
                f"{self.method}.fit takes features, labels, epochs, verbose and "
                f"callbacks; got {sorted(kwargs) or ['validation_data']}. "
                "Evaluate with model.evaluate(features, labels) afterwards."
            )
        # Refused as the training features are (the one rule).
        finite_inputs.check_validation_data(validation_data, as_dtype="float32")
        plan_resume.look_up(self, callbacks)  # A killed run's plan, rerun.
        steps_per_epoch, plan = last_layer_plan.first_fit_plan(
            self, self._method, len(features), batch_size, epochs - initial_epoch,
            privacy_plan.is_verbose({"verbose": verbose, "callbacks": callbacks}),
            num_users,
        )  # fmt: skip
        with data_parallel.engine_scope(self):  # Replicated variables.
            if not self.built:
                self.build(features.shape)
            if not self.compiled:
                self.compile()
            if devices > 1 and not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)
        if plan is not None:
            self._adopt_plan(plan)
        privacy_plan.check_later_fit(
            self, steps_per_epoch * (epochs - initial_epoch), "steps",
            remedy="a larger target_epsilon (or a fixed noise_multiplier)",
        )  # fmt: skip

        # Checked again once the callbacks have begun: one may restore
        # steps (BackupAndRestore); a plan fixed by this fit is then undone.
        callbacks = privacy_plan.guard_epochs(
            self, callbacks, steps_per_epoch, epochs, initial_epoch,
            calibrated=plan is not None and self.target_epsilon is not None,
        )  # fmt: skip
        private_state.reseed([self.noise_seed], self.seed)
        if not self._method.sampled:  # One host step per epoch.
            return fit_loop(
                self,
                lambda: self._closed_form_step(features, labels, users),
                epochs,
                initial_epoch,
                verbose,
                callbacks,
            )
        self._denominator = float(batch_size or self.schedule.population)
        seed = (
            None
            if self.seed is None
            else [self.seed, protocol.read_private_steps(self)]
        )
        batches = last_layer_users.sampler_batches(
            self, features, labels, users, batch_size, steps_per_epoch,
            epochs - initial_epoch, seed, devices,
        )  # fmt: skip
        return super().fit(
            batches,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            verbose=verbose,
            callbacks=callbacks,
            validation_data=validation_data,
            initial_epoch=initial_epoch,
            shuffle=False,
            **kwargs,
        )

    def train_on_batch(self, *args, **kwargs):
        raise NotImplementedError(
            "LastLayerDPClassifier trains only through fit: a batch you choose "
            "is not a Poisson sample, and a step outside fit escapes the "
            "planned schedule and the target ε."
        )

    def train_step(self, *args):
        # TensorFlow calls train_step(data); JAX calls train_step(state, data).
        return backends.current().train_step(self, args, self._dp_sgd_step)

    def _dp_sgd_step(self, data):
        return self._method.train_step(
            self, data, self.step_noise_multiplier, self._denominator
        )

    def _closed_form_step(self, features, labels, users):
        if self.seed is None:
            rng = np.random.default_rng(secrets.randbits(128))
        else:
            rng = np.random.default_rng([self.seed, protocol.read_private_steps(self)])
        weights = (  # Each user's mean over at most k examples.
            None
            if users is None
            else last_layer_users.user_weights(users, self.examples_per_user, rng)
        )
        self._method.step(
            self, features, labels, rng, self.step_noise_multiplier,
            self.planned_steps, weights,
        )  # fmt: skip
        self.private_steps.assign_add(1)
        return {"private_steps": protocol.read_private_steps(self)}

    @property
    def metrics(self):
        if not hasattr(self, "_accuracy_mean"):
            return []
        return [self._loss_mean, self._accuracy_mean]

    def test_step(self, *args):
        # TensorFlow calls test_step(data); JAX calls test_step(state, data).
        return backends.current().test_step(self, args, self._test_batch)

    def _test_batch(self, data):
        features, labels = data[0], data[1]
        logits = self(features)
        labels = ops.cast(labels, "int32")
        loss = keras.losses.sparse_categorical_crossentropy(
            labels, logits, from_logits=True
        )
        correct = ops.cast(ops.argmax(logits, axis=-1) == labels, "float32")
        self._loss_mean.update_state(loss)
        self._accuracy_mean.update_state(correct)
        return {
            "loss": self._loss_mean.result(),
            "accuracy": self._accuracy_mean.result(),
        }

    # ---------------------------------------------------------- saving --

    def get_config(self):
        return {
            **super().get_config(),
            "num_classes": self.num_classes,
            "method": self.method,
            "clip_norm": self.clip_norm if self._method.clips_gradients else None,
            "feature_clip_norm": self.feature_clip_norm,
            # A calibrated z is saved as calibrated_noise_multiplier.
            "noise_multiplier": (
                self.noise_multiplier if self.target_epsilon is None else None
            ),
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "head_init": self.head_init,
            "l2": self.l2,
            "budget_split": self.budget_split,
            "seed": None,  # Never saved: a loaded model draws fresh noise.
            "schedule": None if self.schedule is None else self.schedule.get_config(),
            "planned_steps": self.planned_steps,
            "calibrated_noise_multiplier": self.calibrated_noise_multiplier,
            "unit": self.unit,
            "examples_per_user": self.examples_per_user,
        }

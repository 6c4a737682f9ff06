"""`LastLayerDPClassifier`: a private linear head on frozen features.

Four methods (DESIGN.md section 3; Mehta et al. 2022, 2023):

- "dp-sgd": DP-SGD (or DP-LAMB, DP-Adam: any Keras optimizer) on a
  softmax head, zero-initialised by default. The per-example gradient of a
  dense layer is the outer product `x (p − y)ᵀ`, so each example's exact
  gradient norm is `‖p − y‖ · (‖x‖² + 1)^½` (the 1 for the bias) and the
  clipped sum is one matrix product: no per-example gradient is ever
  materialised. Poisson sampling with expected batch B, or one full batch
  per epoch (`batch_size=None`).
- "dp-ls": ridge least squares on one-hot targets from the noisy Gram
  matrix and noisy per-class feature sums.
- "dp-newton": Newton steps on the multinomial logistic loss from a
  noisy gradient and noisy per-class Hessian blocks at every step.
- "dp-fc": the feature covariance, released once, preconditions noisy
  logistic gradient steps for every class and every step.

The closed-form statistics are computed in float64 NumPy
(`last_layer_stats`); DP-SGD is a `train_step` in `keras.ops`.
"""

import math
import secrets
import warnings

import keras
import numpy as np
from keras import ops

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.errors import ReproducibleNoiseWarning
from kdpemb.models import backends
from kdpemb.models import last_layer_stats as stats
from kdpemb.models.device_rows import DeviceRows
from kdpemb.models.frozen_settings import FrozenSettings
from kdpemb.models.optimizer_restore import RestoresOptimizer
from kdpemb.privacy import gaussian_sum, protocol

METHODS = ("dp-sgd", "dp-ls", "dp-newton", "dp-fc")
HEAD_INITS = ("zeros", "random")


@keras.saving.register_keras_serializable(package="kdpemb")
class ClipFeatures(keras.layers.Layer):
    """Scales each feature vector to L2 norm at most `clip_norm`.

    >>> clipped = ClipFeatures(1.0)(np.array([[3.0, 4.0]], "float32"))
    >>> ops.convert_to_numpy(clipped).astype("float64").round(3).tolist()
    [[0.6, 0.8]]
    """

    def __init__(self, clip_norm, **kwargs):
        super().__init__(**kwargs)
        self.clip_norm = float(clip_norm)

    def call(self, features):
        features = ops.cast(features, "float32")
        norms = ops.sqrt(ops.sum(ops.square(features), axis=-1, keepdims=True))
        return features * ops.minimum(1.0, self.clip_norm / ops.maximum(norms, 1e-30))

    def get_config(self):
        return {**super().get_config(), "clip_norm": self.clip_norm}


def dense_gradient_norms(features, residuals, use_bias=True):
    """Exact per-example L2 norms of a dense layer's gradient.

    For logits `z = x W + b` and a loss with `∂ℓ/∂z = r`, example i's
    gradient is `(x_i r_iᵀ, r_i)`, whose norm is
    `‖r_i‖ · (‖x_i‖² + 1)^½` (without the 1 when there is no bias).

    Args:
        features: [B, d]. The layer's inputs.
        residuals: [B, K]. `∂ℓ_i/∂z_i` (for softmax cross-entropy, p − y).
        use_bias: bool.

    Returns:
        [B] norms, in the wider of the two inputs' float dtypes.

    Example:

    >>> norms = dense_gradient_norms(np.array([[3.0, 4.0]]),
    ...                              np.array([[1.0, 0.0]]), use_bias=False)
    >>> ops.convert_to_numpy(norms).tolist()
    [5.0]
    """
    features, residuals = (
        ops.convert_to_tensor(features),
        ops.convert_to_tensor(residuals),
    )
    dtype = keras.backend.result_type(features.dtype, residuals.dtype, float)
    features, residuals = ops.cast(features, dtype), ops.cast(residuals, dtype)
    squared_x = ops.sum(ops.square(features), axis=-1)
    if use_bias:
        squared_x = squared_x + 1.0
    return ops.sqrt(ops.sum(ops.square(residuals), axis=-1) * squared_x)


@keras.saving.register_keras_serializable(package="kdpemb")
class LastLayerDPClassifier(RestoresOptimizer, FrozenSettings, keras.Model):
    """A linear classifier on frozen features with example-level DP.

    Args:
        num_classes: int. K.
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
            this or `target_epsilon`.
        target_epsilon: float. Calibrate the smallest noise multiplier that
            keeps the schedule planned by the first `fit` within this ε at
            `delta`.
        delta: float. δ for `target_epsilon` (below 1 / number of examples).
        head_init: "zeros" (default) or "random" (Glorot uniform).
        l2: float or None. Ridge penalty: the objective is the mean loss
            plus `l2 / 2 · ‖W‖²`. None: 0 for DP-SGD; for the closed-form
            methods a penalty at the scale of the noise on the
            second-order statistic (`2 σ √d`, data-independent).
        budget_split: float in (0, 1). The share of the budget spent on
            the second-order statistic (Gram matrix, Hessians, feature
            covariance); the rest goes to the first-order one (class sums,
            gradient). DP-FC spends `budget_split` of the whole planned
            run's budget on its one covariance release. Defaults to 0.5.
        seed: int or None. None draws the noise (and the sampling) from OS
            entropy; an int makes them reproducible and predictable, for
            tests only (warns `ReproducibleNoiseWarning`).

    `fit(features, labels, batch_size=None, epochs=1)`: `batch_size=None`
    is one full-batch step per epoch; DP-SGD with an int samples batches of
    expected size `batch_size` (Poisson) for `round(N / batch_size)` steps
    per epoch. DP-Newton and DP-FC take one step per epoch; DP-LS takes its
    single step in one epoch. `compile(optimizer)` sets the optimizer of
    the iterative methods; the default is `SGD(1.0)` (a Newton step for
    DP-Newton).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> labels = rng.integers(0, 3, 600)
    >>> features = rng.normal(size=(600, 8)) + 2 * np.eye(3, 8)[labels]
    >>> model = LastLayerDPClassifier(3, "dp-ls", feature_clip_norm=4.0,
    ...                               target_epsilon=1.0, delta=1e-4)
    >>> history = model.fit(features, labels, verbose=0)
    >>> accuracy = (model.predict(features, verbose=0).argmax(1) == labels).mean()
    >>> bool(accuracy > 0.6), round(model.privacy_statement(1e-4).epsilon, 1)
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
            "use_bias",
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
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_classes = validation.check_positive_int(num_classes, "num_classes")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        self.method = method
        if clip_norm is not None and method != "dp-sgd":
            raise ValueError(
                f"clip_norm is DP-SGD's gradient clip; {method} clips the "
                "features instead: pass feature_clip_norm."
            )
        self.clip_norm = validation.check_clip_norm(
            1.0 if clip_norm is None else clip_norm
        )
        if feature_clip_norm is None and method != "dp-sgd":
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
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError(
                "Pass exactly one of noise_multiplier and target_epsilon (with "
                f"delta); got noise_multiplier={noise_multiplier!r}, "
                f"target_epsilon={target_epsilon!r}."
            )
        if target_epsilon is not None:
            validation.check_target_epsilon(target_epsilon)
            if delta is None:
                raise ValueError("target_epsilon needs delta.")
        self.noise_multiplier = (
            None
            if noise_multiplier is None
            else validation.check_noise_multiplier(noise_multiplier)
        )
        self.target_epsilon = target_epsilon
        self.delta = delta
        if head_init not in HEAD_INITS:
            raise ValueError(
                f"head_init must be one of {HEAD_INITS}, got {head_init!r}."
            )
        self.head_init = head_init
        if l2 is not None and not (isinstance(l2, (int, float)) and l2 >= 0):
            raise ValueError(f"l2 must be None or a float >= 0, got {l2!r}.")
        self.l2 = l2
        if not 0 < budget_split < 1:
            raise ValueError(f"budget_split must be in (0, 1), got {budget_split!r}.")
        self.budget_split = float(budget_split)
        self.seed = seed
        if seed is not None:
            warnings.warn(
                f"LastLayerDPClassifier(seed={seed!r}) fixes the DP noise and "
                "sampling: the guarantee is void. Use seed=None for a model you "
                "release.",
                ReproducibleNoiseWarning,
                stacklevel=2,
            )
        # Fixed by the first fit: examples N, batch size B, noise multiplier
        # z and the planned steps; later fits must keep N and B.
        self.schedule = None if schedule is None else dict(schedule)

        self.use_bias = method == "dp-sgd"
        self.head = keras.layers.Dense(
            self.num_classes,
            use_bias=self.use_bias,
            kernel_initializer="zeros" if head_init == "zeros" else "glorot_uniform",
            name="head",
        )
        self.clip_features = (
            None
            if self.feature_clip_norm is None
            else ClipFeatures(self.feature_clip_norm, name="clip_features")
        )
        self.private_steps = self.add_weight(
            shape=(),
            dtype="int32",
            initializer="zeros",
            trainable=False,
            aggregation="only_first_replica",
            name="private_steps",
        )
        self.noise_seed = keras.random.SeedGenerator(seed or 0, name="noise_seed")
        if seed is None:
            gaussian_sum.reseed_from_entropy(self.noise_seed)
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
        if self.method == "dp-fc":
            # The released covariance is model state: a resumed fit reuses
            # it instead of releasing (and paying for) it again.
            self.covariance = self.add_weight(
                shape=(dim, dim), initializer="zeros", trainable=False,
                name="feature_covariance",
            )  # fmt: skip
            self.covariance_released = self.add_weight(
                shape=(), dtype="int32", initializer="zeros", trainable=False,
                name="covariance_released",
            )  # fmt: skip
        self.built = True

    def call(self, features, training=False):
        """Class scores (logits) of `features`, clipped as in training."""
        features = ops.cast(features, "float32")
        if self.clip_features is not None:
            features = self.clip_features(features)
        return self.head(features)

    def stack_on(self, backbone):
        """`backbone`, the feature clipping and a copy of the head: images → scores."""
        if not self.built:
            raise ValueError("Fit the classifier before stacking it on a backbone.")
        inputs = keras.Input(backbone.input_shape[1:])
        features = backbone(inputs)
        if self.feature_clip_norm is not None:
            features = ClipFeatures(self.feature_clip_norm)(features)
        head = keras.layers.Dense.from_config(self.head.get_config())
        outputs = head(features)
        head.set_weights(self.head.get_weights())
        return keras.Model(inputs, outputs, name=f"{backbone.name}_dp_head")

    # -------------------------------------------------------- privacy --

    def _stds(self, noise_multiplier, planned_steps):
        """Noise std of each statistic; see `_releases`."""
        z, split = noise_multiplier, self.budget_split
        cx = self.feature_clip_norm
        if self.method == "dp-ls":
            return {
                "Gram matrix": (z / math.sqrt(split) * cx**2, cx**2),
                "per-class feature sums": (z / math.sqrt(1 - split) * cx, cx),
            }
        gradient = stats.GRADIENT_SENSITIVITY * cx
        if self.method == "dp-newton":
            hessians = stats.HESSIANS_SENSITIVITY * cx**2
            return {
                "per-class Hessians": (z / math.sqrt(split) * hessians, hessians),
                "logistic gradient": (z / math.sqrt(1 - split) * gradient, gradient),
            }
        # dp-fc: the covariance takes `split` of the planned run's budget.
        covariance = stats.GRAM_SENSITIVITY * cx**2
        return {
            "feature covariance": (
                z / math.sqrt(split * planned_steps) * covariance,
                covariance,
            ),
            "logistic gradient": (z / math.sqrt(1 - split) * gradient, gradient),
        }

    def _mechanism(self, noise_multiplier, schedule):
        num_examples = schedule["num_examples"]
        if self.method == "dp-sgd":
            if schedule["batch_size"] is None:
                return privacy.full_batch(
                    noise_multiplier, num_examples, clip_norm=self.clip_norm
                )
            return privacy.dp_sgd(
                noise_multiplier,
                schedule["batch_size"],
                num_examples,
                clip_norm=self.clip_norm,
            )
        releases = [
            privacy.GaussianRelease(std, sensitivity, name)
            for name, (std, sensitivity) in self._stds(
                noise_multiplier, schedule["planned_steps"]
            ).items()
        ]
        if self.method == "dp-fc":
            return _ScaledReleases(
                releases=releases[1:],
                population=num_examples,
                clip_norm=self.feature_clip_norm,
                setup=releases[:1],
            )
        return privacy.gaussian_releases(
            releases, num_examples, clip_norm=self.feature_clip_norm
        )

    def privacy_mechanism(self):
        """The mechanism of one step (`kdpemb.privacy`); known after the first fit."""
        if self.schedule is None:
            raise ValueError(
                "The mechanism depends on the number of examples and the batch "
                "size: fit the classifier first."
            )
        return self._mechanism(self.schedule["noise_multiplier"], self.schedule)

    def privacy_statement(self, delta=None, accountant="pld"):
        """The `PrivacyStatement` (unit: example) of the steps taken so far."""
        delta = self.delta if delta is None else delta
        if delta is None:
            raise ValueError("Pass delta (or give the model one).")
        return protocol.privacy_statement(self, delta, accountant)

    def _plan(self, num_examples, batch_size, epochs):
        """Fixes the schedule at the first fit; checks later fits against it."""
        if self.method != "dp-sgd" and batch_size is not None:
            raise ValueError(
                f"{self.method} uses all the data at every step: fit it with "
                "batch_size=None."
            )
        if batch_size is not None:
            batch_size = validation.check_positive_int(batch_size, "batch_size")
            if batch_size > num_examples:
                raise ValueError(
                    f"batch_size={batch_size} exceeds the {num_examples} examples; "
                    "use batch_size=None for full-batch steps."
                )
        steps_per_epoch = (
            1 if batch_size is None else max(1, round(num_examples / batch_size))
        )
        if self.schedule is not None:
            for name, value in (
                ("num_examples", num_examples),
                ("batch_size", batch_size),
            ):
                if self.schedule[name] != value:
                    raise ValueError(
                        f"This classifier was trained with {name}="
                        f"{self.schedule[name]}; fitting with {value} would change "
                        "the mechanism of the steps already counted. Keep the data "
                        "and batch size, or start a new classifier."
                    )
            return steps_per_epoch
        schedule = {
            "num_examples": num_examples,
            "batch_size": batch_size,
            "planned_steps": epochs * steps_per_epoch,
        }
        if self.delta is not None:
            validation.check_delta(self.delta, num_examples, "example")
        z = self.noise_multiplier
        if z is None:
            z = privacy.calibrate_noise_multiplier(
                self._mechanism(1.0, schedule),
                target_epsilon=self.target_epsilon,
                delta=self.delta,
                steps=schedule["planned_steps"],
            )
            if self.method == "dp-fc":  # Calibrated on the gradient's multiplier.
                z *= math.sqrt(1 - self.budget_split)
        schedule["noise_multiplier"] = float(z)
        with self._settings_unfrozen():
            self.schedule = schedule
        return steps_per_epoch

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
        **kwargs,
    ):
        """Trains the head on `x` (features [N, d]) and `y` (labels in [0, K))."""
        for name in (
            "sample_weight",
            "class_weight",
            "validation_split",
            "steps_per_epoch",
        ):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"LastLayerDPClassifier.fit does not take {name}: it would "
                    "change each example's contribution or the sampling that "
                    "the privacy accounting assumes."
                )
        _check_single_device()
        features, labels = _check_data(x, y, self.num_classes)
        epochs = validation.check_positive_int(epochs, "epochs")
        if self.method == "dp-ls" and epochs - initial_epoch != 1:
            raise ValueError(
                "dp-ls solves in one step: fit it with epochs=1 (each further "
                "fit would release the statistics again)."
            )
        if self.method != "dp-sgd" and (validation_data is not None or kwargs):
            raise ValueError(
                f"{self.method}.fit takes features, labels, epochs, verbose and "
                f"callbacks; got {sorted(kwargs) or ['validation_data']}. "
                "Evaluate with model.evaluate(features, labels) afterwards."
            )
        steps_per_epoch = self._plan(len(features), batch_size, epochs - initial_epoch)
        if not self.built:
            self.build(features.shape)
        if not self.compiled:
            self.compile()
        if self.seed is None:
            gaussian_sum.reseed_from_entropy(self.noise_seed)
        if self.method == "dp-sgd":
            self._denominator = float(batch_size or len(features))
            seed = None if self.seed is None else [self.seed, self._steps_taken()]
            batches = self._batches(
                features, labels, batch_size, steps_per_epoch,
                epochs - initial_epoch, seed,
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
        return self._fit_closed_form(
            features, labels, epochs, initial_epoch, verbose, callbacks
        )

    def _batches(self, features, labels, batch_size, steps, epochs, seed):
        """DP-SGD's Poisson batches: indices of rows kept on the device, or
        rows gathered on the host when the device has no room for them."""
        from kdpemb.data.poisson_batches import PoissonBatches, PoissonIndices

        backend = backends.current()
        if self._rows.hold(features, labels):
            sampler = PoissonIndices(
                len(features), batch_size, steps, seed, backend.BATCH_PADDING
            )
            batches = self._rows.batches(sampler, epochs)
        else:
            warnings.warn(
                f"The {features.nbytes / 2**20:.0f} MiB of features do not fit "
                "in device memory: each DP-SGD step gathers its batch on the "
                "host instead, which is slower.",
                stacklevel=3,
            )
            batches = PoissonBatches(features, labels, batch_size, steps, seed=seed)
        if self._rows.retrace:  # The step reads its rows another way now.
            self.train_function = None
        return batches

    def _steps_taken(self):
        return int(keras.ops.convert_to_numpy(self.private_steps.value))

    def train_step(self, *args):
        # TensorFlow calls train_step(data); JAX calls train_step(state, data).
        return backends.current().train_step(self, args, self._dp_sgd_step)

    def _dp_sgd_step(self, data):
        features, labels, mask = (
            self._rows.gather(data) if self._rows.on_device else data
        )
        features = ops.cast(features, "float32")
        if self.clip_features is not None:
            features = self.clip_features(features)
        kernel, bias = self.head.kernel, self.head.bias
        probs = ops.softmax(ops.matmul(features, kernel) + bias)
        one_hot = ops.one_hot(ops.cast(labels, "int32"), self.num_classes)
        mask = ops.cast(mask, "float32")[:, None]
        residuals = (probs - one_hot) * mask
        norms = dense_gradient_norms(features, residuals, use_bias=True)
        scale = ops.minimum(1.0, self.clip_norm / ops.maximum(norms, 1e-30))
        clipped = residuals * scale[:, None]
        grad_kernel = ops.einsum("bd,bk->dk", features, clipped)
        grad_bias = ops.sum(clipped, axis=0)
        stddev = self.schedule["noise_multiplier"] * self.clip_norm
        if stddev > 0:
            # Fresh, independent draws for every coordinate and step, in one
            # draw: the kernel's rows, then the bias.
            noise = keras.random.normal(
                (kernel.shape[0] + 1, self.num_classes),
                stddev=stddev,
                seed=self.noise_seed,
            )
            grad_kernel += noise[:-1]
            grad_bias += noise[-1]
        l2 = self.l2 or 0.0
        grads = [
            grad_kernel / self._denominator + l2 * kernel,
            grad_bias / self._denominator,
        ]
        self.optimizer.apply(grads, [kernel, bias])
        self.private_steps.assign_add(1)
        return {"private_steps": self.private_steps.value}

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

    # -------------------------------------------- closed-form methods --

    def _rng(self):
        if self.seed is None:
            return np.random.default_rng(secrets.randbits(128))
        return np.random.default_rng([self.seed, self._steps_taken()])

    def _ridge(self, second_order_std, num_examples, dim):
        if self.l2 is not None:
            return self.l2 * num_examples
        return max(2.0 * second_order_std * math.sqrt(dim), 1e-6 * num_examples)

    def _fit_closed_form(
        self, features, labels, epochs, initial_epoch, verbose, callbacks
    ):
        callback_list = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            model=self,
            verbose=1 if verbose == "auto" else verbose,
            epochs=epochs,
            steps=1,
        )
        self.stop_training = False
        callback_list.on_train_begin()
        logs = {}
        for epoch in range(initial_epoch, epochs):
            callback_list.on_epoch_begin(epoch)
            callback_list.on_train_batch_begin(0)
            self._closed_form_step(features, labels)
            logs = {"private_steps": self._steps_taken()}
            callback_list.on_train_batch_end(0, logs)
            epoch_logs = dict(logs)
            callback_list.on_epoch_end(epoch, epoch_logs)
            logs = epoch_logs
            if self.stop_training:
                break
        callback_list.on_train_end(logs)
        return self.history

    def _closed_form_step(self, features, labels):
        rng = self._rng()
        n, dim = features.shape
        cx = self.feature_clip_norm
        stds = {
            name: std
            for name, (std, _) in self._stds(
                self.schedule["noise_multiplier"], self.schedule["planned_steps"]
            ).items()
        }
        weights = np.asarray(keras.ops.convert_to_numpy(self.head.kernel), np.float64)
        if self.method == "dp-ls":
            gram = stats.gram(features, cx) + stats.symmetric_noise(
                rng, dim, stds["Gram matrix"]
            )
            sums = stats.class_sums(features, labels, self.num_classes, cx)
            sums += stats.gaussian_noise(
                rng, sums.shape, stds["per-class feature sums"]
            )
            ridge = self._ridge(stds["Gram matrix"], n, dim)
            new = stats.solve_ridge(stats.make_psd(gram), sums, ridge)
            self.head.kernel.assign(new.astype("float32"))
        else:
            gradient, hessians = stats.logistic_statistics(
                features, labels, weights, cx, hessians=self.method == "dp-newton"
            )
            gradient += stats.gaussian_noise(
                rng, gradient.shape, stds["logistic gradient"]
            )
            if self.method == "dp-newton":
                second_std = stds["per-class Hessians"]
                hessians += stats.symmetric_noise(
                    rng, dim, second_std, count=self.num_classes
                )
                curvature = stats.make_psd(hessians)
            else:
                second_std = stds["feature covariance"]
                if not int(keras.ops.convert_to_numpy(self.covariance_released)):
                    covariance = stats.gram(features, cx) + stats.symmetric_noise(
                        rng, dim, second_std
                    )
                    self.covariance.assign(stats.make_psd(covariance).astype("float32"))
                    self.covariance_released.assign(1)
                # The Hessian blocks of a zero head are p(1 − p) X̃ᵀX̃ with
                # p = 1/K: the released covariance stands in for all of them.
                k = self.num_classes
                shared = np.asarray(
                    keras.ops.convert_to_numpy(self.covariance), np.float64
                ) * ((1.0 / k) * (1.0 - 1.0 / k))
                curvature = np.broadcast_to(shared, (k, dim, dim))
            ridge = self._ridge(second_std, n, dim)
            direction = np.stack(
                [
                    stats.solve_ridge(
                        curvature[c], gradient[:, c] + ridge * weights[:, c], ridge
                    )
                    for c in range(self.num_classes)
                ],
                axis=1,
            )
            self.optimizer.apply(
                [ops.convert_to_tensor(direction.astype("float32"))],
                [self.head.kernel],
            )
        self.private_steps.assign_add(1)

    # ---------------------------------------------------------- saving --

    def get_config(self):
        return {
            **super().get_config(),
            "num_classes": self.num_classes,
            "method": self.method,
            "clip_norm": self.clip_norm if self.method == "dp-sgd" else None,
            "feature_clip_norm": self.feature_clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "head_init": self.head_init,
            "l2": self.l2,
            "budget_split": self.budget_split,
            "seed": None,  # Never saved: a loaded model draws fresh noise.
            "schedule": self.schedule,
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
            releases=_scaled(self.releases, scale),
            population=self.population,
            unit=self.unit,
            clip_norm=self.clip_norm,
            setup=_scaled(self.setup, scale),
        )


def _scaled(releases, scale):
    return tuple(
        privacy.GaussianRelease(r.noise_std * scale, r.sensitivity, r.name)
        for r in releases
    )


def _check_single_device():
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if (
            tf.distribute.has_strategy()
            and tf.distribute.get_strategy().num_replicas_in_sync > 1
        ):
            raise ValueError(
                "LastLayerDPClassifier trains on one device (a linear head is "
                "cheap); build and fit it outside the tf.distribute strategy scope."
            )
    if keras.distribution.distribution() is not None:
        raise ValueError(
            "LastLayerDPClassifier trains on one device; fit it with no "
            "keras.distribution set."
        )


def _check_data(features, labels, num_classes):
    """Features as finite float32 [N, d] and labels as int32 in [0, K)."""
    if features is None or labels is None:
        raise ValueError("fit takes features (x) and labels (y) as arrays.")
    if not hasattr(features, "shape") or not hasattr(labels, "shape"):
        raise ValueError(
            "LastLayerDPClassifier.fit takes NumPy arrays of features and labels "
            f"(got {type(features).__name__}); compute them with "
            "kdpemb.features.extract. A dataset would hide the sampling that the "
            "accounting assumes."
        )
    features = np.asarray(features)
    labels = np.asarray(labels)
    if features.ndim != 2:
        raise ValueError(
            f"features must be [num_examples, dim], got shape {features.shape}; "
            "pool or flatten the backbone's output."
        )
    if not np.issubdtype(features.dtype, np.number) or np.issubdtype(
        features.dtype, np.complexfloating
    ):
        raise ValueError(f"features must be real numbers, got dtype {features.dtype}.")
    if len(features) == 0:
        raise ValueError("features is empty: there is nothing to train on.")
    finite = np.isfinite(features).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(
            f"{len(bad)} feature rows hold NaN or infinite values (first: row "
            f"{bad[0]}); fix the backbone or drop those examples before training."
        )
    if labels.shape != (len(features),):
        raise ValueError(
            f"labels must have shape ({len(features)},) to match the features, got "
            f"{labels.shape}."
        )
    if not np.issubdtype(labels.dtype, np.integer) and (
        not np.issubdtype(labels.dtype, np.floating)
        or np.any(labels != np.round(labels))
    ):
        raise ValueError(
            f"labels must be integer class indices, got dtype {labels.dtype}."
        )
    if labels.min() < 0 or labels.max() >= num_classes:
        bad = labels[(labels < 0) | (labels >= num_classes)][0]
        raise ValueError(
            f"label {bad} is out of range for num_classes={num_classes}: labels "
            f"must be in [0, {num_classes})."
        )
    return features.astype(np.float32, copy=False), labels.astype(np.int32)

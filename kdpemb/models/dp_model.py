"""`DPModel`: example-level DP-SGD for any Keras model, with any optimizer.

`DPModel(network, ...)` wraps a Keras model (Sequential, functional or
subclassed); its `fit` is DP-SGD: Poisson-sampled logical batches of
expected size B (split into physical batches of `physical_batch_size`
whose clipped gradients are summed), each example's gradient clipped to
`clip_norm` (ghost clipping where the layers allow it,
`kdpemb.models.clipped_gradients`), Gaussian noise of std z · C added once
to the sum, division by B, and the compiled optimizer (SGD, Adam, LAMB, …).
It implements kdpemb's privacy protocol, so `PrivacyBudget`,
`privacy_statement()` and calibration from a `target_epsilon` work as for
the other models. Training logs only `private_steps`: a loss on the
private batch would be a release without noise.
"""

import keras
import numpy as np
from keras import ops

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.datasets import inputs
from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.models import backbone_checks, backends, privacy_plan, private_state
from kdpemb.models.clipped_gradients import (
    MODES,
    ClippedGradients,
    logger,
    plan_gradients,
)
from kdpemb.models.frozen_settings import FrozenSettings
from kdpemb.privacy import gaussian_sum, protocol

SAMPLINGS = ("poisson", "fixed")
__all__ = ["DPModel"]


@keras.saving.register_keras_serializable(package="kdpemb")
class DPModel(FrozenSettings, keras.Model):
    """A Keras model trained with example-level DP-SGD.

    Args:
        network: the `keras.Model` to train. Every layer must treat the
            examples of a batch independently: a trainable
            BatchNormalization is refused (`kdpemb.models.replace_batchnorm`
            swaps it for GroupNormalization).
        clip_norm: float. C, the L2 bound of one example's gradient (over
            all trainable variables). Defaults to 1.0.
        noise_multiplier: float. z: noise of std z · C on the clipped sum.
            Give this or `target_epsilon`.
        target_epsilon: float. Calibrate z so that the steps planned by the
            first `fit` (or `planned_steps`) spend this ε at `delta`; fits
            past the plan are refused.
        delta: float. δ of `target_epsilon` and of `privacy_statement`
            (well below 1 / number of examples).
        physical_batch_size: int or None. Examples whose gradients are
            computed at once; a logical batch is split into such chunks and
            their clipped sums added before the noise (gradient
            accumulation: a logical batch of 4,096 on a small device). None:
            the whole logical batch at once.
        sampling: "poisson" (default: each example joins a step with
            probability B / N, add-or-remove accounting) or "fixed" (exactly
            B examples; replace-one accounting, RDP accountant).
        per_layer_clipping: bool. Clip each layer's part of an example's
            gradient to C / √L (L layers with weights) instead of the whole
            gradient to C; the sensitivity is C either way.
        gradient_method: "auto" (default: ghost norms for Dense,
            EinsumDense, Conv1D/2D, Embedding, LayerNormalization and
            GroupNormalization, a vectorised per-example gradient for other
            layers, or of the whole model if it cannot be split by layer),
            "ghost" (refuse a layer without a ghost norm) or "vectorized"
            (whole-model per-example gradients).
        seed: int or None. None draws the sampling and the noise from OS
            entropy; an int makes them predictable (tests only; warns).
        schedule, planned_steps, calibrated_noise_multiplier: set by the
            first `fit` and saved with the model; not for you to pass
            (`planned_steps` may be given with `target_epsilon`).

    `fit(x, y, batch_size=None, epochs=1)`: `batch_size` is the expected
    logical batch B (None: all N examples in every step); an epoch is
    `round(N / B)` steps. `x` and `y` are arrays (or anything indexable by
    an integer array) with one row per example.

    Example:

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(256, 4)).astype("float32")
    >>> y = (x[:, 0] > 0).astype("int32")
    >>> network = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu"),
    ...                             keras.layers.Dense(2)])
    >>> model = DPModel(network, clip_norm=1.0, noise_multiplier=1.0, delta=1e-3)
    >>> model.compile(keras.optimizers.Adam(0.05),
    ...               keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ...               metrics=["accuracy"])
    >>> history = model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    >>> model.privacy_statement().steps
    12
    """

    _FROZEN_SETTINGS = frozenset(
        {
            "clip_norm",
            "noise_multiplier",
            "target_epsilon",
            "delta",
            "physical_batch_size",
            "sampling",
            "per_layer_clipping",
            "gradient_method",
            "seed",
            "schedule",
            "planned_steps",
            "calibrated_noise_multiplier",
        }
    )

    def __init__(
        self,
        network,
        *,
        clip_norm=1.0,
        noise_multiplier=None,
        target_epsilon=None,
        delta=None,
        physical_batch_size=None,
        sampling="poisson",
        per_layer_clipping=False,
        gradient_method="auto",
        seed=None,
        schedule=None,
        planned_steps=None,
        calibrated_noise_multiplier=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(network, keras.Model):
            raise TypeError(
                f"network must be a keras.Model, got {type(network).__name__}."
            )
        self.network = _check_network(network)
        self.clip_norm = validation.check_clip_norm(clip_norm)
        (
            self.noise_multiplier,
            self.target_epsilon,
            self.planned_steps,
            self.calibrated_noise_multiplier,
        ) = privacy_plan.check_settings(
            noise_multiplier, target_epsilon, delta, planned_steps,
            calibrated_noise_multiplier,
        )  # fmt: skip
        self._fixed_noise = noise_multiplier is not None
        self.delta = None if delta is None else validation.check_delta(delta)
        if physical_batch_size is not None:
            physical_batch_size = validation.check_positive_int(
                physical_batch_size, "physical_batch_size"
            )
        self.physical_batch_size = physical_batch_size
        if not isinstance(sampling, str) or sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}.")
        self.sampling = sampling
        if not isinstance(per_layer_clipping, bool):
            raise ValueError(
                f"per_layer_clipping must be True or False, got {per_layer_clipping!r}."
            )
        self.per_layer_clipping = per_layer_clipping
        if not isinstance(gradient_method, str) or gradient_method not in MODES:
            raise ValueError(
                f"gradient_method must be one of {MODES}, got {gradient_method!r}."
            )
        self.gradient_method = gradient_method
        self.seed = seed
        self.schedule = (
            None if schedule is None else privacy.Schedule.from_config(schedule)
        )
        if self.schedule is not None and self.schedule.unit != "example":
            raise ValueError(
                f"DPModel protects examples; got the schedule {self.schedule}."
            )
        self.private_steps = private_state.add_private_steps(self)
        (self.noise_seed,) = private_state.noise_seed_generators(
            seed, ("noise_seed",), "DPModel"
        )
        self.gradient_plan = None
        self._plan_signature = None
        self._freeze_settings()

    # ------------------------------------------------------------ model --

    def call(self, inputs, training=False):
        """The network's output."""
        return self.network(inputs, training=training)

    def build(self, input_shape):
        if not self.network.built:
            self.network.build(input_shape)
        self.built = True

    # -------------------------------------------------------- privacy --

    def privacy_mechanism(self):
        """The `Mechanism` of one step; known after the first `fit`."""
        if self.schedule is None:
            raise ValueError(
                "The mechanism depends on the number of examples and the batch "
                "size: fit the model first."
            )
        if self.noise_multiplier is None:
            raise ValueError("The noise is calibrated by the first fit: fit first.")
        return self.schedule.privacy_mechanism(self.noise_multiplier, self.clip_norm)

    def privacy_statement(self, delta=None, accountant=None):
        """The `PrivacyStatement` (unit: example) of the steps taken so far.

        `accountant` defaults to "pld" ("rdp" for fixed-size sampling).
        """
        return protocol.privacy_statement(self, delta, accountant)

    # ------------------------------------------------------- training --

    def compile(self, optimizer="sgd", loss=None, metrics=None, **kwargs):
        """`optimizer` is any Keras optimizer; `loss` one Keras loss (a name,
        a `keras.losses.Loss` or a function of `(y_true, y_pred)` returning
        per-example values). `metrics` are for `evaluate`."""
        if loss is None:
            raise ValueError(
                "DPModel.compile needs a loss (e.g. 'sparse_categorical_crossentropy')."
            )
        if isinstance(loss, (list, tuple, dict)) or kwargs.get("loss_weights"):
            raise ValueError(
                "DPModel trains with one loss on one output; got "
                f"{type(loss).__name__}. Combine them in one loss function."
            )
        loss_object = keras.losses.get(loss)
        if loss_object is None:
            raise ValueError(f"Unknown loss {loss!r}.")
        self._per_example_loss = (
            loss_object.call
            if isinstance(loss_object, keras.losses.Loss)
            else loss_object
        )
        self._class_labels = _takes_class_labels(loss_object)
        kwargs["auto_scale_loss"] = False
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)
        self._engine = None

    def compile_from_config(self, config):
        """Restores the optimizer, loss and metrics when a saved model is loaded."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

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
        """DP-SGD on `x`, `y` (arrays, one row per example); see the class."""
        for name in ("sample_weight", "class_weight", "validation_split",
                     "steps_per_epoch", "shuffle"):  # fmt: skip
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"DPModel.fit does not take {name}: it would change each "
                    "example's contribution or the sampling that the privacy "
                    "accounting assumes."
                )
        _check_single_device()
        _check_network(self.network)  # Layers may have been unfrozen since.
        if not self.compiled:
            raise ValueError("Compile the DPModel (optimizer and loss) before fit.")
        x, y = _check_data(x, y)
        if getattr(self, "_class_labels", False):
            # Every class index, whatever the label shape: one per example,
            # or one per position for a network with several output axes
            # (the per-example loss averages over them). Lengths match.
            validation.check_labels(
                y.reshape(-1), num_classes=_num_outputs(self.network)
            )
        inputs.check_input_shape(
            inputs.model_input_shape(self.network),
            np.shape(x[:1]) if not hasattr(x, "shape") else tuple(x.shape),
            "x",
            model="network",
            items="inputs",
        )
        num_examples = len(x)
        epochs = validation.check_positive_int(epochs, "epochs")
        if not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
            raise ValueError(
                f"initial_epoch={initial_epoch!r} must be an int in [0, "
                f"epochs={epochs})."
            )
        steps_per_epoch, schedule = self._schedule_for(num_examples, batch_size)
        self._build_for(x[:3], y[:3])
        self._plan_gradients(x, y, privacy_plan.is_verbose({"verbose": verbose}))

        def steps_of(start_epoch):
            return steps_per_epoch * max(0, epochs - (start_epoch or initial_epoch))

        calibrated = self._plan_budget(
            schedule, steps_of(initial_epoch), privacy_plan.is_verbose(
                {"verbose": verbose, "callbacks": callbacks})
        )  # fmt: skip
        guard = privacy_plan.PlanGuard(
            steps_of,
            "steps",
            on_restored_steps=self._forget_plan if calibrated else None,
        )
        callbacks = privacy_plan.with_guard(callbacks, guard, self)
        private_state.reseed([self.noise_seed], self.seed)
        self._denominator = float(schedule.sample_size)
        seed = (
            None
            if self.seed is None
            else [self.seed, protocol.read_private_steps(self)]
        )
        from kdpemb.data.poisson_batches import PoissonBatches

        physical = self.physical_batch_size or 1
        batches = PoissonBatches(
            x, y, batch_size, steps_per_epoch, seed=seed,
            padding=backends.current().BATCH_PADDING, sampling=self.sampling,
            multiple_of=physical if self.physical_batch_size else 1,
        )  # fmt: skip
        try:
            return super().fit(
                batches,
                epochs=epochs,
                verbose=verbose,
                callbacks=callbacks,
                validation_data=validation_data,
                initial_epoch=initial_epoch,
                shuffle=False,
                **kwargs,
            )
        finally:
            # The generator's state after the fit would regenerate its draws.
            private_state.reseed([self.noise_seed], self.seed)

    def _build_for(self, x, y):
        """Builds the network and the compiled loss and metrics on two
        examples (training logs only `private_steps`, so the metrics would
        otherwise be unbuilt when Keras reads them)."""
        y_pred = self(x)
        for compiled in (self._compile_loss, self._compile_metrics):
            if compiled is not None and not compiled.built:
                compiled.build(y, y_pred)

    def _schedule_for(self, num_examples, batch_size):
        """Steps per epoch, and the schedule (checked against a saved one)."""
        if batch_size is not None:
            batch_size = validation.check_positive_int(batch_size, "batch_size")
            if batch_size > num_examples:
                raise ValueError(
                    f"batch_size={batch_size} exceeds the {num_examples} examples; "
                    "use batch_size=None for full-batch steps."
                )
        if self.delta is not None:
            validation.check_delta(self.delta, num_examples, "example")
        schedule = privacy.Schedule.examples(
            num_examples, batch_size, sampling=self.sampling
        )
        if self.schedule is not None and self.schedule != schedule:
            raise ValueError(
                f"This DPModel was trained with {self.schedule}; fitting with "
                f"{schedule} would change the mechanism of the steps already "
                "counted. Keep the number of examples and the batch size, or "
                "start a new DPModel."
            )
        steps = 1 if batch_size is None else max(1, round(num_examples / batch_size))
        return steps, schedule

    def _plan_budget(self, schedule, steps, verbose):
        """Adopts the schedule; with a target ε, calibrates the noise at the
        first fit and refuses a fit that would go past the plan, before any
        step. Returns whether this call calibrated."""
        taken = protocol.read_private_steps(self)
        if self.schedule is None and taken:
            raise ValueError(
                f"This DPModel has taken {taken} private steps but holds no "
                "schedule (weights loaded into a new model?): its ε cannot be "
                "stated. Load the whole model with keras.saving.load_model."
            )
        calibrated = False
        if self.target_epsilon is not None and self.calibrated_noise_multiplier is None:
            planned = self.planned_steps or steps
            if steps > planned:
                raise PrivacyBudgetExhaustedError(
                    f"This fit's {steps} steps are more than the planned_steps="
                    f"{planned} that target_epsilon={self.target_epsilon} is "
                    "spent over. Fit fewer epochs, or build the DPModel with a "
                    "larger planned_steps."
                )
            z = privacy_plan.calibrate(
                schedule.privacy_mechanism(1.0, self.clip_norm), planned,
                self.target_epsilon, self.delta, verbose, "DPModel",
            )  # fmt: skip
            with self._settings_unfrozen():
                self.planned_steps, self.calibrated_noise_multiplier = planned, z
                self.noise_multiplier = z
            calibrated = True
        if self.schedule is None:
            with self._settings_unfrozen():
                self.schedule = schedule
        if self.target_epsilon is not None:
            if not calibrated:
                privacy_plan.check_plan(self)
            privacy_plan.check_budget(self, steps, "steps")
        return calibrated

    def _forget_plan(self):
        with self._settings_unfrozen():
            self.planned_steps = None
            self.calibrated_noise_multiplier = None
            self.noise_multiplier = None
            self.schedule = None

    def _plan_gradients(self, x, y, verbose):
        """Plans how per-example norms are computed (once, and again when the
        trainable variables change), from synthetic inputs of the data's
        shapes: the plan does not depend on private values."""
        signature = tuple(
            (id(v), v.path, v.trainable) for v in self.network.trainable_variables
        )
        if self.gradient_plan is not None and signature == self._plan_signature:
            return
        sample_x, sample_y = _synthetic_like(x), _synthetic_like(y, zeros=True)
        self.gradient_plan = plan_gradients(
            self.network, sample_x, self.gradient_method,
            self._per_example_loss, sample_y,
        )  # fmt: skip
        self._plan_signature = signature
        self._engine = None
        self.train_function = None  # Retrace with the new plan.
        message = f"DPModel: {self.gradient_plan.describe()}."
        logger.info(message)
        if verbose:
            print(message, flush=True)

    def _engine_for(self):
        if getattr(self, "_engine", None) is None:
            plan = self.gradient_plan
            clip_norms = [self.clip_norm]
            if self.per_layer_clipping:
                clip_norms = [
                    self.clip_norm / np.sqrt(plan.num_groups)
                ] * plan.num_groups
            self._engine = ClippedGradients(
                self.network, plan, self._per_example_loss, clip_norms
            )
        return self._engine

    def train_on_batch(self, *args, **kwargs):
        raise NotImplementedError(
            "DPModel trains only through fit: a batch you choose is not a "
            "Poisson sample, and a step outside fit escapes the schedule."
        )

    def train_step(self, *args):
        # TensorFlow calls train_step(data); JAX calls train_step(state, data).
        return backends.current().train_step(self, args, self._dp_step)

    def _dp_step(self, data):
        x, y, mask = data
        engine = self._engine_for()
        network = self.network
        params = [v.value for v in network.trainable_variables]
        fixed = [v.value for v in network.non_trainable_variables]
        clipped, fixed = self._accumulate(engine, params, fixed, x, y, mask)
        noise = gaussian_sum.gaussian_noise(
            clipped, self.noise_multiplier, self.noise_seed
        )
        grads = [
            (total + n) / self._denominator
            for total, n in zip(clipped.total, noise, strict=True)
        ]
        grads = _add_weight_penalties(network, params, grads)
        within_plan = self._within_plan()
        if within_plan is not None:
            # Past the plan (a callback changed the step count mid-fit, which
            # fit's checks cannot see): release nothing computed from the data
            # and count nothing. A zero gradient; momentum still moves.
            grads = [ops.where(within_plan, g, ops.zeros_like(g)) for g in grads]
        self.optimizer.apply(grads, network.trainable_variables)
        for variable, value in zip(network.non_trainable_variables, fixed, strict=True):
            variable.assign(value)
        self.private_steps.assign_add(
            1 if within_plan is None else ops.cast(within_plan, "int32")
        )
        return {"private_steps": self.private_steps.value}

    def _within_plan(self):
        """With a `target_epsilon`, whether this step is within the plan (a
        traced bool); else None."""
        if self.target_epsilon is None:
            return None
        return ops.less(self.private_steps.value, self.planned_steps)

    def _accumulate(self, engine, params, fixed, x, y, mask):
        """The clipped sum over the logical batch, physical batch by batch."""
        physical = self.physical_batch_size
        size = x.shape[0]
        if physical is None or (size is not None and size <= physical):
            return engine(params, fixed, x, y, mask)
        if size is not None and size % physical:
            raise ValueError(  # Rows past the last whole chunk would be lost.
                f"A batch of {size} rows does not split into physical batches "
                f"of {physical}: feed DPModel through its own fit."
            )
        chunks = ops.shape(x)[0] // physical

        def chunk(tensor, index):
            start = [index * physical] + [0] * (len(tensor.shape) - 1)
            return ops.slice(tensor, start, (physical, *tensor.shape[1:]))

        def body(index, carry):
            totals, count, nonfinite, within, values = carry
            part, values = engine(
                params, values, chunk(x, index), chunk(y, index), chunk(mask, index)
            )
            return (
                [t + p for t, p in zip(totals, part.total, strict=True)],
                count + part.count,
                nonfinite + part.num_nonfinite,
                within + part.num_within_clip,
                values,
            )

        zero = ops.zeros((), "int32")
        init = ([ops.zeros(p.shape, "float32") for p in params], zero, zero, zero,
                list(fixed))  # fmt: skip
        totals, count, nonfinite, within, fixed = ops.fori_loop(0, chunks, body, init)
        clip_norm = engine.clip_norm
        return gaussian_sum.ClippedSum(
            totals, clip_norm, count, nonfinite, within
        ), fixed

    # ---------------------------------------------------------- saving --

    def get_config(self):
        return {
            **super().get_config(),
            "network": keras.saving.serialize_keras_object(self.network),
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier if self._fixed_noise else None,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "physical_batch_size": self.physical_batch_size,
            "sampling": self.sampling,
            "per_layer_clipping": self.per_layer_clipping,
            "gradient_method": self.gradient_method,
            "seed": None,  # A loaded model draws fresh noise.
            "schedule": None if self.schedule is None else self.schedule.get_config(),
            "planned_steps": self.planned_steps,
            "calibrated_noise_multiplier": self.calibrated_noise_multiplier,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["network"] = keras.saving.deserialize_keras_object(config["network"])
        return cls(**config)


def _check_network(network):
    """Refuses, before any step, layers that would break the per-example
    bound or be left out of it: trainable BatchNormalization, activity
    regularizers, mixed precision."""
    from kdpemb.models.layer_taps import all_layers

    backbone_checks.check_backbone(network)
    layers = all_layers(network)
    names = [
        layer.name
        for layer in layers
        if getattr(layer, "activity_regularizer", None) is not None
    ]
    if names:
        raise ValueError(
            f"Layers {names} have an activity_regularizer: DPModel clips each "
            "example's gradient of the compiled loss only, and would leave that "
            "term out. Remove it, or add it to the loss per example."
        )
    mixed = [
        layer.name
        for layer in layers
        if layer.dtype_policy.compute_dtype != "float32"
        or layer.dtype_policy.variable_dtype != "float32"
    ]
    if mixed:
        raise ValueError(
            f"Layers {mixed[:5]} compute in another dtype than float32; DPModel "
            "computes per-example gradients in float32 only for now. Build the "
            "network under keras.config.set_dtype_policy('float32')."
        )
    return network


def _synthetic_like(array, zeros=False):
    """Three rows of the shape and dtype of `array`'s rows, drawn from a
    fixed seed: 0s and 1s for integers (valid indices, pixel values and
    labels), normal values otherwise; zeros with `zeros`."""
    shape, dtype = (3, *np.shape(array)[1:]), np.asarray(array[:1]).dtype
    rng = np.random.default_rng(0)
    if zeros:
        return np.zeros(shape, dtype)
    if not np.issubdtype(dtype, np.floating):
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


def _check_single_device():
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy() and (
            tf.distribute.get_strategy().num_replicas_in_sync > 1
        ):
            raise ValueError(
                "DPModel trains on one device for now; build and fit it "
                "outside the tf.distribute strategy scope."
            )
    if keras.distribution.distribution() is not None:
        raise ValueError(
            "DPModel trains on one device for now; unset keras.distribution."
        )


def _check_data(x, y):
    if x is None or y is None:
        raise ValueError("DPModel.fit needs x and y (arrays, one row per example).")
    if isinstance(x, (dict, list, tuple)) or not hasattr(x, "__len__"):
        raise ValueError(
            "DPModel.fit samples examples itself (Poisson sampling), so x must "
            f"be one array indexable by rows, got {type(x).__name__}. A "
            "tf.data.Dataset or a generator cannot be sampled: load the "
            "examples into an array (or a memory-mapped one)."
        )
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} rows but y has {len(y)}.")
    if not len(x):
        raise ValueError("x is empty.")
    x, y = np.asarray(x) if isinstance(x, list) else x, np.asarray(y)
    # Only the dtypes: a non-finite example is left out of the clipped sum
    # inside the step (docs/dp_sgd.md), not refused by a look at the data.
    validation.check_real_dtype(x, "x", "inputs")
    validation.check_real_dtype(y, "y", "targets")
    return x, y


def _takes_class_labels(loss):
    """Whether `loss` reads `y` as class indices (sparse cross-entropy
    without an `ignore_class`)."""
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return loss.ignore_class is None
    return loss is keras.losses.sparse_categorical_crossentropy


def _num_outputs(network):
    """The width of the network's output (its class count), or None."""
    try:
        width = network.outputs[0].shape[-1]
    except (AttributeError, IndexError, ValueError):
        return None
    return None if width is None else int(width)


def _add_weight_penalties(network, params, grads):
    """Adds the gradients of weight regularizers: they do not read data, so
    they need neither clipping nor noise."""
    regularized = [
        (i, v.regularizer)
        for i, v in enumerate(network.trainable_variables)
        if getattr(v, "regularizer", None) is not None
    ]
    if not regularized:
        return grads
    backend = backends.current()
    indices = [i for i, _ in regularized]

    def penalty(values):
        return sum(
            ops.cast(reg(value), "float32")
            for (_, reg), value in zip(regularized, values, strict=True)
        )

    _, extra = backend.value_and_grad(penalty)([params[i] for i in indices])
    grads = list(grads)
    for i, g in zip(indices, extra, strict=True):
        grads[i] = grads[i] + ops.cast(g, grads[i].dtype)
    return grads

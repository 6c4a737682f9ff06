"""`DPModel`: example- or user-level DP-SGD for any Keras model and optimizer.

`DPModel(network, ...)` wraps a Keras model (Sequential, functional or
subclassed); its `fit` is DP-SGD: Poisson-sampled logical batches of
expected size B (split into physical batches of `physical_batch_size`
whose clipped gradients are summed), each example's gradient clipped to
`clip_norm` (ghost clipping where the layers allow it,
`kdpemb.models.dp_sgd.clipped_gradients`), Gaussian noise of std z · C added once
to the sum, division by B, and the compiled optimizer (SGD, Adam, LAMB, …).
It implements kdpemb's privacy protocol, so `PrivacyBudget`,
`privacy_statement()` and calibration from a `target_epsilon` work as for
the other models. With `unit="user"` it samples users, not examples, and
clips each user's mean gradient over at most `examples_per_user` of their
examples (`kdpemb.models.dp_sgd.user_level`): ε per user. Training logs
only `private_steps`: a loss on the
private batch would be a release without noise. Opt in to a noised loss
and to adaptive clipping, each accounted with the gradient
(`kdpemb.models.dp_sgd.step_releases`).
"""

import keras
import numpy as np
from keras import ops

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.datasets import inputs
from kdpemb.models import backbone_checks
from kdpemb.models._shared import (
    backends,
    data_parallel,
    privacy_plan,
    private_state,
)
from kdpemb.models._shared.frozen_settings import FrozenSettings
from kdpemb.models._shared.layer_taps import all_layers
from kdpemb.models.dp_sgd import (
    distributed_fit,
    dp_step,
    label_shapes,
    step_releases,
    user_level,
)
from kdpemb.models.dp_sgd.clipped_gradients import (
    MODES,
    ClippedGradients,
    logger,
    plan_gradients,
)
from kdpemb.privacy import protocol

SAMPLINGS = ("poisson", "fixed")
__all__ = ["DPModel"]


@keras.saving.register_keras_serializable(package="kdpemb")
class DPModel(FrozenSettings, keras.Model):
    """A Keras model trained with example-level or user-level DP-SGD.

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
        unit: "example" (default: the guarantee protects one example) or
            "user" (all of one person's examples: `fit(..., users=ids)`
            samples users, and each sampled user's gradient, the mean over
            at most `examples_per_user` of their examples chosen at random
            each step, is clipped to C as one contribution).
        examples_per_user: int. k, with `unit="user"` only: the public cap
            on one user's examples in a step.
        seed: int or None. None draws the sampling and the noise from OS
            entropy; an int makes them predictable (tests only; warns).
        noised_loss, adaptive_clipping: None (default), or a
            `kdpemb.privacy.LossRelease` (logs a noised `noised_loss`) and
            an `AdaptiveClipping` (C follows a gradient-norm quantile;
            logged as `clip_norm`), accounted with the gradient (`step_releases`).
        schedule, planned_steps, calibrated_noise_multiplier: set by the
            first `fit` and saved with the model; not for you to pass
            (`planned_steps` may be given with `target_epsilon`).

    `fit(x, y, batch_size=None, epochs=1)`: `batch_size` is the expected
    logical batch B (None: all N examples in every step); an epoch is
    `round(N / B)` steps. `x` and `y` are arrays (or anything indexable by
    an integer array) with one row per example. With `unit="user"`,
    `fit(x, y, users=ids, batch_size=B_u)`: `users` holds one id per
    example, `batch_size` is the expected number of users per step (q =
    B_u / U over the U distinct ids), an epoch `round(U / B_u)` steps, and
    the statement's ε is per user.

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
            "noised_loss",
            "adaptive_clipping",
            "unit",
            "examples_per_user",
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
        noised_loss=None,
        adaptive_clipping=None,
        unit="example",
        examples_per_user=None,
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
        self.unit, self.examples_per_user = user_level.check_unit(
            unit, examples_per_user, physical_batch_size
        )
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
        if self.schedule is not None and self.schedule.unit != self.unit:
            raise ValueError(
                f"This DPModel protects each {self.unit}; got the schedule "
                f"{self.schedule}."
            )
        self.private_steps = private_state.add_private_steps(self)
        step_releases.configure(self, noised_loss, adaptive_clipping, seed)
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
        return step_releases.privacy_mechanism(self)

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
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "DPModel computes per-example gradients in float32 and does "
                "not scale its loss, so a LossScaleOptimizer would shrink every "
                "update by its loss scale; pass the optimizer it wraps."
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
        users=None,
        **kwargs,
    ):
        """DP-SGD on `x`, `y` (finite arrays, one row each; with
        `unit="user"`, `users`: one id each); see the class."""
        privacy_plan.refuse_fit_arguments(
            kwargs, (*privacy_plan.SAMPLING_ARGUMENTS, "shuffle"), "DPModel"
        )
        hosts = data_parallel.check_engine(self, "DPModel")
        # Every host checks alone, then they tell each other whether all
        # passed (one host refusing would leave the others waiting).
        with hosts.together("DPModel.fit"):
            _check_network(self.network)  # Layers may have been unfrozen since.
            if not self.compiled:
                raise ValueError("Compile the DPModel (optimizer and loss) before fit.")
            x, y = _check_data(x, y, self.network.compute_dtype)
            finite_inputs.check_validation_data(
                validation_data, as_dtype=self.network.compute_dtype
            )
            # One-hot labels to a sparse loss (or indices to a categorical one),
            # named with the data's shape before any probe of the network.
            label_shapes.check(
                np.shape(y),
                label_shapes.output_shape(self.network),
                keras.losses.get(self.loss),
            )
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
            users, num_users = user_level.check_users(self, users, len(x))
            epochs = validation.check_positive_int(epochs, "epochs")
            if not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
                raise ValueError(
                    f"initial_epoch={initial_epoch!r} must be an int in [0, "
                    f"epochs={epochs})."
                )
            steps_per_epoch, schedule = self._schedule_for(
                len(x), batch_size, num_users
            )
        with data_parallel.engine_scope(self):  # Variables on the devices.
            self._build_for(x[:3], y[:3])
        data_parallel.check_variables_in_scope(self, owner="DPModel")
        self._plan_gradients(x, y, privacy_plan.is_verbose({"verbose": verbose}))

        steps = steps_per_epoch * (epochs - initial_epoch)
        shown = privacy_plan.is_verbose({"verbose": verbose, "callbacks": callbacks})
        calibrated = privacy_plan.plan_steps(
            self, schedule, steps, shown, callbacks,
            # z_eff of the step: the gradient keeps what the others leave.
            split=lambda z, schedule: step_releases.gradient_noise(
                self, z, schedule, shown),
        )  # fmt: skip
        step_releases.warn_costly_count(self)
        callbacks = privacy_plan.guard_epochs(
            self, callbacks, steps_per_epoch, epochs, initial_epoch, calibrated
        )
        randbits = hosts.shared_bits if hosts.count > 1 else None
        private_state.reseed(step_releases.seed_generators(self), self.seed, randbits)
        self._denominator = float(schedule.sample_size)
        batches = distributed_fit.batches(
            self, x, y, users, batch_size, steps_per_epoch, hosts, randbits
        )
        batches, callbacks, kwargs, guard = distributed_fit.join_hosts(
            self, batches, callbacks, kwargs, hosts, x, y, users
        )
        try:
            history = super().fit(
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
            # The generators' state after the fit would regenerate their draws
            # (on several hosts the chief's entropy: one state everywhere).
            private_state.reseed(
                step_releases.seed_generators(self), self.seed, randbits
            )
        distributed_fit.check_aligned(guard)
        return history

    def _build_for(self, x, y):
        """Builds the network and the compiled loss and metrics on two
        examples (training logs only `private_steps`, so the metrics would
        otherwise be unbuilt when Keras reads them)."""
        y_pred = self(x)
        for compiled in (self._compile_loss, self._compile_metrics):
            if compiled is not None and not compiled.built:
                compiled.build(y, y_pred)

    def _schedule_for(self, num_examples, batch_size, num_users):
        """Steps per epoch, and the schedule (checked against a saved one)."""
        if num_users is not None:
            steps, schedule = user_level.schedule(self, num_users, batch_size)
        else:
            batch_size, steps = privacy_plan.example_batches(num_examples, batch_size)
            if self.delta is not None:
                validation.check_delta(self.delta, num_examples, "example")
            schedule = privacy.Schedule.examples(
                num_examples, batch_size, sampling=self.sampling
            )
        if self.schedule is not None and self.schedule != schedule:
            raise ValueError(
                f"This DPModel was trained with {self.schedule}; fitting with "
                f"{schedule} would change the mechanism of the steps already "
                "counted. Keep the number of examples (users) and the batch size, or "
                "start a new DPModel."
            )
        return steps, schedule

    def _plan_gradients(self, x, y, verbose):
        """Plans how per-example norms are computed (once, and again when the
        trainable variables change), from synthetic inputs of the data's
        shapes: the plan does not depend on private values."""
        signature = tuple(
            (id(v), v.path, v.trainable) for v in self.network.trainable_variables
        )
        if self.gradient_plan is not None and signature == self._plan_signature:
            return
        sample_x = synthetic_inputs(x, self.network)
        if not _runs_on(self.network, sample_x):
            # Ids that reach another layer as well (a CategoryEncoding
            # refuses negative ones on TensorFlow): non-negative ids only.
            sample_x = synthetic_inputs(x, self.network, aliases=False)
        sample_y = synthetic_targets(
            y, _num_outputs(self.network), getattr(self, "_class_labels", False)
        )
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
                self.network, plan, self._per_example_loss, clip_norms,
                examples_per_user=self.examples_per_user,
            )  # fmt: skip
        return self._engine

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        distributed_fit.build_optimizer(self)  # Keras' would read a batch.

    def train_on_batch(self, *args, **kwargs):
        raise NotImplementedError(
            "DPModel trains only through fit: a batch you choose is not a "
            "Poisson sample, and a step outside fit escapes the schedule."
        )

    def train_step(self, *args):
        # TensorFlow calls train_step(data); JAX calls train_step(state, data).
        return backends.current().train_step(self, args, self._dp_step)

    def _dp_step(self, data):
        return dp_step.train_step(self, data)

    def _within_plan(self):
        """With a `target_epsilon`, whether this step is within the plan (a
        traced bool); else None."""
        if self.target_epsilon is None:
            return None
        return ops.less(self.private_steps.value, self.planned_steps)

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
            **step_releases.config(self),
            "unit": self.unit,
            "examples_per_user": self.examples_per_user,
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


def synthetic_inputs(x, network, aliases=True):
    """Three rows of the shape and dtype of `x`'s rows, from a fixed seed (no
    private value is read): normal values for floats; for integers, ids
    that read every kind of row an `Embedding` of `network` may be given.

    Integer rows span [−V, V) for the smallest table V of the network's
    Embeddings, and row 0 pairs each id with its negative alias (id − V
    reads the same row as id), row 1 repeats one id: a per-layer norm that
    counts rows differently from the layer itself then differs from the
    reference the self-check compares it with. Without `aliases`, for a
    dtype that cannot hold −V (unsigned, or narrower than the table), and
    without an Embedding, ids are non-negative: [0, V) ({0, 1} without an
    Embedding), row 1 still one id repeated.
    """
    shape, dtype = (3, *np.shape(x)[1:]), np.asarray(x[:1]).dtype
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.floating):
        return rng.normal(size=shape).astype(dtype)
    if not np.issubdtype(dtype, np.integer):  # bool
        return rng.integers(0, 2, size=shape).astype(dtype)
    tables = [
        int(layer.embeddings.shape[0])
        for layer in all_layers(network)
        if isinstance(layer, keras.layers.Embedding) and layer.built
    ]
    table = min(tables, default=2)
    size = min(table, int(np.iinfo(dtype).max) + 1)
    # Aliases only where the dtype holds −V, and the network takes them.
    signed = aliases and bool(tables) and int(np.iinfo(dtype).min) <= -table
    ids = rng.integers(-size if signed else 0, size, size=shape).reshape(3, -1)
    if ids.shape[1] > 1:
        ids[1] = size - 1  # One id repeated,
        if signed:  # and read through its alias −1; row 0: id and id − V.
            ids[1, 0::2] = -1
            ids[0, 0::2] %= size
            ids[0, 1::2] = ids[0, 0::2][: ids.shape[1] // 2] - size
    return ids.reshape(shape).astype(dtype)


def _runs_on(network, inputs):
    """Whether a forward pass of `network` on `inputs` runs (stateless: no
    seed or statistic moves)."""
    trainable = [v.value for v in network.trainable_variables]
    fixed = [v.value for v in network.non_trainable_variables]
    try:
        network.stateless_call(trainable, fixed, inputs, training=False)
    except Exception:  # Any refusal of these inputs by the network's layers.
        return False
    return True


def synthetic_targets(y, num_outputs, class_labels):
    """Three target rows of the shape and dtype of `y`'s rows, from a fixed
    seed, chosen so that every loss is non-zero on them (zeros would make
    one-hot cross-entropy vanish, and with it every norm the self-check
    compares): class indices in [0, num_outputs) for sparse labels (of
    any dtype), other integers in {0, 1}; otherwise positive values (that
    sum to 1 along a last axis wider than 1: a distribution over classes),
    a regression target away from any prediction. A loss that is still 0
    or not finite on them makes the self-check fall back."""
    shape, dtype = (3, *np.shape(y)[1:]), np.asarray(y[:1]).dtype
    rng = np.random.default_rng(1)
    if class_labels or not np.issubdtype(dtype, np.floating):
        high = num_outputs if class_labels and num_outputs else 2
        labels = rng.integers(0, high, size=shape)
        if labels.size > 1 and high > 1:
            labels.flat[:2] = [0, high - 1]
        return labels.astype(dtype)
    values = rng.uniform(0.1, 1.0, size=shape)
    if len(shape) > 1 and shape[-1] > 1:
        values = values / values.sum(axis=-1, keepdims=True)
    return values.astype(dtype)


def _check_data(x, y, dtype):
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
    validation.check_real_dtype(x, "x", "inputs")
    validation.check_real_dtype(y, "y", "targets")
    # Non-finite inputs and float targets are refused before any step (the
    # one rule, `kdpemb._finite_inputs`), as the `dtype` the network computes
    # in (float64 1e39 is infinite in float32); integer labels need no look.
    finite_inputs.check_array(x, "x", what="inputs", action="fit", as_dtype=dtype)
    finite_inputs.check_array(y, "y", what="targets", action="fit", as_dtype=dtype)
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

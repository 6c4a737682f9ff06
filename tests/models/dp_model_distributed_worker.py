"""Runs DPModel fits on two CPU devices and prints the results as JSON.

`tests/models/test_dp_model_distributed.py` starts this script in a fresh
process, because the devices must be configured before TensorFlow or JAX
initialise:

- TensorFlow: the one physical CPU is split into two logical devices
  (`tf.config.set_logical_device_configuration`), and the distributed
  DPModel is built and compiled in a `tf.distribute.MirroredStrategy`
  over both.
- JAX: `XLA_FLAGS=--xla_force_host_platform_device_count=2` (set by the
  parent) gives two CPU devices, and `keras.distribution.DataParallel`
  spans them.

Every scenario runs first on one device (before any distribution
exists), then on the two, from the same initial weights and seeds. Keras
reads a batch or two ahead (and once more for the element spec), and the
samplers draw from one stateful generator, so the two runs would see
different samples: `IndexedSamples` makes every batch a function of its
index and records what was served. A scenario that raises is reported
with its traceback under `"error"`, so that the parent test shows it.

Usage: `KERAS_BACKEND=tensorflow|jax python dp_model_distributed_worker.py
DIRECTORY` (a scratch directory for the contract's saved models). The last
line of stdout is one JSON object (see `main`). The tests import this
module only for its settings; importing it configures no devices.
"""

import contextlib
import json
import os
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

import numpy as np

BACKEND = os.environ.get("KERAS_BACKEND")
NUM_DEVICES = 2

# Example level: N = 48 examples, B = 16 expected per step, 3 steps (one
# epoch). User level: 16 users of 1 to 5 examples, 4 expected users per
# step, k = 2 (users of 3 to 5 examples get a row draw), 4 steps.
NUM_EXAMPLES = 48
BATCH_SIZE = 16
USER_COUNTS = [1, 2, 3, 4, 2, 3, 4, 5] * 2  # 48 examples.
USERS_PER_STEP = 4
EXAMPLES_PER_USER = 2
LEARNING_RATE = 0.5
L2 = 0.05
DATA_SEED = 5
MODEL_SEED = 11
SAMPLE_SEED = 23
DP_SEED = 7
# The noise scenario: each step moves every one of 64 × 64 coordinates by
# N(0, (z C / B)^2) when the noise is added exactly once.
NOISE_MULTIPLIER = 1.0
NOISE_CLIP = 2.0
NOISE_WIDTH = 64
DELTA = 1e-3
# Adaptive clipping and the noised loss (their noise on; the gradient's off).
TARGET_QUANTILE = 0.5
CLIP_LEARNING_RATE = 0.5
COUNT_STDDEV = 0.5
LOSS_BOUND = 1.0
LOSS_NOISE = 2.0
# Sensitivity: one step on every example; the removed one's gradient is
# far above C.
SENSITIVITY_CLIP = 1.0
SENSITIVITY_EXAMPLES = 16
SENSITIVITY_REMOVED = 12  # In the second device's half of the rows.
SENSITIVITY_USER_COUNTS = [1, 2, 3] * 3  # 9 users, k = 3: no row draw.


# Not when the tests import this module for its settings.
DEVICES = None
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests`.
    from tests.models.worker_results import configure_cpu_devices

    DEVICES = configure_cpu_devices(BACKEND, NUM_DEVICES)
STRATEGY = None  # TensorFlow: the MirroredStrategy of the distributed runs.

import keras  # noqa: E402
from keras import layers  # noqa: E402

from kdpemb.callbacks import PrivacyBudget  # noqa: E402
from kdpemb.data.poisson_batches import PoissonIndices  # noqa: E402
from kdpemb.data.user_batches import UserIndices  # noqa: E402
from kdpemb.models import DPModel  # noqa: E402
from kdpemb.models._shared import backends  # noqa: E402
from kdpemb.models.dp_sgd import gradient_accumulation  # noqa: E402
from kdpemb.models.dp_sgd.clipped_gradients import (  # noqa: E402
    ClippedGradients,
    plan_gradients,
)
from kdpemb.privacy import AdaptiveClipping, LossRelease  # noqa: E402

warnings.simplefilter("ignore")  # Fixed seeds warn; intended in a test.


class Scale(layers.Layer):
    """A layer without a ghost norm: its group takes vectorised gradients."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones")

    def call(self, x):
        return keras.ops.tanh(x * self.w)


def network(kind):
    keras.utils.set_random_seed(MODEL_SEED)
    l2 = keras.regularizers.L2(L2) if kind == "mlp_l2" else None
    head = [
        layers.Dense(8, "tanh", kernel_regularizer=l2),
        layers.Dense(2, kernel_regularizer=l2),
    ]
    if kind == "conv":
        body = [
            keras.Input((6, 6, 1)),
            layers.Conv2D(2, 3, activation="tanh"),
            layers.Flatten(),
        ]
    elif kind == "scale":
        body = [keras.Input((4,)), Scale()]
    elif kind == "noise":  # x = 0 and no bias: every gradient is 0.
        return keras.Sequential(
            [keras.Input((NOISE_WIDTH,)), layers.Dense(NOISE_WIDTH, use_bias=False)]
        )
    elif kind == "linear":  # Zero weights: a step's change is exact.
        return keras.Sequential(
            [
                keras.Input((4,)),
                layers.Dense(3, use_bias=False, kernel_initializer="zeros"),
            ]
        )
    else:
        body = [keras.Input((4,))]
    return keras.Sequential(body + head)


SCENARIOS = {
    # Ghost norms of a Conv2D and Dense layers, 2-row physical batches:
    # several physical batches on each device.
    "conv": {"network": "conv", "physical_batch_size": 2},
    # Per-layer clipping, and a weight penalty (added once, not per device).
    "per_layer_l2": {
        "network": "mlp_l2",
        "per_layer_clipping": True,
        "physical_batch_size": 4,
    },
    "user": {
        "network": "mlp",
        "unit": "user",
        "examples_per_user": EXAMPLES_PER_USER,
        "physical_batch_size": 4,
    },
    # A layer without a ghost norm (vectorised), and a noised loss.
    "fallback_noised_loss": {
        "network": "scale",
        "noised_loss": LossRelease(bound=LOSS_BOUND, noise_multiplier=LOSS_NOISE),
    },
    "adaptive": {
        "network": "mlp",
        "adaptive_clipping": AdaptiveClipping(
            TARGET_QUANTILE, CLIP_LEARNING_RATE, count_stddev=COUNT_STDDEV
        ),
    },
    # An optimizer that clips each coordinate of the gradient it is given:
    # it must see the global noised gradient once, never one replica's sum
    # (clip(g0) + clip(g1) is not clip(g0 + g1), and g1 carries no noise).
    "optimizer_clipvalue": {"network": "mlp", "optimizer_clipvalue": 0.004},
    # Gradients all 0: each step is the noise alone.
    "noise": {
        "network": "noise",
        "noise_multiplier": NOISE_MULTIPLIER,
        "clip_norm": NOISE_CLIP,
    },
}
# TensorFlow only, distributed only: XLA, refused under MirroredStrategy
# (it cannot read the other replica's variables).
XLA_SCENARIO = {"network": "conv", "physical_batch_size": 2, "jit_compile": True}
PROBED = "conv"  # The scenario whose device programs are probed.


def make_data(kind):
    rng = np.random.default_rng(DATA_SEED)
    shape = (6, 6, 1) if kind == "conv" else (NOISE_WIDTH,) if kind == "noise" else (4,)
    x = rng.normal(size=(NUM_EXAMPLES, *shape)).astype("float32")
    y = rng.normal(size=(NUM_EXAMPLES, 2)).astype("float32")
    if kind == "noise":
        x, y = np.zeros_like(x), np.zeros((NUM_EXAMPLES, NOISE_WIDTH), "float32")
    users = rng.permutation(np.repeat(np.arange(len(USER_COUNTS)), USER_COUNTS))
    return x, y, users


class IndexedSamples:
    """Makes every batch a function of its index (each sampler's generator
    is reseeded with the index first) and records the batches served: for
    each index, every draw's `(rows, real examples)`."""

    def __init__(self):
        self.served = {}
        self._lock = threading.RLock()
        self._depth = 0

    def _wrap(self, sample, salt):
        def wrapped(sampler, index):
            with self._lock:
                sampler._rng = np.random.default_rng([SAMPLE_SEED, salt, int(index)])
                self._depth += 1
                try:
                    indices, mask = sample(sampler, index)
                finally:
                    self._depth -= 1
                if not self._depth:
                    draws = self.served.setdefault(str(int(index)), [])
                    draws.append([len(mask), indices[mask == 1].tolist()])
            return indices, mask

        return wrapped

    def __enter__(self):
        self._originals = PoissonIndices.sample, UserIndices.sample
        PoissonIndices.sample = self._wrap(self._originals[0], 0)
        UserIndices.sample = self._wrap(self._originals[1], 1)
        return self

    def __exit__(self, *exc):
        PoissonIndices.sample, UserIndices.sample = self._originals


class ProgramProbe:
    """Records, as the step runs, the rows (and real rows) of every device
    program's logical batch (`gradient_accumulation.accumulate`: a
    TensorFlow replica's, a `shard_map` body's on JAX), and the rows of
    every physical batch the engine clips (`ClippedGradients.__call__`)."""

    def __init__(self):
        self.programs, self.chunks = [], []

    @staticmethod
    def _note(record, values, anchor):
        """`anchor` unchanged, once `values` (ints) are appended to `record`
        at run time."""

        def note(*numbers):
            record.append([int(n) for n in numbers])
            return np.int32(0)

        if BACKEND == "tensorflow":
            import tensorflow as tf

            token = tf.numpy_function(note, values, tf.int32)
            with tf.control_dependencies([token]):
                return tf.identity(anchor)
        import jax

        jax.debug.callback(lambda *v: note(*v), *values, ordered=False)
        return anchor

    def __enter__(self):
        self._accumulate = gradient_accumulation.accumulate
        self._call = ClippedGradients.__call__
        ops = keras.ops

        def rows(x, mask):
            return [ops.shape(x)[0], ops.cast(ops.sum(mask), "int32")]

        def accumulate(engine, params, fixed, x, y, mask, physical):
            mask = self._note(self.programs, rows(x, mask), mask)
            return self._accumulate(engine, params, fixed, x, y, mask, physical)

        def call(engine, params, fixed, x, y, mask):
            mask = self._note(self.chunks, rows(x, mask), mask)
            return self._call(engine, params, fixed, x, y, mask)

        gradient_accumulation.accumulate = accumulate
        ClippedGradients.__call__ = call
        return self

    def __exit__(self, *exc):
        gradient_accumulation.accumulate = self._accumulate
        ClippedGradients.__call__ = self._call


def flat(arrays):
    return np.concatenate(
        [np.ravel(keras.ops.convert_to_numpy(a)).astype(np.float64) for a in arrays]
    )


class Steps(keras.callbacks.Callback):
    """The network's weights and the logs after every step."""

    def __init__(self):
        super().__init__()
        self.weights, self.logs = [], []

    def on_train_batch_end(self, batch, logs=None):
        if BACKEND == "jax":
            self.model.jax_state_sync()  # Else the variables are stale.
        self.weights.append(flat(self.model.network.trainable_variables).tolist())
        self.logs.append(
            {
                k: float(np.asarray(keras.ops.convert_to_numpy(v)))
                for k, v in logs.items()
            }
        )


def replica_values(variable):
    """Every replica's value of `variable` (one without replicas)."""
    value = variable.value
    return [keras.ops.convert_to_numpy(v) for v in getattr(value, "values", [value])]


def unit_norms(model, x, y, users, sample):
    """The gradient norms, at the model's weights, of the contributions of
    `sample` (the real rows of a batch): each example's, or each user's
    mean over their rows, by plain per-example gradients."""
    net = model.network
    engine = ClippedGradients(
        net, plan_gradients(net, x[:3], "vectorized"), keras.losses.get("mse"), [1.0]
    )
    params = [v.value for v in net.trainable_variables]
    fixed = [v.value for v in net.non_trainable_variables]
    rows = np.asarray(sample)
    grads = engine._per_example_gradients(
        backends.current(), params, fixed, x[rows], y[rows]
    )
    per_row = np.concatenate(
        [keras.ops.convert_to_numpy(g).reshape(len(rows), -1) for g in grads], axis=1
    )
    if users is None:
        return np.linalg.norm(per_row, axis=1).tolist()
    owners = users[rows]
    means = [per_row[owners == u].mean(axis=0) for u in np.unique(owners)]
    return np.linalg.norm(means, axis=1).tolist()


def clean_losses(model, before, x, y, served, steps):
    """Each step's clipped loss sum / B without noise, from the weights
    before it and the rows it was served (`noised_loss` minus this is the
    noise)."""
    net, values = model.network, []
    shapes = [tuple(v.shape) for v in net.trainable_variables]
    for step in range(steps):
        flat_weights = np.asarray(before[step], np.float32)
        arrays, start = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            arrays.append(flat_weights[start : start + size].reshape(shape))
            start += size
        net.set_weights(arrays)
        rows = np.asarray(served[str(step)][0][1])
        losses = keras.ops.convert_to_numpy(
            keras.losses.mean_squared_error(y[rows], net(x[rows]))
        )
        values.append(
            float(np.clip(losses, -LOSS_BOUND, LOSS_BOUND).sum() / BATCH_SIZE)
        )
    return values


INITIAL = {}  # Scenario -> the first build's initial weights.
CLIP_NORMS = {}  # Scenario -> its C, from the single run's first sample.


def build(name, settings, clip_norm):
    net = network(settings["network"])
    if name in INITIAL:
        net.set_weights(INITIAL[name])
    INITIAL.setdefault(name, [np.array(w) for w in net.get_weights()])
    not_dp = ("network", "jit_compile", "optimizer_clipvalue")
    dp = {k: v for k, v in settings.items() if k not in not_dp}
    dp.setdefault("noise_multiplier", 0.0)
    dp.setdefault("clip_norm", clip_norm)
    model = DPModel(net, seed=DP_SEED, **dp)
    extra = {"jit_compile": True} if settings.get("jit_compile") else {}
    optimizer = keras.optimizers.SGD(
        LEARNING_RATE if name != "noise" else 1.0,
        clipvalue=settings.get("optimizer_clipvalue"),
    )
    model.compile(optimizer, "mse", **extra)
    return model


def fit(name, distributed):
    """Fits scenario `name` (in the strategy's scope if TensorFlow and
    `distributed`) for one epoch, and reports what happened."""
    settings = XLA_SCENARIO if name == "jit" else SCENARIOS[name]
    x, y, users = make_data(settings["network"])
    by_user = settings.get("unit") == "user"
    batch = USERS_PER_STEP if by_user else BATCH_SIZE
    report = {}
    with IndexedSamples() as samples:
        if not distributed and "clip_norm" not in settings:
            # The single run comes first. C: the median norm of the first
            # batch's contributions, so that some are clipped and some not.
            model = build(name, settings, 1.0)
            report["first_norms"] = first_norms(model, x, y, users, by_user, batch)
            CLIP_NORMS[name] = float(np.median(report["first_norms"]))
        # The noise scenario's C is given; XLA's fit is refused (any C).
        clip = settings.get("clip_norm", CLIP_NORMS.get(name, 1.0))
        report["clip_norm"] = clip
        with scope(distributed):
            model = build(name, settings, clip)
        if BACKEND == "tensorflow":
            report["copies_per_variable"] = [
                len(getattr(v.value, "values", ())) for v in model.trainable_variables
            ]
        else:
            report["devices_per_variable"] = [
                len(v.value.sharding.device_set) for v in model.trainable_variables
            ]
        report["jit_compile"] = bool(model.jit_compile)
        report["before"] = flat(model.network.trainable_variables).tolist()
        steps, budget, begun = Steps(), PrivacyBudget(DELTA, verbose=0), Begun()
        kwargs = {"users": users} if by_user else {}
        probe = ProgramProbe()
        probed = name == PROBED and distributed
        with probe if probed else contextlib.nullcontext():
            try:
                history = model.fit(
                    x, y, batch_size=batch, epochs=1, verbose=0,
                    callbacks=[steps, budget, begun], **kwargs,
                )  # fmt: skip
            except ValueError as error:
                if not (distributed and settings.get("jit_compile")):
                    raise
                # XLA under MirroredStrategy: refused before any step.
                return {"refusal": refusal(error, model, report["before"], begun)}
        report["served"] = samples.served
    report["programs"], report["chunks"] = probe.programs, probe.chunks
    report["after_step"] = steps.weights
    report["logs"] = steps.logs
    report["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
    report["replica_private_steps"] = [
        int(v) for v in replica_values(model.private_steps)
    ]
    report["replica_weights_agree"] = all(
        all(np.array_equal(values[0], other) for other in values[1:])
        for values in map(replica_values, model.network.trainable_variables)
    )
    report["epsilon"] = budget.statement.epsilon if budget.statement else None
    report["statement_epsilon"] = model.privacy_statement(DELTA).epsilon
    if settings["network"] == "mlp_l2":
        # How far one step of the penalty alone moves a weight at most.
        report["penalty_step"] = LEARNING_RATE * max(
            float(np.abs(2 * L2 * np.asarray(w)).max())
            for w in INITIAL[name][::2]  # The kernels.
        )
    if settings.get("noised_loss") is not None and not distributed:
        report["clean_losses"] = clean_losses(
            model,
            [report["before"], *steps.weights],
            x,
            y,
            samples.served,
            len(steps.weights),
        )
    return report


def first_norms(model, x, y, users, by_user, batch):
    """The contributions' gradient norms of the fit's first batch (its
    index-0 sample, as `IndexedSamples` draws it)."""
    from kdpemb.distribute import Hosts
    from kdpemb.models.dp_sgd import distributed_fit

    batches = distributed_fit.batches(
        model, x, y, users if by_user else None, batch, 4, Hosts.single(), None
    )
    indices, mask = batches.sample(0)
    return unit_norms(model, x, y, users if by_user else None, indices[mask == 1])


def scope(distributed):
    """The MirroredStrategy's scope (TensorFlow, `distributed`), else none."""
    if distributed and BACKEND == "tensorflow":
        return STRATEGY.scope()
    return contextlib.nullcontext()


def sensitivity(unit):
    """On both devices: one step on every example (`batch_size=None`),
    noise off, SGD(1), from zero weights, on D and on D minus one example
    (at user level: one user, every example of theirs): each step's change
    times its
    denominator (N, or U) is minus the clipped sum; their distance is the
    removed contribution's clipped norm."""
    rng = np.random.default_rng(DATA_SEED + 1)
    if unit == "example":
        users = None
        n = SENSITIVITY_EXAMPLES
        removed = np.arange(n) == SENSITIVITY_REMOVED
    else:
        counts = SENSITIVITY_USER_COUNTS
        users = np.repeat(np.arange(len(counts)), counts)  # The last user's
        n = len(users)  # slot is last: on the second device.
        removed = users == len(counts) - 1
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 3)).astype("float32")
    y[removed] = 30.0  # Its gradient is far above C.
    changes = {}
    for data, keep in (("D", np.ones(n, bool)), ("D_minus_one", ~removed)):
        settings = {"unit": "user", "examples_per_user": max(SENSITIVITY_USER_COUNTS)}
        with scope(distributed=True):
            model = DPModel(
                network("linear"),
                clip_norm=SENSITIVITY_CLIP,
                noise_multiplier=0.0,
                seed=DP_SEED,
                **(settings if users is not None else {}),
            )
            model.compile(keras.optimizers.SGD(1.0), "mse")
        kwargs = {} if users is None else {"users": users[keep]}
        model.fit(x[keep], y[keep], batch_size=None, verbose=0, **kwargs)
        denominator = keep.sum() if users is None else len(np.unique(users[keep]))
        changes[data] = (flat(model.network.trainable_variables) * denominator).tolist()
        changes[f"{data}_private_steps"] = [
            int(v) for v in replica_values(model.private_steps)
        ]
    changes["distance"] = float(
        np.linalg.norm(np.subtract(changes["D"], changes["D_minus_one"]))
    )
    return changes


def refusals():
    """Fits under set-ups whose step would not be one sum over every device:
    the error, the steps begun, and whether weights and count moved."""
    report = {}
    if BACKEND == "jax":
        import jax

        mesh = keras.distribution.DeviceMesh(
            (1, NUM_DEVICES), ["batch", "model"], jax.devices()
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = (None, "model")
        setups = {
            "model_parallel": keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            ),
            "one_of_two_devices": keras.distribution.DataParallel(
                devices=jax.devices()[:1]
            ),
        }
        for name, distribution in setups.items():
            with distribution.scope():
                report[name] = run(refused_fit, name)
    else:
        import tensorflow as tf

        strategy = tf.distribute.experimental.CentralStorageStrategy(DEVICES)
        with strategy.scope():
            report["central_storage"] = run(refused_fit, "central_storage")
        report["network_in_another_scope"] = run(refused_fit, "network_in_scope")
        # Built outside the scope, fitted inside it.
        report["model_outside_the_scope"] = run(refused_fit, "outside")
        with STRATEGY.scope():
            report["optimizer_accumulation"] = run(refused_fit, "accumulation")
    return report


def refusal(error, model, before, begun):
    """What a refused fit left: its error, the steps it began, and whether
    the weights and the count stayed."""
    return {
        "error": f"{type(error).__name__}: {error}",
        "steps_begun": begun.steps,
        "weights_kept": bool(
            np.array_equal(before, flat(model.network.trainable_variables))
        ),
        "private_steps": [int(v) for v in replica_values(model.private_steps)],
    }


class Begun(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.steps += 1


def refused_fit(name):
    x, y, _ = make_data("mlp")
    if name == "network_in_scope":  # The network mirrored, the DPModel not.
        with STRATEGY.scope():
            net = network("mlp")
    else:
        net = network("mlp")
    model = DPModel(net, clip_norm=1.0, noise_multiplier=1.0, seed=DP_SEED)
    accumulation = 2 if name == "accumulation" else None
    optimizer = keras.optimizers.SGD(
        LEARNING_RATE, gradient_accumulation_steps=accumulation
    )
    model.compile(optimizer, "mse")
    before = flat(model.network.trainable_variables)
    begun = Begun()
    fitting = STRATEGY.scope() if name == "outside" else contextlib.nullcontext()
    try:
        with fitting:
            model.fit(x, y, batch_size=BATCH_SIZE, verbose=0, callbacks=[begun])
    except ValueError as error:
        return {"refusal": refusal(error, model, before, begun)}
    return {"refusal": None}


CONTRACT_CASES = ("dp_model_target_epsilon",)


def contract(directory):
    """`tests/contract.py` on DPModel (`test_private_model_contract`'s
    cases) built and fitted under the distribution: "passed", or the
    traceback; and the devices of every model it fitted."""
    from kdpemb.models._shared import data_parallel
    from tests.contract import run_private_model_contract
    from tests.test_private_model_contract import CASES

    report = {}
    for name in CONTRACT_CASES:
        case = CASES[name]()
        fitted = []
        fit_case = case.fit

        def counted(model, epochs, callbacks, fit_case=fit_case, fitted=fitted):
            fitted.append(data_parallel.device_count(model))
            return fit_case(model, epochs, callbacks)

        case.fit = counted
        path = Path(directory) / name
        path.mkdir(parents=True, exist_ok=True)
        try:
            with scope(distributed=True):
                run_private_model_contract(case, path)
            outcome = "passed"
        except BaseException as error:  # pytest.fail and pytest.raises too.
            if isinstance(error, KeyboardInterrupt):
                raise
            outcome = traceback.format_exc()
        report[name] = {"outcome": outcome, "devices_of_fitted_models": fitted}
    return report


def run(function, *args):
    try:
        return function(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def main():
    global STRATEGY
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    results = {"backend": keras.backend.backend(), "devices": DEVICES}
    units = ("example", "user")
    # The single-device references first, before any distribution exists.
    for name in SCENARIOS:
        results[f"single/{name}"] = run(fit, name, False)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        STRATEGY = tf.distribute.MirroredStrategy(DEVICES)
        results["num_replicas_in_sync"] = STRATEGY.num_replicas_in_sync
    else:
        import jax

        results["jax_devices"] = len(jax.devices())
        distribution = keras.distribution.DataParallel(devices=jax.devices())
        keras.distribution.set_distribution(distribution)
        results["mesh_devices"] = int(distribution.device_mesh.devices.size)
    for name in [*SCENARIOS, *(["jit"] if BACKEND == "tensorflow" else [])]:
        results[f"distributed/{name}"] = run(fit, name, True)
    for unit in units:
        results[f"distributed/sensitivity_{unit}"] = run(sensitivity, unit)
    results["distributed/contract"] = run(contract, directory)
    results["refusals"] = run(refusals)
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()

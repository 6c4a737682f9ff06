"""Runs LastLayerDPClassifier and feature extraction on two CPU devices
and prints the results as JSON.

`tests/models/test_last_layer_distributed.py` starts this script in a
fresh process, because the devices must be configured before TensorFlow
or JAX initialise (as `distributed_worker.py` does for FedEmb):

- TensorFlow: the one physical CPU is split into two logical devices and
  the distributed models are built in a `tf.distribute.MirroredStrategy`
  over both;
- JAX: `XLA_FLAGS=--xla_force_host_platform_device_count=2` (set by the
  parent) gives two CPU devices, spanned by a
  `keras.distribution.DataParallel`.

Every scenario runs first without distribution (the single-device
reference), then distributed, from the same initial weights and seeds.
The samples are a function of the step index (`index_seeded_sampling`):
Keras reads a batch or two ahead, differently on one device and on
several, and the samplers draw from a stateful generator. A scenario that
raises is reported with its traceback under `"error"`.

Usage: `KERAS_BACKEND=tensorflow|jax python last_layer_distributed_worker.py`.
The last line of stdout is one JSON object (see `main`). The tests import
this module only for its settings; importing it configures no devices.
"""

import contextlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np

BACKEND = os.environ.get("KERAS_BACKEND")
NUM_DEVICES = 2

# DP-SGD: N = 41 rows (odd, so batches are padded), d = 6, K = 3, expected
# batch B = 10, round(41 / 10) = 4 steps. User level: 14 users of 3 rows
# (the last of 2), k = 2, B_u = 5, round(14 / 5) = 3 steps.
NUM_EXAMPLES = 41
DIM = 6
NUM_CLASSES = 3
BATCH_SIZE = 10
STEPS = 4
EXAMPLES_PER_USER = 2
USERS_PER_STEP = 5
USER_STEPS = 3
CLIP_NORM = 0.3  # Below most gradient norms: most examples are clipped.
LEARNING_RATE = 0.5
L2 = 0.05  # Moves the random head by lr · l2 · W ≈ 1e-2 per step.
SAMPLING_SEED = 5
MODEL_SEED = 1
DELTA = 1e-3
# The noise scenario: z = 100, C = 1, B = 16 on 64 rows of d = 127 and
# K = 32 (4128 head coordinates), SGD(1): each step moves every coordinate
# by N(0, (z C / B)²) and the data by far less.
NOISE_ROWS = 64
NOISE_DIM = 127
NOISE_CLASSES = 32
NOISE_BATCH = 16
NOISE_MULTIPLIER = 100.0
NOISE_CLIP = 1.0
NOISE_STEPS = NOISE_ROWS // NOISE_BATCH
# Removal: one full-batch step at C = 0.05 (every gradient norm of a zero
# head is above 1), SGD(1) from zeros: the step is -total / population.
REMOVAL_CLIP = 0.05
# Features: 9 images of 4 x 4 x 1 in batches of 4 (4, 4, then 1 padded to 2).
NUM_IMAGES = 9
IMAGE_BATCH = 4
FEATURE_DIM = 5
CLOSED_FORMS = {"dp-ls": 1, "dp-newton": 2, "dp-fc": 2}  # Method: epochs.


# Not when the tests import this module for its settings.
DEVICES = None
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests`.
    from tests.models.worker_results import configure_cpu_devices

    DEVICES = configure_cpu_devices(BACKEND, NUM_DEVICES)
STRATEGY = None  # TensorFlow: the MirroredStrategy of the distributed runs.

import keras  # noqa: E402

import kdpemb  # noqa: E402
from kdpemb.data.poisson_batches import PoissonIndices  # noqa: E402
from kdpemb.data.user_batches import UserIndices  # noqa: E402
from kdpemb.distribute.hosts import Hosts  # noqa: E402
from kdpemb.models.last_layer import LastLayerDPClassifier  # noqa: E402
from kdpemb.models.last_layer import last_layer_dp_sgd_head as head  # noqa: E402

warnings.simplefilter("ignore")  # Fixed seeds warn; intended in a test.

SERVED = {"PoissonIndices": {}, "UserIndices": {}}  # Index -> sampled rows.
PADDED = {"PoissonIndices": set(), "UserIndices": set()}  # Rows of the batches.


def index_seeded_sampling():
    """Each sampler's draw for step i comes from a generator seeded by i,
    and is recorded (the rows it sampled) in `SERVED`."""
    for cls, tag in ((PoissonIndices, 0), (UserIndices, 1)):
        sample = cls.sample

        def seeded(self, index, sample=sample, cls=cls, tag=tag):
            self._rng = np.random.default_rng([SAMPLING_SEED, tag, int(index)])
            indices, mask = sample(self, index)
            SERVED[cls.__name__][int(index)] = indices[mask > 0].tolist()
            PADDED[cls.__name__].add(len(indices))
            return indices, mask

        cls.sample = seeded


def engine_scope(distributed):
    """The strategy's scope on TensorFlow when `distributed`."""
    if distributed and BACKEND == "tensorflow":
        return STRATEGY.scope()
    return contextlib.nullcontext()


def flat(values):
    return np.concatenate(
        [np.ravel(keras.ops.convert_to_numpy(v)).astype(np.float64) for v in values]
    ).tolist()


def replica_values(variable):
    """A variable's value on every replica (one value without replicas)."""
    value = variable.value
    return [
        np.ravel(keras.ops.convert_to_numpy(v)).tolist()
        for v in getattr(value, "values", [value])
    ]


class WeightsPerStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.after_step = []

    def on_train_batch_end(self, batch, logs=None):
        self.after_step.append(flat(self.model.head.weights))


class ClipProbe:
    """Records, per traced program, how many rows one device clips (static
    shape; None where the batch size is unknown to the trace) and which
    replica traced it (TensorFlow; None on JAX)."""

    def __init__(self):
        self.programs = []
        self._saved = (head.clipped_head_gradient, head.clipped_user_head_gradient)

    def _record(self, features):
        replica = None
        if BACKEND == "tensorflow":
            import tensorflow as tf

            context = tf.distribute.get_replica_context()
            if context is not None and context.num_replicas_in_sync > 1:
                replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        self.programs.append({"rows": features.shape[0], "replica": replica})

    def __enter__(self):
        example, user = self._saved

        def example_probe(features, *args, **kwargs):
            self._record(features)
            return example(features, *args, **kwargs)

        def user_probe(features, *args, **kwargs):
            self._record(features)
            return user(features, *args, **kwargs)

        head.clipped_head_gradient = example_probe
        head.clipped_user_head_gradient = user_probe
        return self

    def __exit__(self, *exc):
        head.clipped_head_gradient, head.clipped_user_head_gradient = self._saved


def dp_sgd_data(rows=NUM_EXAMPLES, dim=DIM, classes=NUM_CLASSES, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, rows).astype("int32")
    features = rng.normal(size=(rows, dim)) + 2.0 * np.eye(classes, dim)[labels]
    return features.astype("float32"), labels


def make_classifier(distributed, method="dp-sgd", **settings):
    keras.utils.set_random_seed(MODEL_SEED)  # The same random head each time.
    optimizer = settings.pop("optimizer", LEARNING_RATE)
    clipvalue = settings.pop("optimizer_clipvalue", None)
    with engine_scope(distributed):
        model = LastLayerDPClassifier(
            settings.pop("num_classes", NUM_CLASSES), method, seed=MODEL_SEED,
            delta=DELTA, **settings,
        )  # fmt: skip
        model.compile(keras.optimizers.SGD(optimizer, clipvalue=clipvalue))
    return model


def fit_dp_sgd(distributed, *, data=None, fit=None, **settings):
    """A DP-SGD fit: weights before and after each step, samples served,
    rows clipped per program, private steps (per replica)."""
    features, labels = data or dp_sgd_data()
    fit = dict(fit or {})
    model = make_classifier(distributed, "dp-sgd", **settings)
    for served in (*SERVED.values(), *PADDED.values()):
        served.clear()
    with engine_scope(distributed):
        model.build(features.shape)  # To read the initial weights.
    before = flat(model.head.weights)
    callback = WeightsPerStep()
    with ClipProbe() as probe:
        history = model.fit(
            features, labels, verbose=0, callbacks=[callback],
            epochs=fit.pop("epochs", 1), **fit,
        )  # fmt: skip
    tag = "UserIndices" if settings.get("unit") == "user" else "PoissonIndices"
    return {
        "before": before,
        "after_step": callback.after_step,
        "served": {str(i): rows for i, rows in sorted(SERVED[tag].items())},
        "padded_rows": sorted(PADDED[tag]),
        "programs": probe.programs,
        "private_steps": replica_values(model.private_steps),
        "kernel_replicas": replica_values(model.head.kernel),
        "history": {k: [float(x) for x in v] for k, v in history.history.items()},
    }


def equivalence(distributed):
    # With a ridge penalty: its gradient, as the noise, is added once.
    return fit_dp_sgd(
        distributed, clip_norm=CLIP_NORM, noise_multiplier=0.0, head_init="random",
        l2=L2, fit={"batch_size": BATCH_SIZE},
    )  # fmt: skip


def clipping_optimizer(distributed):
    # An optimizer that clips each coordinate of what it is given: it must
    # see the step's noised gradient once, never one replica's sum.
    return fit_dp_sgd(
        distributed, clip_norm=CLIP_NORM, noise_multiplier=0.0, head_init="random",
        optimizer_clipvalue=0.02, fit={"batch_size": BATCH_SIZE},
    )  # fmt: skip


def user_equivalence(distributed):
    features, labels = dp_sgd_data()
    users = np.arange(NUM_EXAMPLES) // 3
    return fit_dp_sgd(
        distributed, data=(features, labels), clip_norm=CLIP_NORM,
        noise_multiplier=0.0, head_init="random", unit="user",
        examples_per_user=EXAMPLES_PER_USER,
        fit={"batch_size": USERS_PER_STEP, "users": users},
    )  # fmt: skip


def noise(distributed):
    data = dp_sgd_data(NOISE_ROWS, NOISE_DIM, NOISE_CLASSES, seed=1)
    return fit_dp_sgd(
        distributed, data=data, clip_norm=NOISE_CLIP,
        noise_multiplier=NOISE_MULTIPLIER, num_classes=NOISE_CLASSES,
        optimizer=1.0, fit={"batch_size": NOISE_BATCH},
    )  # fmt: skip


def removal(distributed):
    """One full-batch step with and without example 0 (user 0 at user
    level): the clipped sums, `-population · step` from a zero head. Each
    user holds k examples (the last one fewer), so every step takes all
    of them: the two fits differ only by the removed user's rows."""
    features, labels = dp_sgd_data()
    users = np.arange(NUM_EXAMPLES) // EXAMPLES_PER_USER
    report = {}
    for unit, drop in (("example", [0]), ("user", list(range(EXAMPLES_PER_USER)))):
        keep = np.setdiff1d(np.arange(NUM_EXAMPLES), drop)
        for name, rows in (("all", np.arange(NUM_EXAMPLES)), ("without", keep)):
            settings = {"clip_norm": REMOVAL_CLIP, "noise_multiplier": 0.0}
            fit = {"batch_size": None}
            population = len(rows)
            if unit == "user":
                settings |= {"unit": "user", "examples_per_user": EXAMPLES_PER_USER}
                fit["users"] = users[rows]
                population = len(np.unique(users[rows]))
            result = fit_dp_sgd(
                distributed, data=(features[rows], labels[rows]), optimizer=1.0,
                fit=fit, **settings,
            )  # fmt: skip
            step = np.asarray(result["after_step"][0]) - result["before"]
            report[f"{unit}/{name}"] = (-population * step).tolist()
            report[f"{unit}/{name}/programs"] = result["programs"]
    return report


def closed_forms(distributed):
    features, labels = dp_sgd_data()
    report = {}
    for method, epochs in CLOSED_FORMS.items():
        model = make_classifier(
            distributed, method, feature_clip_norm=3.0, noise_multiplier=1.0,
            optimizer=1.0,
        )  # fmt: skip
        model.fit(features, labels, epochs=epochs, verbose=0)
        report[method] = {
            "kernel_replicas": replica_values(model.head.kernel),
            "private_steps": replica_values(model.private_steps),
        }
    return report


def backbone(distributed):
    keras.utils.set_random_seed(MODEL_SEED)
    with engine_scope(distributed):
        model = keras.Sequential(
            [
                keras.Input((4, 4, 1)),
                keras.layers.Rescaling(1 / 255),
                keras.layers.Flatten(),
                keras.layers.Dense(FEATURE_DIM),
            ]
        )
    return model


class PredictProbe:
    """Records the rows each device's program of the backbone receives:
    TensorFlow, per traced replica of `predict_step`; JAX, the shard of
    the batch on each device."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __enter__(self):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            step = self.model.predict_step

            def predict_step(data):
                context = tf.distribute.get_replica_context()
                replica = tf.get_static_value(context.replica_id_in_sync_group)
                self.calls.append(
                    {
                        "rows": data[0].shape[0],
                        "replica": int(replica),
                        "replicas": context.num_replicas_in_sync,
                    }
                )
                return step(data)

            self.model.predict_step = predict_step
        else:
            predict = self.model.predict_on_batch

            def predict_on_batch(x):
                sharding = getattr(x, "sharding", None)
                self.calls.append(
                    {
                        "rows": int(x.shape[0]),
                        "devices": 1 if sharding is None else len(sharding.device_set),
                        "shard_rows": (
                            int(x.shape[0])
                            if sharding is None
                            else int(sharding.shard_shape(x.shape)[0])
                        ),
                    }
                )
                return predict(x)

            self.model.predict_on_batch = predict_on_batch
        return self

    def __exit__(self, *exc):
        del self.model.__dict__[
            "predict_step" if BACKEND == "tensorflow" else "predict_on_batch"
        ]


def features(distributed):
    images = np.random.default_rng(2).integers(0, 256, (NUM_IMAGES, 4, 4, 1))
    images = images.astype("uint8")
    labels = np.arange(NUM_IMAGES)
    model = backbone(distributed)
    with PredictProbe(model) as probe:
        arrays = kdpemb.features.extract(
            model, images, batch_size=IMAGE_BATCH, verbose=0
        )
        pairs, pair_labels = kdpemb.features.extract(
            model, (images, labels), batch_size=IMAGE_BATCH, verbose=0
        )
    return {
        "features": arrays.tolist(),
        "pair_features": pairs.tolist(),
        "pair_labels": pair_labels.tolist(),
        "calls": probe.calls,
    }


def refusal(action):
    """The message of the ValueError `action()` raises, or None."""
    try:
        action()
    except ValueError as error:
        return str(error)
    return None


def unsupported_engine():
    """A two-device engine DP-SGD does not support: refused before any
    step, for DP-SGD and for a closed form."""
    features, labels = dp_sgd_data()
    report = {}
    if BACKEND == "tensorflow":
        import tensorflow as tf

        strategy = tf.distribute.experimental.CentralStorageStrategy(DEVICES)
        scope, restore = strategy.scope, lambda: None
    else:
        import jax

        mesh = keras.distribution.DeviceMesh((1, NUM_DEVICES), ["batch", "model"])
        layout_map = keras.distribution.LayoutMap(mesh)
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
        scope = contextlib.nullcontext
        del jax

        def restore():
            keras.distribution.set_distribution(previous)

    try:
        for method, settings in (
            ("dp-sgd", {}), ("dp-ls", {"feature_clip_norm": 3.0})
        ):  # fmt: skip
            with scope():
                model = LastLayerDPClassifier(
                    NUM_CLASSES, method, noise_multiplier=1.0, seed=MODEL_SEED,
                    delta=DELTA, **settings,
                )  # fmt: skip
            message = refusal(
                lambda model=model: model.fit(features, labels, verbose=0)
            )
            report[method] = {
                "refused": message,
                "built": bool(model.built),
                "private_steps": replica_values(model.private_steps),
            }
    finally:
        restore()
    return report


def several_hosts():
    """Feature extraction under a job of two hosts (faked) is refused
    before the backbone runs."""
    model = backbone(distributed=True)
    distribute = kdpemb.distribute
    current_hosts = distribute.current_hosts
    hosts = Hosts(0, 2, lambda words: np.stack([words] * 2), engine="test")
    distribute.current_hosts = lambda model=None: hosts
    try:
        with PredictProbe(model) as probe:
            images = np.zeros((NUM_IMAGES, 4, 4, 1), "uint8")
            message = refusal(lambda: kdpemb.features.extract(model, images, verbose=0))
    finally:
        distribute.current_hosts = current_hosts
    return {"refused": message, "calls": probe.calls}


SCENARIOS = {
    "equivalence": equivalence,
    "clipping_optimizer": clipping_optimizer,
    "user_equivalence": user_equivalence,
    "noise": noise,
    "closed_forms": closed_forms,
    "features": features,
}
DISTRIBUTED_ONLY = {
    "removal": lambda: removal(distributed=True),
    "unsupported_engine": unsupported_engine,
    "hosts": several_hosts,
}


def run(scenario, *args):
    try:
        return scenario(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def main():
    global STRATEGY
    index_seeded_sampling()
    results = {"backend": keras.backend.backend(), "devices": DEVICES}
    # The single-device references first, before any distribution exists.
    for name, scenario in SCENARIOS.items():
        results[f"single/{name}"] = run(scenario, False)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        STRATEGY = tf.distribute.MirroredStrategy(DEVICES)
        results["num_replicas_in_sync"] = STRATEGY.num_replicas_in_sync
    else:
        import jax

        distribution = keras.distribution.DataParallel(devices=jax.devices())
        keras.distribution.set_distribution(distribution)
        results["mesh_devices"] = int(distribution.device_mesh.devices.size)
    for name, scenario in SCENARIOS.items():
        results[f"distributed/{name}"] = run(scenario, True)
    for name, scenario in DISTRIBUTED_ONLY.items():
        results[f"distributed/{name}"] = run(scenario)
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()

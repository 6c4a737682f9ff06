"""One host of a multi-host `DPModel` job, for `test_dp_model_multi_host.py`.

Usage: `KERAS_BACKEND=jax|tensorflow python dp_model_multi_host_worker.py
HOST HOSTS PORT OUT_DIR`. With HOSTS > 1 the process joins a job of HOSTS
local processes: JAX through `keras.distribution.initialize` (one CPU
device each) and `DataParallel(auto_shard_dataset=False)`; TensorFlow as
a `MultiWorkerMirroredStrategy` worker (one replica) on localhost ports
PORT, PORT + 1, ... With HOSTS = 1 it is the one-process reference of the
seeded scenarios. It writes `OUT_DIR/host<HOST>.json`:

- `examples`, `users`: seeded fits without noise (the sample of batch i
  a function of i, as Keras reads batches ahead): the weights after each
  step, every sample drawn and the rows this host served;
- `noise`: the real set-up (seeds from OS entropy, the chief's shared),
  inputs of zeros, so every per-example gradient is 0 and each step is
  the noise alone;
- `drift`: host 1's sampler draws one sample more before the fit, so its
  batches run one sample ahead of the chief's;
- `refusals`: hosts that differ (in the data's length, in `clip_norm`).

A scenario that raises stops the process with status 1 (after writing
the report), so that a peer waiting for it in a collective is ended too.
"""

import json
import os
import sys
import traceback
import warnings

HOST, HOSTS, PORT = (int(a) for a in sys.argv[1:4])
OUT_DIR = sys.argv[4]
BACKEND = os.environ["KERAS_BACKEND"]
STRATEGY = None


class _WithoutTensorFlow:
    """A JAX host never needs TensorFlow (importing it costs seconds)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


if BACKEND == "jax":
    sys.meta_path.insert(0, _WithoutTensorFlow())

if HOSTS > 1 and BACKEND == "tensorflow":
    workers = [f"localhost:{PORT + i}" for i in range(HOSTS)]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": HOST}}
    )
    import tensorflow as tf

    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

if HOSTS > 1 and BACKEND == "jax":
    keras.distribution.initialize(f"localhost:{PORT}", HOSTS, HOST)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False)
    )

import contextlib  # noqa: E402

import numpy as np  # noqa: E402

from kdpemb import distribute  # noqa: E402
from kdpemb.data.poisson_batches import PoissonBatches, PoissonIndices  # noqa: E402
from kdpemb.data.user_batches import UserBatches, UserIndices  # noqa: E402
from kdpemb.errors import HostsDisagreeError  # noqa: E402
from kdpemb.models import DPModel  # noqa: E402
from kdpemb.models._shared import data_parallel  # noqa: E402
from kdpemb.models.dp_sgd import distributed_fit  # noqa: E402

warnings.simplefilter("ignore")  # Fixed seeds warn; intended in a test.
keras.config.disable_traceback_filtering()  # Whole tracebacks in the report.

# 48 examples of 64 features (16 users of 3), batches of B = 16 expected
# examples (B_u = 6 users, k = 2), 3 steps; physical batches of 4 rows.
# The network has no biases: inputs of zeros give zero gradients, and
# its 64 * 64 + 64 * 2 = 4224 weights sample the noise.
NUM_EXAMPLES, FEATURES, HIDDEN, CLASSES = 48, 64, 64, 2
EXAMPLES_PER_USER, USERS_PER_STEP, K = 3, 6, 2
BATCH_SIZE, PHYSICAL, STEPS = 16, 4, 3
DATA_SEED, MODEL_SEED, SAMPLE_SEED = 5, 11, 23
CLIP_NORM, NOISE_MULTIPLIER = 1.0, 1.0


def make_data():
    rng = np.random.default_rng(DATA_SEED)
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, NUM_EXAMPLES).astype("int32")
    return x, y, np.arange(NUM_EXAMPLES) // EXAMPLES_PER_USER


X, Y, USERS = make_data()
ROW_OF = {row.tobytes(): i for i, row in enumerate(X)}


def make_model(**settings):
    keras.utils.set_random_seed(MODEL_SEED)  # The same weights everywhere.
    scope = STRATEGY.scope() if STRATEGY is not None else contextlib.nullcontext()
    with scope:
        network = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(HIDDEN, "relu", use_bias=False),
                keras.layers.Dense(CLASSES, use_bias=False),
            ]
        )
        settings = {"clip_norm": CLIP_NORM, "physical_batch_size": PHYSICAL, **settings}
        model = DPModel(network, **settings)
        model.compile(
            keras.optimizers.SGD(learning_rate=1.0),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def flat_weights(model):
    return np.concatenate(
        [
            np.ravel(keras.ops.convert_to_numpy(v.value)).astype(np.float64)
            for v in model.network.trainable_variables
        ]
    ).tolist()


def private_steps(model):
    return int(keras.ops.convert_to_numpy(model.private_steps.value))


class WeightsPerStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.after_step = []

    def on_train_batch_end(self, batch, logs=None):
        self.after_step.append(flat_weights(self.model))


class Recorder:
    """Records every sample the fit's batches draw (`[index, indices,
    mask]`, in the order drawn) and every batch this host served
    (`HostBatches`: `[index, rows of x, mask, batch digest]`). `seeded`:
    sample i is drawn from a generator seeded by (SAMPLE_SEED, i), so
    that it does not depend on how many batches Keras read ahead."""

    def __init__(self, seeded):
        self.seeded, self.drawn, self.served = seeded, [], []

    def __enter__(self):
        recorder = self
        self.saved = (
            PoissonIndices.sample,
            UserIndices.sample,
            data_parallel.HostBatches.__getitem__,
        )
        poisson, users, host_batch = self.saved

        def poisson_sample(batches, index):
            if recorder.seeded:
                batches._rng = np.random.default_rng([SAMPLE_SEED, 0, index])
            return recorder._drawn(batches, index, poisson(batches, index))

        def users_sample(batches, index):
            if recorder.seeded:
                batches._rng = np.random.default_rng([SAMPLE_SEED, 1, index])
            return recorder._drawn(batches, index, users(batches, index))

        def served(batches, index):
            features, labels, mask, digest = host_batch(batches, index)
            rows = [ROW_OF.get(np.asarray(f).tobytes(), -1) for f in features]
            recorder.served.append([int(index), rows, mask.tolist(), int(digest[0])])
            return features, labels, mask, digest

        PoissonIndices.sample, UserIndices.sample = poisson_sample, users_sample
        data_parallel.HostBatches.__getitem__ = served
        return self

    def _drawn(self, batches, index, sample):
        # The fit's sample, not the users' draw inside a `UserBatches`.
        if isinstance(batches, (PoissonBatches, UserBatches)):
            indices, mask = sample
            self.drawn.append([int(index), indices.tolist(), mask.tolist()])
        return sample

    def __exit__(self, *exc):
        poisson, users, host_batch = self.saved
        PoissonIndices.sample, UserIndices.sample = poisson, users
        data_parallel.HostBatches.__getitem__ = host_batch


def seeded_fit(**fit_kwargs):
    """Seeded, no noise, C = 1: the weights after each step and the
    samples drawn and served."""
    unit = {"unit": "user", "examples_per_user": K} if "users" in fit_kwargs else {}
    model = make_model(noise_multiplier=0.0, seed=MODEL_SEED, **unit)
    before = flat_weights(model)
    weights = WeightsPerStep()
    with Recorder(seeded=True) as recorder:
        history = model.fit(
            X, Y, epochs=1, verbose=0, callbacks=[weights], **fit_kwargs
        )
    return {
        "before": before,
        "after_step": weights.after_step,
        "drawn": recorder.drawn,
        "served": recorder.served,
        "private_steps": history.history["private_steps"],
    }


def examples():
    return seeded_fit(batch_size=BATCH_SIZE)


def users():
    return seeded_fit(users=USERS, batch_size=USERS_PER_STEP)


def seed_state(model):
    return keras.ops.convert_to_numpy(model.noise_seed.state.value).tolist()


def noise():
    """The real set-up: zero gradients, so each step is the noise alone."""
    model = make_model(noise_multiplier=NOISE_MULTIPLIER)
    seed_before = seed_state(model)
    seeds = []
    at_start = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seeds.append(seed_state(model))
    )
    before = flat_weights(model)
    weights = WeightsPerStep()
    with Recorder(seeded=False) as recorder:
        model.fit(
            np.zeros_like(X), Y, batch_size=BATCH_SIZE, epochs=1, verbose=0,
            callbacks=[at_start, weights],
        )  # fmt: skip
    return {
        "seed_before": seed_before,
        "seed_at_start": seeds[0],
        "before": before,
        "after_step": weights.after_step,
        "drawn": recorder.drawn,
        "served": recorder.served,
        "private_steps": private_steps(model),
    }


def drift():
    """Host 1's sampler draws one sample before the fit starts."""
    build = distributed_fit.batches

    def ahead(*args):
        batches = build(*args)
        batches.sample(0)
        return batches

    model = make_model(noise_multiplier=NOISE_MULTIPLIER)
    before = flat_weights(model)
    if HOST == 1:
        distributed_fit.batches = ahead
    try:
        with Recorder(seeded=False) as recorder:
            model.fit(X, Y, batch_size=BATCH_SIZE, epochs=1, verbose=0)
        refused = None
    except HostsDisagreeError as error:
        refused = str(error)
    finally:
        distributed_fit.batches = build
    return {
        "refused": refused,
        "private_steps": private_steps(model),
        "unchanged": flat_weights(model) == before,
        "served": recorder.served,
    }


def refusals():
    """Hosts that differ are refused before any step, on every host."""
    report = {}
    attempts = {
        "fewer_examples": ({}, NUM_EXAMPLES - 1 if HOST == 1 else NUM_EXAMPLES),
        "clip_norm": ({"clip_norm": 2.0 if HOST == 1 else CLIP_NORM}, NUM_EXAMPLES),
    }
    for name, (settings, rows) in attempts.items():
        model = make_model(noise_multiplier=NOISE_MULTIPLIER, **settings)
        before = flat_weights(model)
        try:
            model.fit(X[:rows], Y[:rows], batch_size=BATCH_SIZE, verbose=0)
            refused = None
        except HostsDisagreeError as error:
            refused = str(error)
        report[name] = {
            "refused": refused,
            "private_steps": private_steps(model),
            "unchanged": flat_weights(model) == before,
        }
    # The same shapes, other rows on host 1 (another file, another order).
    x, y = (X[::-1], Y[::-1]) if HOST == 1 else (X, Y)
    report["other_rows"] = refused_fit(HostsDisagreeError, x, y)
    # A non-finite input on host 1 only: host 1 refuses it, host 0 learns
    # that host 1 refused (instead of waiting for it in a collective).
    x = X.copy()
    if HOST == 1:
        x[3, 0] = np.nan
    report["one_host_refuses"] = refused_fit(Exception, x, Y)
    if BACKEND == "jax":  # Processes with no distribution: each alone.
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            report["no_distribution"] = refused_fit(ValueError, X, Y)
        finally:
            keras.distribution.set_distribution(distribution)
    return report


def refused_fit(expected, x, y):
    """A fit expected to raise `expected` before any step."""
    model = make_model(noise_multiplier=NOISE_MULTIPLIER)
    before = flat_weights(model)
    try:
        model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
        refused = None
    except expected as error:
        refused = f"{type(error).__name__}: {error}"
    return {
        "refused": refused,
        "private_steps": private_steps(model),
        "unchanged": flat_weights(model) == before,
    }


def main():
    with STRATEGY.scope() if STRATEGY is not None else contextlib.nullcontext():
        hosts = distribute.current_hosts()
    report = {"host": HOST, "hosts": [hosts.index, hosts.count]}
    scenarios = {"examples": examples, "users": users}
    if HOSTS > 1:  # The one process is the reference of the seeded fits.
        scenarios.update(noise=noise, drift=drift, refusals=refusals)
    failed = False
    for name, scenario in scenarios.items():
        try:
            report[name] = scenario()
        except Exception:
            report[name] = {"error": traceback.format_exc()}
            sys.stderr.write(f"{name} failed on host {HOST}:\n{report[name]['error']}")
            failed = True
            break  # Its peers may wait for it in a collective: stop them.
    with open(os.path.join(OUT_DIR, f"host{HOST}.json"), "w") as file:
        json.dump(report, file)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()

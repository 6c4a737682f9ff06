"""Runs FedEmbModel rounds on two CPU devices and prints the results as JSON.

`tests/models/test_fedemb_distributed.py` starts this script in a fresh
process, because the devices must be configured before TensorFlow or JAX
initialise:

- TensorFlow: the one physical CPU is split into two logical devices
  (`tf.config.set_logical_device_configuration`), and the distributed
  model is built and compiled in a `tf.distribute.MirroredStrategy` over
  both; it is fed `VirtualClients.to_tf_dataset()`.
- JAX: `XLA_FLAGS=--xla_force_host_platform_device_count=2` (set by the
  parent) gives two CPU devices, `keras.distribution.DataParallel` spans
  them, and the model is fed the `VirtualClients` itself.

Every scenario also runs without distribution in the same process, from
the same initial weights, seeds and rounds, as the single-device
reference. A scenario that raises is reported with its traceback under
`"error"` so that the parent test shows it. `unknown_length` runs only
distributed: it feeds rounds whose number is unknown up front (a
filtered `tf.data.Dataset` on TensorFlow, a generator on JAX).

Usage: `KERAS_BACKEND=tensorflow|jax python distributed_worker.py`. The
last line of stdout is one JSON object (see `main`). The tests import this
module only for its settings; importing it configures no devices.
"""

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np

BACKEND = os.environ.get("KERAS_BACKEND")
NUM_DEVICES = 2

# Rounds: 16 single-identity users in P = 8 virtual clients of k = 2 (P
# given, as a public count would be),
# Poisson sampling with M = 6 (q = 0.75) into M_max = 8 rows, 4 per
# device. With this sampling seed every round 0..7 samples 5 to 7 clients,
# so both devices' halves of the client axis hold sampled clients.
NUM_USERS = 16
IMAGES_PER_USER = 4
USERS_PER_CLIENT = 2
CLIENTS_PER_ROUND = 6
MAX_CLIENTS = 8
LOCAL_STEPS = 2  # Heads start at zero: the backbone moves from step 2 on.
BATCH_SIZE = 4
IMAGE_SIZE = 8
EMBEDDING_DIM = 64  # Flatten(8 * 8) -> Dense(64): 4160 backbone parameters.
DATA_SEED = 3
SAMPLING_SEED = 16
MODEL_SEED = 11
ROUNDS = 2
# The noise scenario: z = 1, C = 1, so each coordinate of the server's
# step is N(0, (z C / M)^2) when the noise is added exactly once.
NOISE_MULTIPLIER = 1.0
NOISE_CLIP = 1.0
DELTA = 1e-3


# Not when the tests import this module for its settings.
DEVICES = None
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests`.
    from tests.models.worker_results import configure_cpu_devices

    DEVICES = configure_cpu_devices(BACKEND, NUM_DEVICES)
STRATEGY = None  # TensorFlow: the MirroredStrategy of the distributed runs.

import keras  # noqa: E402

from kdpemb.callbacks import PrivacyBudget  # noqa: E402
from kdpemb.data import VirtualClients  # noqa: E402
from kdpemb.datasets import synthetic_identities  # noqa: E402
from kdpemb.models import FedEmbModel  # noqa: E402
from kdpemb.models.fedemb import fedemb_round  # noqa: E402
from kdpemb.privacy import AdaptiveClipping  # noqa: E402

warnings.simplefilter("ignore")  # Fixed seeds warn; intended in a test.

SCENARIOS = {
    # No noise, no clipping: the round is plain federated averaging, and
    # the distributed result must equal the single-device one.
    "equivalence": {
        "clip_norm": 1e6,
        "noise_multiplier": 0.0,
        "client_optimizer": 0.05,
    },
    # A server optimizer that clips each coordinate of what it is given:
    # it must see the round's noised mean once, never one replica's share.
    "server_clipvalue": {
        "clip_norm": 1e6,
        "noise_multiplier": 0.0,
        "client_optimizer": 0.05,
        "server_clipvalue": 0.003,
    },
    # Client updates vanish (θ + 1e-30 · g rounds to θ in float32), so the
    # server step is the noise alone.
    "noise": {
        "clip_norm": NOISE_CLIP,
        "noise_multiplier": NOISE_MULTIPLIER,
        "client_optimizer": 1e-30,
    },
    # Adaptive clipping, C small enough to clip: the count of clients
    # within C is summed over the devices and noised once, so C (and the
    # backbone) end as on one device, where the same seed draws the same
    # count noise (noised on both devices, or summed on one, they differ).
    "adaptive": {
        "clip_norm": 0.02,
        "noise_multiplier": 0.0,
        "client_optimizer": 0.05,
        "adaptive_clipping": AdaptiveClipping(0.5, 0.5, count_stddev=0.5),
    },
    # DP-FTRL: rounds without sampling (twice the users: P = 16 slots in
    # R = 2 rounds of M_max = 8 rows), the server step is the tree's noise
    # alone; the tree state must stay one across the devices.
    "tree": {
        "clip_norm": NOISE_CLIP,
        "noise_multiplier": NOISE_MULTIPLIER,
        "client_optimizer": 1e-30,
        "noise": "tree",
        "sampling": "epochs",
    },
}


def make_clients(sampling="poisson"):
    """A fresh `VirtualClients`: the same seeds give the same rounds."""
    users = NUM_USERS if sampling == "poisson" else 2 * NUM_USERS
    data = synthetic_identities(
        users, IMAGES_PER_USER, image_size=IMAGE_SIZE, channels=1, seed=DATA_SEED
    )
    sampled = {
        "clients_per_round": CLIENTS_PER_ROUND,
        "max_clients_per_round": MAX_CLIENTS,
    }
    return VirtualClients(
        data,
        users_per_client=USERS_PER_CLIENT,
        num_clients=users // USERS_PER_CLIENT,
        local_steps=LOCAL_STEPS,
        batch_size=BATCH_SIZE,
        rounds_per_epoch=ROUNDS,
        seed=SAMPLING_SEED,
        workers=1,
        sampling=sampling,
        **(sampled if sampling == "poisson" else {}),
    )


def make_model(clients, settings):
    settings = dict(settings)
    server_clipvalue = settings.pop("server_clipvalue", None)
    keras.utils.set_random_seed(MODEL_SEED)  # Same initial weights each time.
    backbone = keras.Sequential(
        [
            keras.Input((IMAGE_SIZE, IMAGE_SIZE, 1)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Flatten(),
            keras.layers.Dense(EMBEDDING_DIM, name="embedding"),
        ],
        name="flat_dense",
    )
    # The schedule is given: a tf.data.Dataset of rounds does not carry it.
    model = FedEmbModel(
        backbone, schedule=clients.schedule, seed=MODEL_SEED, **settings
    )
    # The server optimizer: one step moves θ by exactly the noisy mean.
    model.compile(
        optimizer=keras.optimizers.SGD(
            learning_rate=1.0, momentum=0.0, clipvalue=server_clipvalue
        )
    )
    return model


def flat_weights(model):
    return np.concatenate(
        [
            np.ravel(keras.ops.convert_to_numpy(w)).astype(np.float64)
            for w in model.backbone.trainable_variables
        ]
    ).tolist()


class RoundProbe:
    """Records, for every traced round, how many client rows one device's
    program trains (a TensorFlow replica's; on JAX, a `shard_map` body's)."""

    def __init__(self):
        self.rows = []
        self._run_round = fedemb_round.run_round

    def __enter__(self):
        def probe(trainer, theta, non_trainable, heads, data, **kwargs):
            self.rows.append(int(data["images"].shape[0]))
            return self._run_round(trainer, theta, non_trainable, heads, data, **kwargs)

        fedemb_round.run_round = probe
        return self

    def __exit__(self, *exc):
        fedemb_round.run_round = self._run_round


class WeightsPerRound(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.after_round = []

    def on_train_batch_end(self, batch, logs=None):
        self.after_round.append(flat_weights(self.model))


def record_served_rounds(clients):
    """Wraps `clients.host_round` (what training reads) to record which
    rounds it served (and masks)."""
    served = []
    build = clients.host_round

    def round_(index):
        element = build(index)
        served.append({"index": int(index), "mask": element["client_mask"].tolist()})
        return element

    clients.host_round = round_
    return served


def fit(settings, distributed):
    """Builds a model (in the strategy's scope if TensorFlow and
    `distributed`), fits it on `ROUNDS` rounds, and reports what happened."""
    settings = dict(settings)
    clients = make_clients(settings.pop("sampling", "poisson"))
    served = record_served_rounds(clients)
    report = {"served": served}
    if distributed and BACKEND == "tensorflow":
        with STRATEGY.scope():
            model = make_model(clients, settings)
        report["copies_per_variable"] = [
            len(getattr(v.value, "values", ()))
            for v in model.backbone.trainable_variables
        ]
        x = clients.to_tf_dataset()
    elif BACKEND == "tensorflow":
        model = make_model(clients, settings)
        x = clients.to_tf_dataset()
    else:
        model = make_model(clients, settings)
        report["devices_per_variable"] = [
            len(v.value.sharding.device_set) for v in model.backbone.trainable_variables
        ]
        report["client_parallelism"] = model._round_config(
            MAX_CLIENTS
        ).client_parallelism
        x = clients
    report["before"] = flat_weights(model)
    callback = WeightsPerRound()
    with RoundProbe() as probe:
        history = model.fit(x, epochs=1, verbose=0, callbacks=[callback])
    report["rows_per_program"] = probe.rows
    report["after_round"] = callback.after_round
    report["after"] = flat_weights(model)
    report["history"] = {k: [float(x) for x in v] for k, v in history.history.items()}
    report["private_steps"] = int(keras.ops.convert_to_numpy(model.private_steps.value))
    if model.adaptive_clipping is not None:
        value = model.current_clip_norm.value
        report["clip_norms"] = [
            float(keras.ops.convert_to_numpy(v))
            for v in getattr(value, "values", [value])
        ]
    return report


def replica_private_steps(model):
    """`private_steps` on every replica (one value without replicas)."""
    value = model.private_steps.value
    return [
        int(keras.ops.convert_to_numpy(v)) for v in getattr(value, "values", [value])
    ]


def unknown_length():
    """Distributed fits on rounds of unknown number. TensorFlow: refused
    without `steps_per_epoch` (before any round), counted exactly with it;
    JAX: counted exactly."""
    clients = make_clients()
    report = {}
    budget = PrivacyBudget(DELTA, verbose=0)
    if BACKEND == "tensorflow":
        with STRATEGY.scope():
            model = make_model(clients, SCENARIOS["noise"])

        def rounds():
            return clients.to_tf_dataset().filter(lambda round_: True)

        try:
            model.fit(rounds(), epochs=1, verbose=0)
            report["refused"] = None
        except ValueError as error:
            report["refused"] = str(error)
        report["steps_after_refusal"] = replica_private_steps(model)
        history = model.fit(
            rounds(), epochs=1, verbose=0, steps_per_epoch=ROUNDS, callbacks=[budget]
        )
    else:
        model = make_model(clients, SCENARIOS["noise"])
        history = model.fit(
            ((round_,) for round_ in clients), epochs=1, verbose=0, callbacks=[budget]
        )
    report["replica_private_steps"] = replica_private_steps(model)
    report["budget_steps"] = budget.statement.steps
    report["history"] = {k: [float(x) for x in v] for k, v in history.history.items()}
    return report


def run(name, distributed):
    try:
        if name == "unknown_length":
            return unknown_length()
        return fit(SCENARIOS[name], distributed)
    except Exception:
        return {"error": traceback.format_exc()}


def main():
    global STRATEGY
    results = {"backend": keras.backend.backend(), "devices": DEVICES}
    # The single-device references first, before any distribution exists.
    for name in SCENARIOS:
        results[f"single/{name}"] = run(name, distributed=False)
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
    for name in SCENARIOS:
        results[f"distributed/{name}"] = run(name, distributed=True)
    results["distributed/unknown_length"] = run("unknown_length", distributed=True)
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()

"""One host of a multi-host DP-FedEmb job, for `test_fedemb_multi_host.py`.

Usage: `KERAS_BACKEND=jax|tensorflow python multi_host_worker.py HOST
HOSTS PORT OUT_DIR DATA_DIR`, with DATA_DIR the users' images written by
`write_user_shards` (the test writes it; every host opens it, and each
reads only the examples of its own rows). With HOSTS > 1 the process
joins a job of HOSTS local processes: JAX through
`keras.distribution.initialize` (one CPU device each, collectives over
gloo) and `DataParallel(auto_shard_dataset=False)`; TensorFlow as a
worker of a `MultiWorkerMirroredStrategy` on localhost ports PORT,
PORT + 1, ... With HOSTS = 1 it is the one-process
reference of the same seeded rounds (`equivalence` only). It writes
`OUT_DIR/host<HOST>.json`:

- `equivalence`: seeded rounds (the only place a fixed seed is used), no
  noise and no clipping: the backbone after each round, and which rows
  each host served;
- `noise`: the real set-up (sampling and noise seeds from entropy, shared
  by the chief), client updates that vanish: each round's step is the
  noise alone;
- `drift`: host 1's round source runs one round ahead of the others;
- `resume`: a fit with `AtomicBackupAndRestore` and `PrivacyLedger` in one
  shared directory stops (on every host) at the start of epoch 2; fresh
  models and `VirtualClients` resume it. Counts the files each host wrote.
"""

import json
import os
import sys
import traceback
import warnings

HOST, HOSTS, PORT = (int(a) for a in sys.argv[1:4])
OUT_DIR, DATA_DIR = sys.argv[4:6]
BACKEND = os.environ["KERAS_BACKEND"]
STRATEGY = None


class _NoTensorFlow:
    """As on a JAX machine without TensorFlow: nothing here may need it
    (Keras' seeding would import it, for seconds of each process)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


if BACKEND == "jax":
    sys.meta_path.insert(0, _NoTensorFlow())

if HOSTS > 1 and BACKEND == "tensorflow":
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{PORT + i}" for i in range(HOSTS)]},
            "task": {"type": "worker", "index": HOST},
        }
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
import hashlib  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402

from kdpemb import _atomic, distribute  # noqa: E402
from kdpemb.callbacks import (  # noqa: E402
    AtomicBackupAndRestore,
    PrivacyLedger,
    RecallAtFAR,
)
from kdpemb.data import VirtualClients  # noqa: E402
from kdpemb.datasets import UserShards, synthetic_identities  # noqa: E402
from kdpemb.errors import HostsDisagreeError  # noqa: E402
from kdpemb.models import FedEmbModel  # noqa: E402
from kdpemb.privacy import ledger  # noqa: E402
from tests.models.distributed_worker import (  # noqa: E402
    WeightsPerRound,
    flat_weights,
)

warnings.simplefilter("ignore")  # Fixed seeds warn; intended in a test.

# 16 users in P = 8 virtual clients of k = 2, Poisson with M = 6 into
# M_max = 8 rows (4 per host); 2 local steps of 4 images of 8 x 8.
NUM_USERS, IMAGES_PER_USER, USERS_PER_CLIENT = 16, 4, 2
CLIENTS_PER_ROUND, MAX_CLIENTS, LOCAL_STEPS, BATCH_SIZE = 6, 8, 2, 4
IMAGE_SIZE, EMBEDDING_DIM, ROUNDS = 8, 32, 2
DATA_SEED, SAMPLING_SEED, MODEL_SEED = 3, 16, 11
NOISE_MULTIPLIER, CLIP_NORM = 1.0, 1.0


class RecordedReads:
    """The images of a `UserShards`, recording which rows are read."""

    def __init__(self, images):
        self.images, self.rows = images, set()
        self.shape, self.dtype = images.shape, images.dtype

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        self.rows.update(np.asarray(index).ravel().tolist())
        return self.images[index]


def make_clients(seed):
    return VirtualClients(
        UserShards(DATA_DIR),
        clients_per_round=CLIENTS_PER_ROUND,
        users_per_client=USERS_PER_CLIENT,
        num_clients=NUM_USERS // USERS_PER_CLIENT,
        max_clients_per_round=MAX_CLIENTS,
        local_steps=LOCAL_STEPS,
        batch_size=BATCH_SIZE,
        rounds_per_epoch=ROUNDS,
        seed=seed,
        workers=1,
    )


def make_model(clients, seed, **settings):
    keras.utils.set_random_seed(MODEL_SEED)  # The same weights everywhere.
    scope = STRATEGY.scope() if STRATEGY is not None else contextlib.nullcontext()
    with scope:
        backbone = keras.Sequential(
            [
                keras.Input((IMAGE_SIZE, IMAGE_SIZE, 1)),
                keras.layers.Rescaling(1 / 255),
                keras.layers.Flatten(),
                keras.layers.Dense(EMBEDDING_DIM),
            ]
        )
        model = FedEmbModel(backbone, schedule=clients.schedule, seed=seed, **settings)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0))
    return model


def record_served(clients):
    """Wraps `clients.host_round`: the round index and global labels of
    every row this host served."""
    served = []
    build = clients.host_round

    def host_round(index):
        element = build(index)
        served.append(
            {
                "index": int(index),
                "mask": element["client_mask"].tolist(),
                "labels": element["global_labels"].tolist(),
            }
        )
        return element

    clients.host_round = host_round
    return served


def digest(value):
    return hashlib.blake2b(repr(value).encode(), digest_size=16).hexdigest()


def examples_of(clients, indices, hosts):
    """The example rows of the clients each host serves in these rounds."""
    rows = [set() for _ in range(hosts)]
    for index in indices:
        plans = list(clients.plan_round(index).values())
        for host in range(hosts):
            for plan in plans[host::hosts]:
                grid = plan.example_index
                rows[host].update(grid[grid >= 0].tolist())
    return rows


def equivalence():
    clients = make_clients(SAMPLING_SEED)
    served = record_served(clients)
    reads = clients._images = RecordedReads(clients._images)
    model = make_model(
        clients, MODEL_SEED, clip_norm=1e6, noise_multiplier=0.0, client_optimizer=0.05
    )
    before = flat_weights(model)
    weights = WeightsPerRound()
    # One TensorFlow process fits the rounds as tf.data (each pass claims
    # a new epoch of rounds), as the TensorFlow workers' fit does.
    x = clients.to_tf_dataset() if BACKEND == "tensorflow" and HOSTS == 1 else clients
    history = model.fit(x, epochs=1, verbose=0, callbacks=[weights])
    # The whole rounds, as one process builds them, for the test to slice.
    reference = make_clients(SAMPLING_SEED)
    indices = [entry["index"] for entry in served]
    rounds = [reference.round(index) for index in indices]
    examples = examples_of(reference, indices, HOSTS)
    return {
        "read_rows": len(reads.rows),
        "rows_of_my_clients": len(examples[HOST]),
        "rows_of_all_clients": len(set().union(*examples)),
        "read_outside_my_clients": len(reads.rows - examples[HOST]),
        "before": before,
        "after_round": weights.after_round,
        "served": served,
        "full_rounds": [
            {"mask": r["client_mask"].tolist(), "labels": r["global_labels"].tolist()}
            for r in rounds
        ],
        "private_steps": history.history["private_steps"],
    }


NOISE_SETTINGS = {
    "clip_norm": CLIP_NORM,
    "noise_multiplier": NOISE_MULTIPLIER,
    "client_optimizer": 1e-30,
}


def noise():
    clients = make_clients(None)
    seed_before = digest(clients._root_seed)
    model = make_model(clients, None, **NOISE_SETTINGS)
    # Python's `random` differs between the hosts from here on (as any
    # library's use of it on one host would make it): Keras must not use it
    # to order the rounds.
    random.seed(1000 + HOST)
    before = flat_weights(model)
    weights = WeightsPerRound()
    model.fit(clients, epochs=1, verbose=0, callbacks=[weights])
    return {
        "before": before,
        "after_round": weights.after_round,
        "seed_before": seed_before,
        "seed_after": digest(clients._root_seed),
        "plan": clients.plan_fingerprint().hex(),
    }


class StopAtEpoch(keras.callbacks.Callback):
    """Raises on every host at the first round of `epoch`, as a crash."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"stopped at epoch {epoch}")


def count_writes():
    """Counts this host's atomic file writes (backups, ledger)."""
    counts = {"files": 0}
    atomic_path = _atomic.atomic_path

    def counting(*args, **kwargs):
        counts["files"] += 1
        return atomic_path(*args, **kwargs)

    _atomic.atomic_path = counting
    return counts


def drift():
    """Host 1 serves round r + 1 where the others serve round r."""
    clients = make_clients(None)
    if HOST == 1:
        serve = clients.host_round
        clients.host_round = lambda index: serve(index + 1)
    model = make_model(clients, None, **NOISE_SETTINGS)
    before = flat_weights(model)
    try:
        model.fit(clients, epochs=1, verbose=0)
        refused = None
    except HostsDisagreeError as error:
        refused = str(error)
    return {
        "refused": refused,
        "private_steps": int(keras.ops.convert_to_numpy(model.private_steps.value)),
        "unchanged": flat_weights(model) == before,
    }


def resume():
    directory = os.path.join(OUT_DIR, "shared")
    backup_dir, ledger_path = f"{directory}/backup", f"{directory}/ledger.json"
    writes = count_writes()
    settings = NOISE_SETTINGS  # The noise scenario's round (cached on JAX).

    def callbacks(*extra):
        return [
            *extra,
            AtomicBackupAndRestore(backup_dir, delete_checkpoint=False),
            PrivacyLedger(ledger_path, durable=False, verbose=0),
        ]

    clients = make_clients(None)
    model = make_model(clients, None, **settings)
    with contextlib.suppress(KeyboardInterrupt):
        model.fit(clients, epochs=3, verbose=0, callbacks=callbacks(StopAtEpoch(1)))
    steps_at_stop = int(keras.ops.convert_to_numpy(model.private_steps.value))
    ledger_at_stop = ledger.read_ledger(ledger_path)["steps"]
    saved = flat_weights(model)
    clients = make_clients(None)
    model = make_model(clients, None, **settings)
    epochs = []
    tracker = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: epochs.append(epoch)
    )
    history = model.fit(clients, epochs=3, verbose=0, callbacks=callbacks(tracker))
    return {
        "steps_at_stop": steps_at_stop,
        "ledger_at_stop": ledger_at_stop,
        "saved": digest(saved),
        "epochs_after_resume": epochs,
        "private_steps": int(keras.ops.convert_to_numpy(model.private_steps.value)),
        "history_steps": history.history["private_steps"],
        "ledger_after": ledger.read_ledger(ledger_path)["steps"],
        "after": digest(flat_weights(model)),
        "files_written": writes["files"],
    }


def refusals():
    """Set-ups refused on several hosts, before any round."""
    clients = make_clients(None)
    model = make_model(clients, None, clip_norm=1.0, noise_multiplier=1.0)
    held_out = synthetic_identities(  # Held-out identities, in memory.
        4, 2, image_size=IMAGE_SIZE, channels=1, seed=DATA_SEED, first_identity=100
    )
    attempts = {
        "recall_at_far": lambda: model.fit(
            clients, epochs=1, verbose=0, callbacks=[RecallAtFAR(held_out, far=0.1)]
        ),
        "other_round_source": lambda: model.fit(
            ((round_,) for round_ in clients), epochs=1, verbose=0, steps_per_epoch=2
        ),
    }

    def several_steps_per_call():
        model.compile(optimizer=keras.optimizers.SGD(1.0), steps_per_execution=2)
        model.fit(clients, epochs=1, verbose=0)

    def restore_fails_on_host_1():
        model.compile(optimizer=keras.optimizers.SGD(1.0))
        backup = AtomicBackupAndRestore(os.path.join(OUT_DIR, "no_backup"))
        if HOST == 1:

            def unreadable():
                raise OSError("unreadable backup on host 1")

            backup._load_model = unreadable
        model.fit(clients, epochs=1, verbose=0, callbacks=[backup])

    attempts["steps_per_execution"] = several_steps_per_call
    attempts["restore"] = restore_fails_on_host_1
    report = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            report[name] = None
        except (ValueError, OSError, HostsDisagreeError) as error:
            report[name] = f"{type(error).__name__}: {error}"
    report["private_steps"] = int(keras.ops.convert_to_numpy(model.private_steps.value))
    return report


def main():
    with STRATEGY.scope() if STRATEGY is not None else contextlib.nullcontext():
        hosts = distribute.current_hosts()
    report = {"host": HOST, "hosts": [hosts.index, hosts.count]}
    scenarios = {"equivalence": equivalence}
    if HOSTS > 1:  # The one process is the reference of `equivalence` only.
        scenarios.update(noise=noise, drift=drift, resume=resume, refusals=refusals)
    for name, scenario in scenarios.items():
        try:
            report[name] = scenario()
        except Exception:
            report[name] = {"error": traceback.format_exc()}
    with open(os.path.join(OUT_DIR, f"host{HOST}.json"), "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()

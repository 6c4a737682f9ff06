"""DP-FedEmb on one process or on several hosts: the same script on each.

Run it as one process, or start it once on every host of a job; nothing
in the training code changes:

    # One process (CPU, one GPU, or every local GPU of one machine).
    python examples/multi_host_fedemb.py --data /tmp/ids --write-data \\
        --work-dir /tmp/run

    # JAX, N hosts: on host i (0 is the chief, and hosts the coordinator).
    KERAS_BACKEND=jax python examples/multi_host_fedemb.py \\
        --data /shared/ids --write-data --work-dir /shared/run \\
        --coordinator host0:1234 --num-processes N --process-id i

    # TensorFlow, N hosts: on host i, one worker process per accelerator.
    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                "task": {"type": "worker", "index": i}}' \\
    KERAS_BACKEND=tensorflow python examples/multi_host_fedemb.py \\
        --data /shared/ids --write-data --work-dir /shared/run

What it does:

1. Joins the job: JAX `keras.distribution.initialize` and
   `DataParallel(auto_shard_dataset=False)` over every device of every
   host (also on one process with several local devices); TensorFlow a
   `MultiWorkerMirroredStrategy` when `TF_CONFIG` is set, a
   `MirroredStrategy` on one machine with several GPUs.
2. `--write-data`: the chief writes synthetic identities (one per user)
   to `--data` with `kdpemb.datasets.write_user_shards`, unless the
   directory is already there, while the other hosts wait for it. The
   data is written once, as a real dataset is, and every host opens the
   same directory (`UserShards`, memory-mapped): it must be on storage
   every host sees. Each host reads only the images of its rows of each
   round.
3. Trains `FedEmbModel` on `VirtualClients(UserShards(data))`, with
   `max_clients_per_round` rounded up to a multiple of the devices of the
   job, `AtomicBackupAndRestore` and `PrivacyLedger` in `--work-dir`
   (shared: the chief writes, every host restores). Run it again with the
   same `--work-dir` and it resumes where it stopped (or, finished, does
   nothing); give a new training run a new `--work-dir`.
4. Saves the backbone (`--work-dir/backbone.keras`, written by the chief)
   and, on the chief only, prints the privacy statement and Recall@FAR
   of the saved backbone on held-out identities (evaluated on one
   process, outside the job's distribution).

    python examples/multi_host_fedemb.py --quick --data /tmp/q --write-data \\
        --work-dir /tmp/qrun     # tiny: ~10 s on TF, ~20 s on JAX (2 CPU cores)
"""

import argparse
import contextlib
import json
import os
import pathlib

import kdpemb  # noqa: F401  (before Keras: a quiet console)

SIZES = {
    "full": dict(
        users=2000, images_per_user=8, image_size=32, width=16, groups=4,
        embedding_dim=64, users_per_client=4, clients_per_round=16,
        local_steps=4, batch_size=16, rounds_per_epoch=25, epochs=4,
        held_out=200,
    ),
    "quick": dict(
        users=48, images_per_user=4, image_size=16, width=4, groups=2,
        embedding_dim=8, users_per_client=4, clients_per_round=2,
        local_steps=2, batch_size=4, rounds_per_epoch=2, epochs=1,
        held_out=20,
    ),
}  # fmt: skip
HELD_OUT_FIRST_IDENTITY = 1_000_000  # Past every training identity.


QUICK_NOTE = (
    "quick mode: a tiny model, 48 users and 2 rounds, so Recall near 0 is "
    "expected; run without --quick for meaningful figures"
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the UserShards directory")
    parser.add_argument(
        "--write-data",
        action="store_true",
        help="write synthetic identities to --data first (the chief, once)",
    )
    parser.add_argument("--work-dir", required=True, help="backup, ledger, model")
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--clip-norm", type=float, default=0.05)
    parser.add_argument("--no-evaluate", action="store_true")
    jax_job = parser.add_argument_group("JAX job (TensorFlow: set TF_CONFIG)")
    jax_job.add_argument("--coordinator", help="host:port of process 0")
    jax_job.add_argument("--num-processes", type=int, default=1)
    jax_job.add_argument("--process-id", type=int, default=0)
    return parser.parse_args(argv)


def join_job(args):
    """Starts this process's part of the job; returns the TensorFlow
    strategy (None elsewhere). Call it before building any model."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if os.environ.get("TF_CONFIG"):
            return tf.distribute.MultiWorkerMirroredStrategy()
        if len(tf.config.list_logical_devices("GPU")) > 1:
            return tf.distribute.MirroredStrategy()
        return None
    if backend == "jax":
        import jax

        if args.num_processes > 1:
            if not args.coordinator:
                raise SystemExit("--num-processes > 1 needs --coordinator host:port")
            keras.distribution.initialize(
                args.coordinator, args.num_processes, args.process_id
            )
        if jax.device_count() > 1:
            # Every device of every host; each host feeds its own rows.
            keras.distribution.set_distribution(
                keras.distribution.DataParallel(auto_shard_dataset=False)
            )
    return None


def job_devices(strategy):
    """Devices (replicas) of the whole job, over which a round's rows split."""
    import keras

    if strategy is not None:
        return strategy.num_replicas_in_sync
    if keras.backend.backend() == "jax":
        import jax

        return jax.device_count()
    return 1


def write_data(path, sizes):
    """Synthetic identities, one per user, as user shards at `path`."""
    import numpy as np

    from kdpemb.datasets import synthetic_identities, write_user_shards

    data = synthetic_identities(
        sizes["users"], sizes["images_per_user"], image_size=sizes["image_size"]
    )
    write_user_shards(path, np.asarray(data.images), data.labels, data.user_ids)


def make_clients(shards, sizes, devices):
    """VirtualClients over `shards`, with M_max a multiple of `devices`."""
    from kdpemb.data import VirtualClients

    settings = dict(
        clients_per_round=sizes["clients_per_round"],
        users_per_client=sizes["users_per_client"],
        # P from the public count of enrolled users, not from the data.
        num_clients=sizes["users"] // sizes["users_per_client"],
        local_steps=sizes["local_steps"],
        batch_size=sizes["batch_size"],
        rounds_per_epoch=sizes["rounds_per_epoch"],
    )
    clients = VirtualClients(shards, **settings)
    bound = clients.max_clients_per_round
    if bound % devices:
        bound = -(-bound // devices) * devices  # A larger bound: still safe.
        clients = VirtualClients(shards, max_clients_per_round=bound, **settings)
    return clients


def evaluate(backbone_path, sizes):
    """Recall@FAR of the saved backbone on held-out identities, on this
    process alone (after the job's distribution is turned off)."""
    import keras
    import numpy as np

    from kdpemb.datasets import synthetic_identities
    from kdpemb.metrics import recall_at_far

    if keras.backend.backend() == "jax":
        keras.distribution.set_distribution(None)
    held_out = synthetic_identities(
        sizes["held_out"], 4, image_size=sizes["image_size"],
        first_identity=HELD_OUT_FIRST_IDENTITY,
    )  # fmt: skip
    backbone = keras.saving.load_model(backbone_path)
    embeddings = backbone.predict(np.asarray(held_out.images), verbose=0)
    return [float(r) for r in recall_at_far(embeddings, held_out.labels, (1e-3, 1e-2))]


def main(argv=None):
    args = parse_args(argv)
    sizes = dict(SIZES["quick" if args.quick else "full"])
    if args.epochs is not None:
        sizes["epochs"] = args.epochs
    strategy = join_job(args)

    import keras

    from kdpemb import distribute, saving
    from kdpemb.callbacks import AtomicBackupAndRestore, PrivacyLedger, RichProgress
    from kdpemb.datasets import UserShards
    from kdpemb.models import FedEmbModel, small_cnn

    def scope():
        return strategy.scope() if strategy is not None else contextlib.nullcontext()

    with scope():
        hosts = distribute.current_hosts()
    say = print if hosts.is_chief else (lambda *a, **k: None)
    data, work = pathlib.Path(args.data), pathlib.Path(args.work_dir)
    if args.write_data and hosts.is_chief and not data.exists():
        say(f"writing {sizes['users']} synthetic users to {data}")
        write_data(data, sizes)
    hosts.broadcast_int(0)  # Every host waits here until the chief is done.
    if not data.exists():
        raise SystemExit(
            f"{data} does not exist on host {hosts.index}: every host opens "
            "the same user shards, on storage they all see (--write-data "
            "writes them once, on the chief)."
        )
    clients = make_clients(UserShards(data), sizes, job_devices(strategy))
    say(clients.describe())
    say(f"{hosts.count} host(s), {job_devices(strategy)} device(s): each host "
        f"builds {clients.max_clients_per_round // hosts.count} of "
        f"{clients.max_clients_per_round} client rows a round")  # fmt: skip

    shape = (sizes["image_size"], sizes["image_size"], 3)
    keras.utils.set_random_seed(0)  # The same initial weights on every host.
    with scope():
        model = FedEmbModel(
            small_cnn(shape, sizes["embedding_dim"], sizes["width"], sizes["groups"]),
            clip_norm=args.clip_norm,
            noise_multiplier=args.noise_multiplier,
            delta=0.1 / sizes["users"],
            client_optimizer=0.01,
        )
        model.compile(optimizer=keras.optimizers.Adam(3e-3))
    work.mkdir(parents=True, exist_ok=True)
    callbacks = [
        AtomicBackupAndRestore(work / "backup", delete_checkpoint=False),
        PrivacyLedger(work / "ledger.json", verbose=int(hosts.is_chief)),
    ]
    if hosts.is_chief:  # Progress (and the round's compilation) on the chief.
        callbacks.append(RichProgress())
    one_machine = strategy is not None and hosts.count == 1
    x = clients.to_tf_dataset() if one_machine else clients
    model.fit(x, epochs=sizes["epochs"], verbose=0, callbacks=callbacks)
    saving.save_model(model.backbone, work / "backbone.keras")  # On every host.

    statement = model.privacy_statement()
    say(f"private steps: {int(keras.ops.convert_to_numpy(model.private_steps))}")
    say(statement.summary())
    result = {"hosts": hosts.count, "statement": statement.to_dict()}
    if hosts.is_chief and not args.no_evaluate:
        recall = evaluate(work / "backbone.keras", sizes)
        result["recall@far=1e-3,1e-2"] = recall
        say(f"held-out Recall@FAR=1e-3: {recall[0]:.3f}, 1e-2: {recall[1]:.3f}")
        if args.quick:
            say(QUICK_NOTE)
    if hosts.is_chief:
        (work / "results.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""The main job: public pretraining, then user-level DP-FedEmb, end to end.

1. Render the embedded synthetic identities: a *public* set (other
   identities, shifted nuisance) and the *private* users (one identity
   each), plus held-out private-domain identities that nobody trains on.
2. Pretrain a `resnet_gn` backbone non-privately on the public set
   (`kdpemb.models.pretrain`).
3. Fine-tune it with DP-FedEmb on the private users: virtual clients of
   16 users, Poisson-sampled, local cosine heads imprinted from each
   client's own examples and thrown away after each round, clipped
   updates (C: the median update norm on *public* clients), Gaussian
   noise once per round, server Adam. The settings are the CPU utility
   study's choice (`benchmarks.fedemb_utility`, docs/fedemb.md), made on
   validation identities, never on the held-out ones reported here.
4. State the privacy. 1,000 users are far too few for a useful user-level
   ε, so, as in the DP-FedEmb paper, the run's noise multiplier z is
   calibrated (`privacy.calibrate_run_noise`) so that a *simulated
   deployment* with s·z noise and s× the clients per round over 10M users
   (the same noise in the mean update) spends at most the target ε. That
   is the deployment's guarantee, not this run's: the run itself has none
   worth stating, and every output says so. `--own-epsilon EPS` instead
   calibrates for the run itself (`FedEmbModel(target_epsilon=EPS)`) and
   writes its own privacy statement.
5. Report Recall@FAR on the held-out identities: untrained,
   public-pretrained and DP-FedEmb. `--reference` (which `make demo`
   passes) also trains a non-private reference: centralized fine-tuning
   on the private users without noise, from an imprinted head, to its
   plateau (the upper bound). Its figures are computed from the private users and are
   NOT covered by the privacy guarantee: they go to the
   "outside_the_guarantee" section of `results.json` only (not to the
   released table, nor to `roc.png`), labelled so on the console too; do
   not publish them.

Everything goes to `runs/<date-time>/`: `results.json`, `roc.png`,
`simulated_deployment.txt|json` (or, with `--own-epsilon`,
`privacy_statement.txt|json`) and `backbone.keras`. The console shows
kdpemb's own lines only (`KDPEMB_BACKEND_LOGS=1` shows the backends' too).

    python examples/train_dp_fedemb.py            # ~3 min on 2 CPU cores
    python examples/train_dp_fedemb.py --quick    # tiny: ~20 s on TF, ~40 s on JAX
    python examples/train_dp_fedemb.py --own-epsilon 8  # ε of the run itself
    python examples/train_dp_fedemb.py --reference  # + the reference (make demo)
"""

import argparse
import datetime
import json
import pathlib
import time

import kdpemb  # noqa: F401  (before Keras: a quiet console)

SIZES = {
    "full": dict(
        image_size=16, width=16, groups=8, embedding_dim=32,
        public_identities=1000, public_images=8, pretrain_epochs=6,
        private_identities=1000, private_images=8,
        held_out=200, held_out_images=8,
        users_per_client=16, clients_per_round=16, local_steps=4,
        batch_size=16, rounds=150, reference_epochs=32, reference_batch=64,
    ),
    "quick": dict(
        image_size=16, width=4, groups=2, embedding_dim=16,
        public_identities=32, public_images=4, pretrain_epochs=1,
        private_identities=40, private_images=4,
        held_out=20, held_out_images=4,
        users_per_client=4, clients_per_round=2, local_steps=2,
        batch_size=4, rounds=4, reference_epochs=1, reference_batch=32,
    ),
}  # fmt: skip
# Quick: 32 x 4 public images are two full pretraining batches (of 64) and
# 40 x 4 private images five reference batches (of 32), so JAX compiles
# one step of each, not a second one for a partial batch.

# The training settings of the CPU utility study's choice (docs/fedemb.md,
# "Utility study"): chosen on validation identities, never on the
# held-out ones this job reports.
PRETRAIN_LR = 2e-3  # Adam, cosine decay over the pretraining steps.
CLIENT = dict(learning_rate=0.01, momentum=0.9)  # Local SGD.
SERVER_LR = 3e-3  # Server Adam, one step a round.
REFERENCE_LR = 3e-3  # Adam, cosine decay, imprinted head.
FARS = (1e-3, 1e-2)
REFERENCE = "non-private reference"
QUICK_NOTE = (
    "quick mode: a tiny model and data, so Recall near 0 is expected; run "
    "without --quick for meaningful figures"
)
OUTSIDE = (
    "OUTSIDE THE PRIVACY GUARANTEE: computed from the private users without "
    "noise, NOT covered by the privacy guarantee; do not publish"
)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument(
        "--target-epsilon",
        type=float,
        default=8.0,
        help="ε of the simulated deployment (δ = 0.1 / deployment users)",
    )
    parser.add_argument(
        "--own-epsilon",
        type=float,
        default=None,
        help="instead, calibrate for this run's own ε over its own users",
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--clip-norm",
        type=float,
        default=None,
        help="C (default: the median client update norm on the public set)",
    )
    parser.add_argument(
        "--deployment-scale", type=float, default=64.0, help="s of the simulation"
    )
    parser.add_argument("--deployment-users", type=int, default=10_000_000)
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also train a non-private reference (centralized fine-tuning on "
        "the private users without noise, the upper bound; `make demo` asks "
        "for it; about 2.5 minutes). "
        "Its figures are NOT covered by the privacy guarantee: they go to the "
        "'outside_the_guarantee' section of results.json only; do not publish "
        "them",
    )
    parser.add_argument(  # The default since --reference: kept for old scripts.
        "--no-reference", action="store_false", dest="reference",
        help=argparse.SUPPRESS,
    )  # fmt: skip
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--seed", type=int, default=0, help="data and model init")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    run_dir = pathlib.Path(args.runs_dir) / stamp
    run_dir.mkdir(parents=True, exist_ok=False)
    return run(args, size, run_dir)


def adam_with_cosine_decay(learning_rate, steps):
    import keras

    return keras.optimizers.Adam(
        keras.optimizers.schedules.CosineDecay(learning_rate, steps)
    )


def say(text):
    print(text, flush=True)


def run(args, size, run_dir):
    import keras
    import numpy as np

    from kdpemb import plots, privacy
    from kdpemb.callbacks import RichProgress
    from kdpemb.data import VirtualClients
    from kdpemb.datasets import synthetic_identities
    from kdpemb.metrics import recall_at_far, verification_roc
    from kdpemb.models import (
        CentralizedBaseline,
        FedEmbModel,
        pretrain,
        resnet_gn,
        suggest_clip_norm,
    )

    started = time.perf_counter()
    side = size["image_size"]
    say(f"kdpemb main job → {run_dir}/  (Keras backend: {keras.backend.backend()})")

    def render(count, images, **kwargs):
        data = synthetic_identities(
            count, images, image_size=side, seed=args.seed, **kwargs
        )
        return np.asarray(data.images), data.labels, data.user_ids

    public = render(size["public_identities"], size["public_images"], domain="public")
    private = render(size["private_identities"], size["private_images"])
    held_out = render(
        size["held_out"], size["held_out_images"], first_identity=1_000_000
    )[:2]
    say(
        f"data: {size['public_identities']} public identities (shifted nuisance), "
        f"{size['private_identities']} private users, {size['held_out']} "
        "held-out identities (never trained on)"
    )

    # The privacy plan first: a bad setting fails here, before any training.
    rounds = size["rounds"] if args.rounds is None else args.rounds
    num_users = size["private_identities"]
    users_per_client = size["users_per_client"]
    delta = 0.1 / num_users
    deployment_delta = 0.1 / args.deployment_users
    client_settings = dict(
        clients_per_round=size["clients_per_round"],
        users_per_client=users_per_client,
        local_steps=size["local_steps"],
        batch_size=size["batch_size"],
    )
    clients = VirtualClients(
        *private,
        # P from a public count (the enrolled users), not from the data.
        num_clients=-(-num_users // users_per_client),
        rounds_per_epoch=rounds,
        **client_settings,
    )
    deployment = dict(
        scale=args.deployment_scale,
        deployment_users=args.deployment_users,
        deployment_clients=-(-args.deployment_users // users_per_client),
    )
    if args.own_epsilon is not None:
        noise = dict(target_epsilon=args.own_epsilon)
        plan = (
            f"this run's own ε = {args.own_epsilon:g} at δ = {delta:.1e} per "
            "user (calibrated at the first fit)"
        )
    else:
        z = privacy.calibrate_run_noise(
            clients.schedule,
            rounds,
            deployment_delta,
            target_epsilon=args.target_epsilon,
            **deployment,
        )
        noise = dict(noise_multiplier=z)
        plan = (
            f"noise multiplier {z:.4g}: the mean-update noise of a simulated "
            f"deployment with {args.deployment_scale:g}× the noise and the "
            f"clients per round over {args.deployment_users:,} users, calibrated "
            f"there for ε = {args.target_epsilon:g} at δ = {deployment_delta:.0e}"
        )

    # The released figures. A non-private reference (--reference) is kept
    # apart: it is not covered by the privacy guarantee.
    curves, table = {}, {}

    def recall(backbone):
        embeddings = backbone.predict(held_out[0], batch_size=256, verbose=0)
        recalls = recall_at_far(embeddings, held_out[1], far=FARS)
        values = {
            f"recall@far={f:g}": float(r) for f, r in zip(FARS, recalls, strict=True)
        }
        return embeddings, recalls, values

    def evaluate(name, backbone):
        embeddings, recalls, table[name] = recall(backbone)
        curves[name] = verification_roc(embeddings, held_out[1], max_far=1.0)[:2]
        say(
            f"  {name:<24} Recall@FAR=1e-3 {recalls[0]:.3f}   "
            f"Recall@FAR=1e-2 {recalls[1]:.3f}"
        )

    def new_backbone():
        return resnet_gn(
            (side, side, 3),
            embedding_dim=size["embedding_dim"],
            width=size["width"],
            groups=size["groups"],
        )

    keras.utils.set_random_seed(args.seed)
    backbone = new_backbone()
    evaluate("untrained", backbone)

    say(f"1/2 public pretraining: {size['pretrain_epochs']} epoch(s)")
    pretrain_steps = size["pretrain_epochs"] * -(-len(public[1]) // 64)
    pretrain(
        backbone,
        public[:2],
        epochs=size["pretrain_epochs"],
        head_scale=30.0,
        optimizer=adam_with_cosine_decay(PRETRAIN_LR, pretrain_steps),
        batch_size=64,
        verbose=0 if args.quick else 2,
    )
    evaluate("public-pretrained", backbone)
    pretrained_weights = backbone.get_weights()

    # Local cosine heads imprinted from each client's own examples; the
    # heads never leave the clients.
    fedemb_settings = dict(
        head="cosine",
        head_scale=30.0,
        head_init="class_means",
        client_optimizer=keras.optimizers.SGD(**CLIENT),
    )
    clip_norm, clip_source = args.clip_norm, "--clip-norm"
    if clip_norm is None:  # Public data: no privacy cost.
        public_clients = VirtualClients(*public, **client_settings)
        probe = FedEmbModel(backbone, noise_multiplier=0.0, **fedemb_settings)
        clip_norm = suggest_clip_norm(probe, public_clients, rounds=4)
        clip_source = "median update norm on public clients"
        say(f"  clip norm {clip_norm:.3g}: the {clip_source}")

    say(f"2/2 DP-FedEmb: {rounds} rounds at {plan}")
    model = FedEmbModel(
        backbone, clip_norm=clip_norm, delta=delta, **noise, **fedemb_settings
    )
    model.compile(optimizer=keras.optimizers.Adam(SERVER_LR))  # The server's.
    model.fit(
        clients,
        epochs=1,
        verbose=0,
        callbacks=[RichProgress(print_every=max(1, rounds // 10))],
    )
    evaluate("DP-FedEmb", model.backbone)

    outside = None
    if args.reference:
        say(
            "reference (--reference): non-private centralized fine-tuning of the "
            "pretrained backbone on the private users (outside the privacy "
            "guarantee; its figures come after the table)"
        )
        reference = new_backbone()
        reference.set_weights(pretrained_weights)
        centralized = CentralizedBaseline(
            reference, num_users, head="cosine", head_scale=30.0
        )
        centralized.imprint_head(*private[:2])
        epochs, batch = size["reference_epochs"], size["reference_batch"]
        reference_steps = epochs * -(-len(private[1]) // batch)
        centralized.compile(
            optimizer=adam_with_cosine_decay(REFERENCE_LR, reference_steps),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        # Progress without the loss: a figure of the private users
        # without noise belongs only after the table, labelled.
        every = max(1, epochs // 4)
        progress = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: (
                (epoch + 1) % every == 0
                and say(f"  reference: epoch {epoch + 1}/{epochs}")
            )
        )
        centralized.fit(
            private[0],
            private[1],
            epochs=epochs,
            batch_size=batch,
            verbose=0,
            callbacks=[] if args.quick else [progress],
        )
        reference_recall = recall(reference)[2]
        outside = {
            "covered_by_the_privacy_guarantee": False,
            "note": (
                "Computed from the private users WITHOUT noise: these numbers "
                "are NOT covered by the privacy guarantee (neither this run's "
                "nor the simulated deployment's). Do not publish them."
            ),
            REFERENCE: {
                "method": (
                    "centralized fine-tuning of the public-pretrained backbone "
                    f"on the {num_users:,} private users (a {num_users:,}-way "
                    "cosine head imprinted from their mean embeddings, Adam "
                    f"{REFERENCE_LR:g} with cosine decay), no clipping or noise"
                ),
                "epochs": size["reference_epochs"],
                "recall_on_held_out_identities": reference_recall,
            },
        }

    say("")
    say(f"{'':<24} Recall@FAR=1e-3   Recall@FAR=1e-2")
    for name, values in table.items():
        say(
            f"{name:<24} {values['recall@far=0.001']:>15.3f}   "
            f"{values['recall@far=0.01']:>15.3f}"
        )
    if args.quick:
        say(QUICK_NOTE)
    if outside is not None:
        reference_values = outside[REFERENCE]["recall_on_held_out_identities"]
        say("")
        say(f"{OUTSIDE}:")
        say(
            f"{REFERENCE:<24} {reference_values['recall@far=0.001']:>15.3f}   "
            f"{reference_values['recall@far=0.01']:>15.3f}   (outside the guarantee)"
        )
    say("")
    if args.own_epsilon is not None:
        statement, simulated = model.privacy_statement(), None
        guarantee = statement.summary()
        say("This run's own guarantee:")
        say(guarantee)
    else:
        statement = None
        simulated = model.simulated_deployment(
            args.deployment_scale,
            args.deployment_users,
            delta=deployment_delta,
            deployment_clients=deployment["deployment_clients"],
        )
        guarantee = (
            f"None meaningful for its {num_users:,} users: its noise (z = "
            f"{model.noise_multiplier:.4g}) simulates the mean-update noise of "
            "a far larger deployment. Use --own-epsilon to calibrate for the "
            "run itself."
        )
        say(simulated.summary(run_guarantee=False))  # The run's: said once.
        say("")
        say(f"This run's own guarantee: {guarantee}")

    plots.roc(curves, run_dir / "roc.png", far_range=(1e-4, 1.0), mark_far=FARS)
    model.backbone.save(run_dir / "backbone.keras")
    if statement is not None:
        (run_dir / "privacy_statement.txt").write_text(statement.summary() + "\n")
        (run_dir / "privacy_statement.json").write_text(statement.to_json() + "\n")
    if simulated is not None:
        (run_dir / "simulated_deployment.txt").write_text(simulated.summary() + "\n")
        (run_dir / "simulated_deployment.json").write_text(simulated.to_json() + "\n")
    results = {
        "arguments": vars(args),
        "sizes": size,
        "backend": keras.backend.backend(),
        "recall_on_held_out_identities": table,
        "clip_norm": float(clip_norm),
        "clip_norm_source": clip_source,
        "noise_multiplier": float(model.noise_multiplier),
        "noise_calibrated_for": (
            "this run's own epsilon" if statement else "the simulated deployment"
        ),
        "delta": delta,
        "private_steps": int(model.private_steps.numpy()),
        "run_guarantee": guarantee,
        "privacy_statement": statement and json.loads(statement.to_json()),
        "simulated_deployment": simulated and json.loads(simulated.to_json()),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if outside is not None:
        results["outside_the_guarantee"] = outside
    results["files"] = sorted(
        [path.name for path in run_dir.iterdir()] + ["results.json"]
    )
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    say("")
    say(f"done in {results['seconds']:.0f} s; files in {run_dir}/")
    return results


if __name__ == "__main__":
    main()

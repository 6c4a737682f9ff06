"""Trains an embedding with user-level DP-FedEmb on synthetic identities.

4,000 synthetic identities (one user each, 4 images of 32×32×3) are
grouped into 1,000 virtual clients of 4 users; each round samples 16 of
them (Poisson), trains each for 8 local steps with a throw-away local
head, clips every update, adds Gaussian noise once and applies the noisy
mean with Adam. The noise multiplier is calibrated so that the planned
rounds spend the target ε, and `PrivacyBudget` stops training before ε
would pass it. Recall@FAR is measured on 200 held-out identities that no
user holds. The backbone is saved as a `.keras` file.

    python examples/train_dp_fedemb.py                 # ~4 min on 2 CPU cores
    python examples/train_dp_fedemb.py --quick         # seconds, tiny sizes
    python examples/train_dp_fedemb.py --epochs 8 --target-epsilon 20

The population is tiny for user-level DP (a real deployment has 10^5 to
10^7 users), so the ε that gives useful training here is large; see
docs/fedemb.md for the measured trade-off.
"""

import argparse
import pathlib

import keras
import numpy as np

from kdpemb import privacy
from kdpemb.callbacks import PrivacyBudget, RecallAtFAR, RichProgress
from kdpemb.data import VirtualClients
from kdpemb.datasets import synthetic_identities
from kdpemb.metrics import recall_at_far
from kdpemb.models import FedEmbModel, small_cnn

SIZES = {
    # identities, images each, held-out identities, image size, width,
    # clients per round, local steps, batch size, rounds per epoch
    "full": dict(
        identities=4000, images=4, held_out=200, image_size=32, width=8,
        clients_per_round=16, local_steps=8, batch_size=8, rounds_per_epoch=50,
    ),
    "quick": dict(
        identities=40, images=4, held_out=20, image_size=16, width=4,
        clients_per_round=2, local_steps=2, batch_size=4, rounds_per_epoch=2,
    ),
}  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--rounds-per-epoch", type=int, default=None, help="rounds (train steps)"
    )
    parser.add_argument(
        "--target-epsilon", type=float, default=None, help="default 10 (5 quick)"
    )
    parser.add_argument("--output", default="dp_fedemb_backbone.keras")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    rounds_per_epoch = args.rounds_per_epoch or size["rounds_per_epoch"]
    target_epsilon = args.target_epsilon or (5.0 if args.quick else 10.0)

    # Training users and held-out identities (disjoint: first_identity).
    train = synthetic_identities(
        size["identities"], size["images"], image_size=size["image_size"]
    )
    held_out = synthetic_identities(
        size["held_out"],
        8,
        image_size=size["image_size"],
        first_identity=size["identities"],
    )
    held_out = (np.asarray(held_out.images), held_out.labels)
    clients = VirtualClients(
        np.asarray(train.images),  # Rendered once, gathered every round.
        train.labels,
        train.user_ids,
        clients_per_round=size["clients_per_round"],
        users_per_client=4,
        # P from a public count (here the enrolled users), not from the data.
        num_clients=size["identities"] // 4,
        local_steps=size["local_steps"],
        batch_size=size["batch_size"],
        rounds_per_epoch=rounds_per_epoch,
    )
    print(clients.describe().split("\n  ")[0])

    # The smallest noise that keeps the planned rounds within the target.
    delta = 0.1 / clients.num_users
    steps = args.epochs * rounds_per_epoch
    noise_multiplier = privacy.calibrate_noise_multiplier(
        clients.schedule.privacy_mechanism(1.0),
        target_epsilon=target_epsilon,
        delta=delta,
        steps=steps,
    )
    print(f"noise multiplier {noise_multiplier:.3f} for ε = {target_epsilon:g}")

    backbone = small_cnn(
        (size["image_size"], size["image_size"], 3),
        embedding_dim=32,
        width=size["width"],
        groups=4,
    )
    untrained = recall_at_far(
        backbone.predict(held_out[0], verbose=0), held_out[1], far=1e-3
    )
    # The schedule (users, P, M, local steps) comes from `clients` at fit.
    model = FedEmbModel(
        backbone,
        client_optimizer=0.01,
        clip_norm=0.05,
        noise_multiplier=noise_multiplier,
        delta=delta,
    )
    model.compile(optimizer=keras.optimizers.Adam(3e-3))  # The server optimizer.
    budget = PrivacyBudget(target_epsilon=target_epsilon, verbose=0)  # model δ
    recall = RecallAtFAR(held_out, far=(1e-3, 1e-2))
    model.fit(
        clients,
        epochs=args.epochs,
        verbose=0,
        callbacks=[budget, recall, RichProgress()],
    )

    values = recall.evaluate()
    print(budget.statement.summary())
    print(
        f"Recall@FAR=1e-3 on {size['held_out']} held-out identities: "
        f"{values['recall@far=1e-03']:.4f} (untrained backbone: {untrained:.4f}); "
        f"Recall@FAR=1e-2: {values['recall@far=1e-02']:.4f}"
    )
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    model.backbone.save(output)
    print(f"saved the backbone to {output}")


if __name__ == "__main__":
    main()

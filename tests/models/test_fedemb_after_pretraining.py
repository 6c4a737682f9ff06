"""DP-FedEmb fine-tuning of a public-pretrained backbone helps held-out users.

The backbone is pretrained non-privately on public identities (other
identities, other conditions), then fine-tuned with DP-FedEmb (partial
aggregation, cosine head, real clipping and a small noise multiplier) on
private users. Held-out identities of the private domain, never trained
on, must then be verified better than by the pretrained backbone alone.

Sizes: the round's cost depends on M·k users (24 here), not on the number
of private users, so the pool is large (200 users, 50 virtual clients)
while rounds stay cheap. Virtual clients of k = 4 users (4 identities)
give a more informative local task than k = 2.
"""

import warnings

import keras
import numpy as np
import pytest

from kdpemb.data import VirtualClients
from kdpemb.datasets import synthetic_identities
from kdpemb.metrics import recall_at_far
from kdpemb.models import FedEmbModel, pretrain, resnet_gn

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]

SEED = 0
PRIVATE_USERS, USERS_PER_CLIENT = 200, 4
FAR = 0.1


def held_out_scores(backbone, held):
    """Recall@FAR=0.1 and the ROC AUC over all held-out pairs.

    The AUC ranks every genuine pair against every impostor pair, so it
    moves less with the few pairs near one threshold than Recall@FAR does.
    """
    embeddings = backbone.predict(np.asarray(held.images), verbose=0)
    recall = float(recall_at_far(embeddings, held.labels, far=FAR))
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    rows, cols = np.triu_indices(len(unit), 1)
    scores = np.sum(unit[rows] * unit[cols], axis=1)
    genuine = held.labels[rows] == held.labels[cols]
    ranks = np.argsort(np.argsort(scores)) + 1.0  # Scores are distinct floats.
    positives, negatives = genuine.sum(), (~genuine).sum()
    auc = (ranks[genuine].sum() - positives * (positives + 1) / 2) / (
        positives * negatives
    )
    return recall, float(auc)


def dp_fedemb(backbone, private, rounds, noise_multiplier):
    with warnings.catch_warnings():
        # Fixed seeds make the sampling and noise predictable: tests only.
        warnings.simplefilter("ignore", UserWarning)
        clients = VirtualClients(
            private,
            clients_per_round=6,
            users_per_client=USERS_PER_CLIENT,
            num_clients=PRIVATE_USERS // USERS_PER_CLIENT,
            local_steps=4,
            batch_size=8,
            rounds_per_epoch=rounds,
            seed=SEED,
        )
        model = FedEmbModel(
            backbone,
            aggregation="partial",
            head="cosine",
            client_optimizer=0.01,
            head_lr_scale=100.0,
            clip_norm=0.7,  # About the median update norm here: it clips.
            noise_multiplier=noise_multiplier,
            seed=SEED,
        )
    model.compile(optimizer=keras.optimizers.Adam(3e-3))
    model.fit(clients, epochs=1, verbose=0)
    return model


def test_dp_fedemb_after_public_pretraining_improves_held_out_recall():
    keras.utils.set_random_seed(SEED)
    public = synthetic_identities(40, 8, image_size=16, seed=SEED, domain="public")
    private = synthetic_identities(PRIVATE_USERS, 4, image_size=16, seed=SEED)
    held = synthetic_identities(
        100, 4, image_size=16, seed=SEED, first_identity=1_000_000
    )
    backbone = resnet_gn((16, 16, 3), embedding_dim=16, width=8, groups=4)
    pretrain(
        backbone,
        public,
        epochs=5,
        batch_size=40,
        optimizer=keras.optimizers.Adam(3e-3),
        verbose=0,
    )
    pretrained_recall, pretrained_auc = held_out_scores(backbone, held)

    model = dp_fedemb(backbone, private, rounds=30, noise_multiplier=0.05)
    assert int(keras.ops.convert_to_numpy(model.private_steps)) == 30
    recall, auc = held_out_scores(model.backbone, held)
    # Measured (seed 0): Recall@0.1 0.258 -> 0.321 and AUC 0.650 -> 0.712
    # on TensorFlow; seeds 1 and 2 gave AUC +0.03 and +0.06.
    assert recall > pretrained_recall + 0.02
    assert auc > pretrained_auc + 0.02

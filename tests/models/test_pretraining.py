"""`pretrain`: public pre-training of a backbone before private fine-tuning."""

import keras
import numpy as np
import pytest

from kdpemb.data import VirtualClients
from kdpemb.datasets import synthetic_identities
from kdpemb.metrics import recall_at_far
from kdpemb.models import pretrain, resnet_gn, small_cnn


def tiny_backbone():
    return resnet_gn((16, 16, 3), embedding_dim=16, width=8, groups=4)


def test_pretraining_on_public_identities_improves_private_recall():
    # Public identities and conditions; held-out *private* identities.
    keras.utils.set_random_seed(0)
    public = synthetic_identities(40, 8, image_size=16, domain="public")
    held = synthetic_identities(20, 4, image_size=16, first_identity=1000)
    images = np.asarray(held.images)
    backbone = tiny_backbone()

    def recall():
        embeddings = backbone.predict(images, verbose=0)
        return float(recall_at_far(embeddings, held.labels, far=0.1))

    before = recall()
    trained, history = pretrain(
        backbone,
        public,
        epochs=5,
        batch_size=40,
        optimizer=keras.optimizers.Adam(3e-3),
        validation=held,
        verbose=0,
    )
    assert trained is backbone
    assert len(history.history["loss"]) == 5
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert len(history.history["recall@far=1e-03"]) == 5
    # Measured with seed 0: 0.17 -> 0.22 on TensorFlow, 0.18 -> 0.25 on JAX.
    assert recall() > before + 0.03


def test_arrays_and_sparse_labels_are_accepted():
    data = synthetic_identities(4, 2, image_size=16, domain="public")
    images = np.asarray(data.images)
    labels = data.labels * 10 + 7  # Any non-negative ids.
    backbone = small_cnn((16, 16, 3), 4, width=4, groups=2)
    _, history = pretrain(
        backbone, (images, labels), epochs=1, head="softmax", verbose=0
    )
    assert np.isfinite(history.history["loss"]).all()


def test_wrong_input_is_refused_before_training():
    backbone = tiny_backbone()
    data = synthetic_identities(4, 2, image_size=16, domain="public")
    images = np.asarray(data.images)
    with pytest.raises(ValueError, match=r"tuple \(images, labels\) or a kdpemb"):
        pretrain(backbone, images, epochs=1)
    clients = VirtualClients(data, clients_per_round=1, users_per_client=2)
    with pytest.raises(ValueError, match="got VirtualClients"):
        pretrain(backbone, clients, epochs=1)
    with pytest.raises(ValueError, match=r"backbone takes \(N, 16, 16, 3\)"):
        pretrain(backbone, (images[:, :8, :8], data.labels), epochs=1)
    with pytest.raises(ValueError, match="labels must have shape"):
        pretrain(backbone, (images, data.labels[:3]), epochs=1)
    with pytest.raises(ValueError, match="at least 2"):
        pretrain(backbone, (images, np.zeros(len(images), int)), epochs=1)
    with pytest.raises(ValueError, match="epochs"):
        pretrain(backbone, data, epochs=0)
    with pytest.raises(ValueError, match=r"validation's images have shape"):
        pretrain(backbone, data, epochs=1, validation=(images[:, :8], data.labels))

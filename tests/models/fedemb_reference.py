"""A slow, obviously correct NumPy DP-FedEmb round, and tiny test rounds.

The backbone of these tests is `Flatten` then `Dense(D, use_bias=False)`
on 4x4x1 images, so a client's gradients can be written by hand:
embeddings e = X W, logits e H (columns >= c masked out), the mean
softmax cross-entropy over the real examples of the batch has
dL/dlogits = mask · (softmax − onehot) / n, hence dL/dH = eᵀ G and
dL/dW = Xᵀ (G Hᵀ). Everything is float64; the implementation under test
runs in float32 through `keras.ops` on either backend, so agreement with
this file on both backends also shows that TensorFlow and JAX agree.
"""

import keras
import numpy as np

IMAGE_SHAPE = (4, 4, 1)
PIXELS = 16
MASKED_LOGIT = -1e9


def linear_backbone(embedding_dim=3, seed=0, scale=0.5, kernel=None):
    """`Flatten -> Dense(embedding_dim, no bias)` with a known kernel."""
    backbone = keras.Sequential(
        [
            keras.Input(IMAGE_SHAPE),
            keras.layers.Flatten(),
            keras.layers.Dense(embedding_dim, use_bias=False),
        ]
    )
    if kernel is None:
        rng = np.random.default_rng(seed)
        kernel = scale * rng.normal(size=(PIXELS, embedding_dim))
    backbone.set_weights([np.asarray(kernel, "float32")])
    return backbone


def kernel_of(backbone):
    return np.asarray(keras.ops.convert_to_numpy(backbone.trainable_variables[0]))


class Rounds(keras.utils.PyDataset):
    """Hand-built round dicts, served in order (one per `train_step`)."""

    def __init__(self, rounds):
        super().__init__()
        self.rounds = list(rounds)

    def __len__(self):
        return len(self.rounds)

    def __getitem__(self, index):
        return self.rounds[index]


def make_round(
    seed,
    *,
    classes=(3, 2),
    rows=3,
    steps=3,
    batch=4,
    num_classes=6,
    image_scale=1.0,
):
    """A round dict as `VirtualClients.round` lays it out, built by hand.

    The first `len(classes)` rows are sampled clients with
    `classes[i]` local identities each; the other rows are unsampled and
    hold random garbage (so a round that reads them is caught). One slot
    of every client is an empty (masked) example with a garbage image.
    Global labels are a random injective map of the local labels into
    `num_classes`, so they differ from the local labels.
    """
    rng = np.random.default_rng(seed)
    shape = (rows, steps, batch)
    images = (image_scale * rng.normal(size=(*shape, *IMAGE_SHAPE))).astype("float32")
    labels = np.zeros(shape, "int32")
    global_labels = np.zeros(shape, "int32")
    example_mask = np.zeros(shape, bool)
    client_mask = np.zeros(rows, bool)
    num_local = np.zeros(rows, "int32")
    for row, c in enumerate(classes):
        client_mask[row] = True
        num_local[row] = c
        example_mask[row] = True
        example_mask[row, -1, -1] = False
        local = rng.integers(0, c, size=(steps, batch))
        # Every local class appears in the client's first batch.
        local[0, :c] = np.arange(c)
        local[~example_mask[row]] = 0
        labels[row] = local
        to_global = rng.choice(num_classes, size=c, replace=False)
        global_labels[row] = np.where(example_mask[row], to_global[local], 0)
    # Unsampled rows: garbage that a correct round never reads.
    labels[~client_mask] = rng.integers(0, 2, size=labels[~client_mask].shape)
    num_local[~client_mask] = 2
    return {
        "images": images,
        "labels": labels,
        "global_labels": global_labels,
        "example_mask": example_mask,
        "client_mask": client_mask,
        "num_local_classes": num_local,
    }


def _sgd(param, velocity, grad, lr, momentum, nesterov):
    """Keras' SGD update rule, written out."""
    if momentum:
        velocity = momentum * velocity - lr * grad
        step = momentum * velocity - lr * grad if nesterov else velocity
    else:
        step = -lr * grad
    return param + step, velocity


def local_gradients(kernel, head, images, labels, mask, num_classes):
    """(dL/dW, dL/dH) of the mean masked cross-entropy of one batch."""
    x = images.reshape(images.shape[0], -1).astype(np.float64)
    embeddings = x @ kernel
    logits = embeddings @ head
    logits[:, num_classes:] = MASKED_LOGIT
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    onehot = np.eye(head.shape[1])[labels]
    weight = mask.astype(np.float64)
    g = (probs - onehot) * weight[:, None] / max(weight.sum(), 1.0)
    return x.T @ (g @ head.T), embeddings.T @ g


def client_update(
    kernel,
    head,
    client,
    *,
    lr,
    head_lr_scale,
    momentum=0.0,
    nesterov=False,
    reconstruction_steps=0,
):
    """One client's local training; returns (θ_local − θ, H_local − H_0).

    `client` holds one row of a round: images [S, B, 4, 4, 1], labels,
    example_mask [S, B] and num_local_classes. The first
    `reconstruction_steps` batches move only the head; local optimizer
    state starts at zero.
    """
    w, h = np.array(kernel, np.float64), np.array(head, np.float64)
    vw, vh = np.zeros_like(w), np.zeros_like(h)
    head_lr = lr * head_lr_scale
    for step in range(client["images"].shape[0]):
        gw, gh = local_gradients(
            w,
            h,
            client["images"][step],
            client["labels"][step],
            client["example_mask"][step],
            int(client["num_local_classes"]),
        )
        h, vh = _sgd(h, vh, gh, head_lr, momentum, nesterov)
        if step >= reconstruction_steps:
            w, vw = _sgd(w, vw, gw, lr, momentum, nesterov)
    return w - kernel, h - head


def client_rows(data, labels="labels"):
    """The round's sampled clients as dicts of one row each."""
    return [
        {
            "images": data["images"][row],
            "labels": data[labels][row],
            "example_mask": data["example_mask"][row],
            "num_local_classes": data["num_local_classes"][row],
        }
        for row in np.flatnonzero(data["client_mask"])
    ]


def clip(update, clip_norm):
    norm = np.sqrt(sum(np.sum(np.square(u)) for u in update))
    return [u * min(1.0, clip_norm / max(norm, 1e-30)) for u in update]

"""One DP-FedEmb / DP-FedAvg round, written once in `keras.ops`.

The clients' local training, clipping and sum. Everything here is
backend-agnostic: the two things that differ between TensorFlow and JAX
(taking a gradient, and summing over replicas) come in through a
`kdpemb.models._shared.backends` module. `FedEmbModel.train_step` calls
`run_round` and applies its result with the server optimizer.

Per virtual client (a row of the round):

1. The head starts from zeros, a fresh random draw, the client's class
   means (`class_mean_heads`: each local class's column imprinted from
   its examples' normalised embeddings; other columns keep the random
   draw), or (DP-FedAvg) the global head; it has one column per local
   class, and columns beyond the client's `num_local_classes` are masked
   out of the softmax. Its logits are `e · W`, or with `head="cosine"`
   `s · normalize(e) · normalize(W)` (`kdpemb.models.heads`; a cosine head
   never starts at zeros), with an optional margin `s · m` off the true
   class in the loss.
2. `reconstruction_steps` local batches train the head alone (backbone
   frozen), then the remaining batches train both, with SGD (and momentum)
   at learning rate lr for the backbone and lr · head_lr_scale for the
   head. Local optimizer state starts at zero and is dropped.
3. The update is θ_local − θ over the backbone's trainable variables (and
   the global head in DP-FedAvg).

The updates are clipped and summed as they are produced (chunks of
`client_parallelism` clients at once, only over the rows that hold a
sampled client), so a round never holds more than one chunk of updates.
"""

from typing import NamedTuple

import keras
from keras import ops

from kdpemb.models import heads as heads_lib
from kdpemb.privacy import gaussian_sum

_MASKED_LOGIT = -1e9


class RoundConfig(NamedTuple):
    """The static settings of a round (Python values, fixed at trace time)."""

    learning_rate: float
    momentum: float
    nesterov: bool
    head_lr_scale: float
    reconstruction_steps: int
    clip_norm: float
    client_parallelism: int
    full_aggregation: bool
    head: str = "softmax"  # Or "cosine".
    head_scale: float = heads_lib.DEFAULT_SCALE  # s of the cosine logits.
    head_margin: float = 0.0  # Cosine margin m, in the training loss only.
    # The local head starts at the client's class means (`head_init=
    # "class_means"`) rather than at the head it is given.
    class_mean_heads: bool = False


class RoundResult(NamedTuple):
    """What a round produces on one replica, before noise."""

    clipped: gaussian_sum.ClippedSum  # This replica's sum of clipped updates.
    loss_sum: object  # Sum over clients of the mean local training loss.


def head_logits(embeddings, head, num_classes, cosine_scale=None):
    """`embeddings @ head` (or, given `cosine_scale`, the cosine logits
    `s · normalize(embeddings) @ normalize(head)`), with columns >=
    `num_classes` masked out."""
    if cosine_scale is None:
        logits = ops.matmul(embeddings, head)
    else:
        logits = heads_lib.cosine_logits(embeddings, head, cosine_scale)
    valid = ops.arange(ops.shape(head)[-1]) < num_classes
    return ops.where(valid, logits, _MASKED_LOGIT)


def masked_cross_entropy(logits, labels, mask):
    """Mean softmax cross-entropy over the examples where `mask` is true."""
    mask = ops.cast(mask, logits.dtype)
    log_norm = ops.logsumexp(logits, axis=-1)
    picked = ops.take_along_axis(
        logits, ops.expand_dims(ops.cast(labels, "int32"), -1), axis=-1
    )[..., 0]
    losses = (log_norm - picked) * mask
    return ops.sum(losses) / ops.maximum(ops.sum(mask), 1.0)


class ClientTrainer:
    """Local training of one virtual client; see the module docstring.

    Args:
        backbone: the `keras.Model` whose `stateless_call` embeds images.
        config: `RoundConfig`.
        value_and_grad: the backend's `value_and_grad(fn)`; `fn(params,
            *args)` takes a list of tensors first and returns a scalar.
    """

    def __init__(self, backbone, config, value_and_grad):
        self.backbone = backbone
        self.config = config
        self.value_and_grad = value_and_grad

    def _embed(self, backbone_values, non_trainable, images):
        images = ops.cast(images, "float32")
        # New non-trainable values (e.g. BatchNorm statistics) are dropped:
        # they would be computed from private data without noise.
        embeddings, _ = self.backbone.stateless_call(
            backbone_values, non_trainable, images, training=True
        )
        return ops.cast(embeddings, "float32")

    def _sgd(self, params, velocity, grads, learning_rates):
        cfg = self.config
        new_params, new_velocity = [], []
        for p, v, g, lr in zip(params, velocity, grads, learning_rates, strict=True):
            g = ops.zeros_like(p) if g is None else ops.cast(g, p.dtype)
            if cfg.momentum:
                v = cfg.momentum * v - lr * g
                step = cfg.momentum * v - lr * g if cfg.nesterov else v
            else:
                step = -lr * g
            new_params.append(p + step)
            new_velocity.append(v)
        return new_params, new_velocity

    def class_mean_head(self, theta, non_trainable, head, batch, steps):
        """The local head imprinted from the client's own examples: column c
        is the mean L2-normalised embedding (under the server's θ) of the
        client's examples of local class c, normalised; columns of classes
        the client does not hold keep `head`'s values. Computed inside the
        client and thrown away with the head, so it adds nothing to what
        leaves the client (the clipped backbone update)."""

        def add_batch(step, sums):
            images, labels, mask = batch(step)
            embeddings = self._embed(theta, non_trainable, images)
            embeddings = embeddings / ops.maximum(
                ops.norm(embeddings, axis=-1, keepdims=True), 1e-12
            )
            one_hot = ops.one_hot(labels, head.shape[-1]) * ops.cast(
                ops.expand_dims(mask, -1), "float32"
            )
            return sums + ops.matmul(ops.transpose(embeddings), one_hot)

        sums = ops.fori_loop(0, steps, add_batch, ops.zeros_like(head))
        norms = ops.norm(sums, axis=0, keepdims=True)
        return ops.where(norms > 0, sums / ops.maximum(norms, 1e-12), head)

    def train(self, theta, non_trainable, head, client):
        """Trains one client; returns `(update, mean local loss)`.

        Args:
            theta: list of the backbone's trainable values (the server's).
            non_trainable: list of the backbone's non-trainable values.
            head: the head the client starts from, `[D, columns]`.
            client: dict of one row of the round: `images [S, B, ...]`,
                `labels [S, B]` (local, or global in DP-FedAvg),
                `example_mask [S, B]`, `num_local_classes` (scalar).

        Returns:
            `update`: list, θ_local − θ (then the head's change in
            DP-FedAvg); `loss`: scalar, the mean loss over local steps.
        """
        cfg = self.config
        num_classes = client["num_local_classes"]
        steps = client["images"].shape[0]
        lr, head_lr = cfg.learning_rate, cfg.learning_rate * cfg.head_lr_scale

        def batch(step):
            return (
                ops.take(client["images"], step, axis=0),
                ops.take(client["labels"], step, axis=0),
                ops.take(client["example_mask"], step, axis=0),
            )

        cosine = cfg.head == "cosine"

        def head_loss(params, embeddings, labels, mask):
            head = params[0]
            logits = head_logits(
                embeddings, head, num_classes, cfg.head_scale if cosine else None
            )
            if cosine and cfg.head_margin:
                logits = heads_lib.margin_logits(
                    logits, labels, head.shape[-1], cfg.head_scale, cfg.head_margin
                )
            return masked_cross_entropy(logits, labels, mask)

        head_grad = self.value_and_grad(head_loss)

        def full_loss(params, images, labels, mask):
            embeddings = self._embed(params[:-1], non_trainable, images)
            return head_loss(params[-1:], embeddings, labels, mask)

        full_grad = self.value_and_grad(full_loss)

        def reconstruction_step(step, carry):
            head, head_velocity, loss = carry
            images, labels, mask = batch(step)
            embeddings = self._embed(theta, non_trainable, images)
            value, grads = head_grad([head], embeddings, labels, mask)
            (head,), (head_velocity,) = self._sgd(
                [head], [head_velocity], grads, [head_lr]
            )
            return head, head_velocity, loss + value

        def training_step(step, carry):
            params, velocity, loss = carry
            images, labels, mask = batch(step)
            value, grads = full_grad(params, images, labels, mask)
            rates = [lr] * (len(params) - 1) + [head_lr]
            params, velocity = self._sgd(params, velocity, grads, rates)
            return params, velocity, loss + value

        if cfg.class_mean_heads:
            head = self.class_mean_head(theta, non_trainable, head, batch, steps)
        zero = ops.zeros((), "float32")
        head_velocity = ops.zeros_like(head)
        if cfg.reconstruction_steps:
            head, head_velocity, loss = ops.fori_loop(
                0,
                cfg.reconstruction_steps,
                reconstruction_step,
                (head, head_velocity, zero),
            )
        else:
            loss = zero
        params = [*theta, head]
        velocity = [ops.zeros_like(p) for p in theta] + [head_velocity]
        params, _, loss = ops.fori_loop(
            cfg.reconstruction_steps,
            steps,
            training_step,
            (params, velocity, loss),
        )
        update = [new - old for new, old in zip(params[:-1], theta, strict=True)]
        if cfg.full_aggregation:
            update.append(params[-1] - head)
        return update, loss / steps


def run_round(trainer, theta, non_trainable, heads, data, clip_norm=None):
    """Trains the round's sampled clients and clips and sums their updates.

    Args:
        trainer: `ClientTrainer`.
        theta, non_trainable: lists of the backbone's values.
        heads: `[M_max, D, columns]` starting heads (one per row), or a
            single `[D, columns]` head shared by every client (DP-FedAvg).
        data: the round dict (`kdpemb.data.VirtualClients`); in DP-FedAvg
            `labels` must already be the global labels.
        clip_norm: float tensor or None. This round's C where it is model
            state (adaptive clipping); None takes the config's.

    Returns:
        `RoundResult` for the rows of `data` (this replica's share).
    """
    cfg = trainer.config
    if clip_norm is None:
        clip_norm = cfg.clip_norm
    client_mask = ops.cast(data["client_mask"], "bool")
    shared_head = len(heads.shape) == 2
    keys = ("images", "labels", "example_mask", "num_local_classes")
    rows = {key: data[key] for key in keys}
    if not shared_head:
        rows["head"] = heads
    num_active = ops.sum(ops.cast(client_mask, "int32"))
    num_rows = data["images"].shape[0]
    if num_rows is None or cfg.client_parallelism < num_rows:
        # The loop below visits only the first ceil(active / chunk) chunks:
        # move the sampled rows first (VirtualClients already puts them
        # there; other round sources may not).
        order = ops.argsort(ops.cast(ops.logical_not(client_mask), "int32"))
        rows = {key: ops.take(value, order, axis=0) for key, value in rows.items()}
        client_mask = ops.take(client_mask, order, axis=0)

    def train_client(client):
        head = heads if shared_head else client["head"]
        return trainer.train(theta, non_trainable, head, client)

    chunk = cfg.client_parallelism
    if num_rows is not None:
        # No wider than the rows (one row: no vectorised map at all).
        chunk = min(chunk, num_rows)
    if chunk > 1:

        def split(x):
            # Pads the client axis to a multiple of `chunk` (masked rows).
            rows = ops.shape(x)[0]
            padding = ops.zeros(((chunk - rows % chunk) % chunk, *x.shape[1:]), x.dtype)
            x = ops.concatenate([x, padding], axis=0)
            return ops.reshape(x, (-1, chunk, *x.shape[1:]))

        rows = {key: split(value) for key, value in rows.items()}
        client_mask = split(client_mask)

    template = [ops.zeros(ops.shape(t), "float32") for t in theta]
    if cfg.full_aggregation:
        template.append(ops.zeros(ops.shape(heads), "float32"))

    def body(index, carry):
        totals, count, nonfinite, within, loss_sum = carry
        row = {key: ops.take(value, index, axis=0) for key, value in rows.items()}
        mask = ops.take(client_mask, index, axis=0)
        if chunk > 1:
            updates, losses = ops.vectorized_map(train_client, row)
        else:
            update, loss = train_client(row)
            updates = [ops.expand_dims(u, 0) for u in update]
            losses = ops.expand_dims(loss, 0)
            mask = ops.expand_dims(mask, 0)
        clipped = gaussian_sum.clip_and_sum(updates, clip_norm, mask)
        kept = ops.cast(mask, "float32")
        finite_loss = ops.where(ops.isfinite(losses), losses, 0.0)
        return (
            [t + s for t, s in zip(totals, clipped.total, strict=True)],
            count + clipped.count,
            nonfinite + clipped.num_nonfinite,
            within + clipped.num_within_clip,
            loss_sum + ops.sum(finite_loss * kept),
        )

    num_iterations = (num_active + chunk - 1) // chunk
    zero_int = ops.zeros((), "int32")
    totals, count, nonfinite, within, loss_sum = ops.fori_loop(
        0,
        num_iterations,
        body,
        (template, zero_int, zero_int, zero_int, ops.zeros((), "float32")),
    )
    clipped = gaussian_sum.ClippedSum(
        total=totals,
        clip_norm=clip_norm,
        count=count,
        num_nonfinite=nonfinite,
        num_within_clip=within,
    )
    return RoundResult(clipped=clipped, loss_sum=loss_sum)


def random_heads(shape, seed_generator):
    """Fresh N(0, 1/D) heads `[M_max, D, columns]` for `head_init="random"`
    (and, with `"class_means"`, for the columns no example of the client
    covers)."""
    stddev = 1.0 / float(shape[-2]) ** 0.5
    return keras.random.normal(shape, stddev=stddev, seed=seed_generator)

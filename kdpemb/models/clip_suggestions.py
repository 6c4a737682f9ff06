"""Clip norms suggested from public data, at no privacy cost.

A clip norm near a middle quantile of the norms it clips keeps most of
the signal and bounds the noise: too small a C throws the updates'
length away, too large a C buys noise for nothing. Measuring those norms
on the private data would itself leak, so these helpers measure them on
**public** data only (a public dataset of other identities, synthetic
users, data whose owners consented to its release), which costs no
privacy budget; the guarantee is void if the data is private.

- `suggest_clip_norm(model, public_clients)`: the `quantile` of the
  update norms of a `FedEmbModel`'s local training (its client optimizer,
  heads and local steps, without clipping or noise) on public virtual
  clients, from the model's current backbone. Norms change as training
  goes on; `kdpemb.privacy.AdaptiveClipping` follows them privately.
- `suggest_feature_clip_norm(features)`: the `quantile` of the L2 norms
  of public features (from `kdpemb.features.extract`), for
  `LastLayerDPClassifier(feature_clip_norm=...)`.

Example:

>>> import numpy as np
>>> features = np.array([[3.0, 4.0], [0.6, 0.8], [6.0, 8.0]])
>>> suggest_feature_clip_norm(features)  # norms 5, 1 and 10
5.0
>>> suggest_feature_clip_norm(features, quantile=1.0)
10.0
"""

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb.privacy import gaussian_sum

__all__ = ["suggest_clip_norm", "suggest_feature_clip_norm"]


def _check_quantile(quantile):
    quantile = validation.check_finite_real(quantile, "quantile")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile!r}.")
    return quantile


def _quantile(norms, quantile, what):
    norms = np.asarray(norms, np.float64)
    finite = norms[np.isfinite(norms)]
    if finite.size == 0:
        raise ValueError(f"No finite {what} norm to take a quantile of.")
    return float(np.quantile(finite, quantile))


def suggest_feature_clip_norm(features, quantile=0.5):
    """The `quantile` of the L2 norms of **public** feature vectors.

    Args:
        features: array `[N, d]` of features of public data, e.g.
            `kdpemb.features.extract(backbone, public_images)`.
        quantile: float in [0, 1]. Defaults to 0.5 (the median).

    Returns:
        float: a `feature_clip_norm` for `LastLayerDPClassifier`.

    Example:

    >>> import numpy as np
    >>> from kdpemb.models import suggest_feature_clip_norm
    >>> public = np.array([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]])  # norms 5, 1, 10
    >>> suggest_feature_clip_norm(public), suggest_feature_clip_norm(public, 1.0)
    (5.0, 10.0)
    """
    quantile = _check_quantile(quantile)
    features = np.asarray(features, np.float64)
    if features.ndim != 2 or not features.size:
        raise ValueError(
            f"features must be a non-empty [N, d] array, got shape {features.shape}."
        )
    return _quantile(np.linalg.norm(features, axis=1), quantile, "feature")


def client_update_norms(model, public_clients, rounds=None):
    """The update norm of every sampled client of `rounds` public rounds.

    Each client trains as in `model`'s rounds (no clipping, no noise),
    from the model's current weights; nothing of the model changes.

    Args:
        model: `kdpemb.models.FedEmbModel`.
        public_clients: `kdpemb.data.VirtualClients` of public users, or a
            sequence of round dicts laid out as theirs.
        rounds: int or None. Rounds to draw from a `VirtualClients`;
            defaults to one epoch (`rounds_per_epoch`).

    Returns:
        float64 array of norms, one per sampled client.
    """
    from kdpemb.data import VirtualClients
    from kdpemb.models.fedemb import FedEmbModel, fedemb_checks, fedemb_step

    if not isinstance(model, FedEmbModel):
        raise TypeError(
            f"model must be a kdpemb.models.FedEmbModel, got {type(model).__name__}."
        )
    columns = None
    if isinstance(public_clients, VirtualClients):
        count = public_clients.rounds_per_epoch if rounds is None else rounds
        count = validation.check_positive_int(count, "rounds")
        columns = public_clients.max_local_classes
        source = (public_clients.round(index) for index in range(count))
    else:
        source = public_clients
    ops = keras.ops
    norms = []
    update_norm = None
    for data in source:
        steps = np.shape(data["images"])[1]
        data = fedemb_checks.check_round(data, steps)
        data = {key: ops.convert_to_tensor(value) for key, value in data.items()}
        trainer, theta, non_trainable, heads, data = fedemb_step.round_inputs(
            model, data, steps, columns
        )
        if update_norm is None:  # One trainer (and one compilation) for all.
            update_norm = _compiled_update_norm(trainer)
        shared_head = len(heads.shape) == 2
        sampled = np.flatnonzero(np.asarray(data["client_mask"]))
        for row in sampled:
            client = {
                key: data[key][row]
                for key in ("images", "labels", "example_mask", "num_local_classes")
            }
            head = heads if shared_head else heads[row]
            norm = update_norm(theta, non_trainable, head, client)
            norms.append(float(ops.convert_to_numpy(norm)))
    if not norms:
        raise ValueError("The public rounds sampled no client: give more rounds.")
    return np.asarray(norms, np.float64)


def _compiled_update_norm(trainer):
    """`(theta, non_trainable, head, client) -> ‖update‖`, compiled once."""

    def update_norm(theta, non_trainable, head, client):
        update, _ = trainer.train(theta, non_trainable, head, client)
        rows = [keras.ops.expand_dims(u, 0) for u in update]
        return gaussian_sum.global_norms(rows)[0]

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(update_norm)
    import tensorflow as tf

    return tf.function(update_norm, reduce_retracing=True)


def suggest_clip_norm(model, public_clients, *, rounds=None, quantile=0.5):
    """The `quantile` of a `FedEmbModel`'s client update norms on **public** data.

    Runs the model's local training (its client optimizer, heads and local
    steps; no clipping, no noise) for every sampled client of `rounds`
    rounds of `public_clients`, from the model's current backbone, and
    returns the `quantile` of the update norms: a `clip_norm` (or the
    initial C of adaptive clipping) for a model of the same settings.
    Free of privacy cost only because the data is public: never pass the
    private training data.

    Args:
        model: `kdpemb.models.FedEmbModel`. Its weights are not changed.
        public_clients: `kdpemb.data.VirtualClients` of public users (or a
            sequence of round dicts laid out as theirs), with the local
            steps and batch size of the private rounds.
        rounds: int or None. Rounds to draw; defaults to one epoch.
        quantile: float in [0, 1]. Defaults to 0.5 (the median).

    Returns:
        float: the suggested clip norm.

    Raises:
        ValueError: if the quantile is 0 (e.g. rounds of one local step
            from zero heads, where the backbone does not move).

    Example:

    >>> import keras
    >>> from kdpemb.data import VirtualClients
    >>> from kdpemb.datasets import synthetic_identities
    >>> from kdpemb.models import FedEmbModel
    >>> public = VirtualClients(synthetic_identities(16, 4, image_size=8),
    ...                         clients_per_round=2, users_per_client=4,
    ...                         num_clients=4, local_steps=2, batch_size=4,
    ...                         workers=1)
    >>> backbone = keras.Sequential([keras.Input((8, 8, 3)),
    ...                              keras.layers.Rescaling(1 / 255),
    ...                              keras.layers.Flatten(),
    ...                              keras.layers.Dense(4)])
    >>> model = FedEmbModel(backbone, noise_multiplier=1.0, head_init="random")
    >>> clip_norm = suggest_clip_norm(model, public, rounds=4)
    >>> clip_norm > 0
    True
    """
    quantile = _check_quantile(quantile)
    norms = client_update_norms(model, public_clients, rounds)
    suggestion = _quantile(norms, quantile, "update")
    if suggestion <= 0:
        raise ValueError(
            f"The {quantile:g} quantile of the public clients' update norms is "
            "0: their backbones did not move. With heads that start at zero "
            "the backbone gets no gradient in the first local step (nor in "
            "reconstruction steps): use local_steps >= reconstruction_steps + "
            "2 in the rounds, or head_init='random' or 'class_means'. A client "
            "whose examples "
            "are all of one identity has a zero gradient too (softmax over one "
            "class): use more users per client, or a higher quantile."
        )
    return suggestion

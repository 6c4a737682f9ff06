"""Audits of kdpemb's models through their own training: DP-SGD, DP-LS, FedEmb.

Each audit builds a tiny model, trains it with the model's own `fit` (one
`train_on_batch` round for `FedEmbModel`), scores what it released and
compares the bound with the model's own claim: `privacy_statement(delta)`
after the steps taken, from the library's accountant.

Canaries on coordinates of their own (DP-SGD and FedEmb). `trials` input
coordinates (pixels for FedEmb) are used by no ordinary example; a random
half of them hold one canary each (an example, or a user of two
out-of-distribution identities, nonzero on that coordinate only), the
other half hold none. A canary's gradient (or client update) then lies in
the kernel row of its coordinate, the other examples add nothing to
those rows, and each row's noise is an independent draw: one step
releases `trials` independent trials, the rows with a canary and the
rows without. White-box: the rows' change in one step is observed.
Black-box (`audit_dp_model`): only the final model after `steps` steps,
through its loss on each canary input.

What is claimed. The row of a canary and a row without one are the
releases of two datasets with the same number of examples (the canary,
or in its place an example that adds nothing to the observed rows, e.g.
an all-zero input to a network without bias), so the step divides both
by the same number, and on the observed rows they differ by the canary's
clipped contribution alone (norm at most C) under N(0, (zC)²) noise per
coordinate. With full-batch steps (every example, or every virtual client
of one user, in every step) that is the Gaussian mechanism that the
accountant's ε covers for adding or removing one example (or user), with
no sampling and so no amplification to account for; over `steps` steps,
its adaptive composition. The audits use exactly those settings.

DP-LS (`audit_last_layer_dp_ls`) releases statistics whose noise couples
the coordinates, so it is audited by repeated fits instead, each with
fresh noise, on the data with the canary and with an all-zero example in
its place (which adds nothing to the Gram matrix or the class sums).

Example:

>>> result = audit_dp_model(noise_multiplier=2.0, delta=1e-5, trials=400, seed=0)
>>> result.violated, round(result.claimed_epsilon, 2)
(False, 1.99)
"""

import contextlib
import warnings

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.audit.audit import audit_releases, audit_scores
from kdpemb.errors import ReproducibleNoiseWarning, ReproducibleSamplingWarning

__all__ = [
    "MODES",
    "audit_dp_model",
    "audit_fedemb_round",
    "audit_last_layer_dp_ls",
    "audit_last_layer_dp_sgd",
]

MODES = ("white-box", "black-box")
"""What an audit observes, for `mode=`: "white-box" (the release of each
step) or "black-box" (only the final model).

Example:

>>> from kdpemb.audit import model_audits
>>> model_audits.MODES
('white-box', 'black-box')
"""
_OTHER_COORDINATES = 4  # Inputs of the ordinary examples.


def _check_common(noise_multiplier, delta, trials, confidence):
    noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
    delta = validation.check_delta(delta)
    trials = validation.check_positive_int(trials, "trials")
    if trials < 8:
        raise ValueError(
            f"trials must be >= 8 (a quarter of them, with and without the "
            f"canary, is counted), got {trials}."
        )
    confidence = validation.check_probability(confidence, "confidence")
    if confidence == 1.0:
        raise ValueError("confidence must be below 1, e.g. 0.95.")
    return noise_multiplier, delta, trials, confidence


def _check_dense(clip_norm, num_others, num_classes, canary_norm):
    """The settings of the DP-SGD audits; `canary_norm` defaults to 10 C."""
    clip_norm = validation.check_clip_norm(clip_norm)
    num_others = validation.check_positive_int(num_others, "num_others")
    num_classes = validation.check_positive_int(num_classes, "num_classes")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}.")
    canary_norm = validation.check_positive(
        10.0 * clip_norm if canary_norm is None else canary_norm, "canary_norm"
    )
    return clip_norm, num_others, num_classes, canary_norm


@contextlib.contextmanager
def _seeded_models(seed):
    """A seeded audit's models are never released: their warning is noise."""
    with warnings.catch_warnings():
        if seed is not None:
            warnings.simplefilter("ignore", ReproducibleNoiseWarning)
            warnings.simplefilter("ignore", ReproducibleSamplingWarning)
        yield


def _canary_rows(trials, seed=None):
    """`(with_canary, without_canary)`: a random half of `range(trials)`
    and the rest, as int arrays in random order."""
    order = np.random.default_rng(seed).permutation(trials)
    return order[: trials // 2], order[trials // 2 :]


def _row_audit(before, after, rows, claimed, delta, confidence):
    """Audits the change of the kernel rows with and without a canary."""
    change = np.asarray(after, np.float64) - np.asarray(before, np.float64)
    with_canary, without_canary = rows
    return audit_releases(
        change[with_canary], change[without_canary], claimed, delta, confidence
    )


def _dense_canary_data(trials, num_others, num_classes, canary_input_norm, seed):
    """Features `[num_others + trials/2, trials + 4]`, labels, and the rows.

    The ordinary examples live on the last 4 coordinates; the canary of
    row t is `canary_input_norm · e_t` with label 0.
    """
    rng = np.random.default_rng(seed)
    with_canary, without_canary = _canary_rows(trials, rng.integers(2**31))
    others = np.zeros((num_others, trials + _OTHER_COORDINATES))
    others[:, trials:] = rng.normal(size=(num_others, _OTHER_COORDINATES))
    canaries = np.zeros((len(with_canary), trials + _OTHER_COORDINATES))
    canaries[np.arange(len(with_canary)), with_canary] = canary_input_norm
    features = np.vstack([others, canaries]).astype("float32")
    labels = np.concatenate(
        [rng.integers(0, num_classes, num_others), np.zeros(len(with_canary))]
    ).astype("int32")
    return features, labels, (with_canary, without_canary)


def _residual_norm(num_classes):
    """‖softmax − onehot‖ of a zero-logit example: √((K − 1) / K)."""
    return np.sqrt((num_classes - 1) / num_classes)


def _kernel(variable):
    return np.asarray(keras.ops.convert_to_numpy(variable), np.float64)


def audit_dp_model(
    noise_multiplier,
    delta,
    *,
    mode="white-box",
    steps=None,
    clip_norm=1.0,
    trials=2000,
    confidence=0.95,
    num_others=32,
    num_classes=2,
    canary_norm=None,
    seed=None,
):
    """Audits `kdpemb.models.DPModel`'s DP-SGD on a `Dense` layer.

    The network is `Dense(num_classes, use_bias=False)` from zeros, on
    `trials + 4` inputs, trained with SGD(1.0) and softmax cross-entropy
    by `DPModel.fit` with full-batch steps. Canaries: one input per row
    (see the module), with label 0, whose gradient at the start has norm
    `canary_norm` (default 10 C, so that a step without clipping shows it).

    - "white-box": one step; each row's change is observed and projected
      on a direction learned from the first half of the trials.
    - "black-box": `steps` steps (default 4); only the final network is
      used, through its loss on each row's canary input (a lower loss
      means "in").

    The claimed ε is the model's `privacy_statement(delta)` after its
    steps: full-batch Gaussian steps under add/remove of one example.

    Args:
        noise_multiplier: float >= 0. z.
        delta: float in (0, 1). δ of the claim.
        mode: "white-box" or "black-box".
        steps: int or None. Steps of the black-box run (white-box: 1).
        clip_norm: float > 0. C.
        trials: int >= 8. Rows: half with a canary, half without.
        confidence: float in (0, 1).
        num_others: int >= 1. Ordinary examples.
        num_classes: int >= 2. K.
        canary_norm: float or None. The canary's gradient norm at the start.
        seed: int or None. Seeds the data and the model's noise (an int
            makes the audit reproducible); None draws the noise from OS
            entropy.

    Returns:
        `AuditResult`.

    Example:

    >>> result = audit_dp_model(noise_multiplier=2.0, delta=1e-5, trials=200, seed=0)
    >>> result.violated, result.trials
    (False, 200)
    """
    from kdpemb.models import DPModel

    noise_multiplier, delta, trials, confidence = _check_common(
        noise_multiplier, delta, trials, confidence
    )
    mode = validation.check_choice(mode, MODES, "mode")
    if mode == "white-box" and steps not in (None, 1):
        raise ValueError(
            f"A white-box audit observes one step; got steps={steps!r}. Use "
            "mode='black-box' to audit the model after several steps."
        )
    steps = validation.check_positive_int(
        steps or (1 if mode == "white-box" else 4), "steps"
    )
    clip_norm, num_others, num_classes, canary_norm = _check_dense(
        clip_norm, num_others, num_classes, canary_norm
    )
    canary_input = canary_norm / _residual_norm(num_classes)
    features, labels, rows = _dense_canary_data(
        trials, num_others, num_classes, canary_input, seed
    )
    network = keras.Sequential(
        [
            keras.Input((features.shape[1],)),
            keras.layers.Dense(num_classes, use_bias=False, kernel_initializer="zeros"),
        ]
    )
    with _seeded_models(seed):
        model = DPModel(
            network, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
            delta=delta, seed=seed,
        )  # fmt: skip
        model.compile(
            keras.optimizers.SGD(1.0),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        before = _kernel(network.layers[-1].kernel)[:trials]
        model.fit(features, labels, epochs=steps, verbose=0)
    claimed = model.privacy_statement(delta).epsilon
    if mode == "white-box":
        after = _kernel(network.layers[-1].kernel)[:trials]
        return _row_audit(before, after, rows, claimed, delta, confidence)
    probes = np.zeros((trials, features.shape[1]), "float32")
    probes[np.arange(trials), np.arange(trials)] = canary_input
    losses = keras.ops.convert_to_numpy(
        keras.losses.sparse_categorical_crossentropy(
            np.zeros(trials, "int32"), network(probes), from_logits=True
        )
    )
    scores = -np.asarray(losses, np.float64)
    with_canary, without_canary = rows
    return audit_scores(
        scores[with_canary], scores[without_canary], claimed, delta, confidence
    )


def audit_last_layer_dp_sgd(
    noise_multiplier,
    delta,
    *,
    clip_norm=1.0,
    trials=2000,
    confidence=0.95,
    num_others=32,
    num_classes=2,
    canary_norm=None,
    seed=None,
):
    """White-box audit of one `LastLayerDPClassifier(method="dp-sgd")` step.

    One full-batch step of the classifier's own `fit` (a zero head with
    bias, SGD(1.0)) on the canary data of the module; each kernel row's
    change is observed. The canary's gradient at the start has norm
    `canary_norm` (default 10 C). The claimed ε is the classifier's
    `privacy_statement(delta)` after the step.

    Args: as `audit_dp_model` (no mode: white-box only).

    Returns:
        `AuditResult`.

    Example:

    >>> result = audit_last_layer_dp_sgd(2.0, 1e-5, trials=200, seed=0)
    >>> result.violated
    False
    """
    from kdpemb.models import LastLayerDPClassifier

    noise_multiplier, delta, trials, confidence = _check_common(
        noise_multiplier, delta, trials, confidence
    )
    clip_norm, num_others, num_classes, canary_norm = _check_dense(
        clip_norm, num_others, num_classes, canary_norm
    )
    # The gradient of (x, bias) has norm ‖r‖ · (‖x‖² + 1)^½ >= ‖r‖.
    residual = _residual_norm(num_classes)
    if canary_norm <= residual:
        raise ValueError(
            f"canary_norm={canary_norm!r} is not above {residual:.4g}, the norm "
            "of the bias part of a canary's gradient alone; the canary's "
            "kernel row would carry no signal. Use a larger canary_norm (the "
            "default is 10 · clip_norm)."
        )
    ratio = canary_norm / residual
    features, labels, rows = _dense_canary_data(
        trials, num_others, num_classes, np.sqrt(ratio**2 - 1.0), seed
    )
    with _seeded_models(seed):
        model = LastLayerDPClassifier(
            num_classes, "dp-sgd", clip_norm=clip_norm,
            noise_multiplier=noise_multiplier, delta=delta, seed=seed,
        )  # fmt: skip
        model.build(features.shape)
        before = _kernel(model.head.kernel)[:trials]
        model.fit(features, labels, verbose=0)
    after = _kernel(model.head.kernel)[:trials]
    claimed = model.privacy_statement(delta).epsilon
    return _row_audit(before, after, rows, claimed, delta, confidence)


def _fedemb_round(trials, num_others, pixel_value, local_steps, seed):
    """A round of `num_others + trials/2` one-user virtual clients.

    Every user holds two identities. An ordinary user's images live on the
    last 4 pixels; the canary user of row t has the out-of-distribution
    images `+pixel_value · e_t` (identity 0) and `−pixel_value · e_t`
    (identity 1).
    """
    rng = np.random.default_rng(seed)
    with_canary, without_canary = _canary_rows(trials, rng.integers(2**31))
    pixels = trials + _OTHER_COORDINATES
    clients = num_others + len(with_canary)
    images = np.zeros((clients, local_steps, 2, pixels), "float32")
    images[:num_others, :, :, trials:] = rng.normal(
        size=(num_others, local_steps, 2, _OTHER_COORDINATES)
    )
    for index, row in enumerate(with_canary):
        images[num_others + index, :, 0, row] = pixel_value
        images[num_others + index, :, 1, row] = -pixel_value
    labels = np.broadcast_to(np.array([0, 1], "int32"), (clients, local_steps, 2))
    data = {
        "images": images,
        "labels": np.ascontiguousarray(labels),
        "example_mask": np.ones((clients, local_steps, 2), bool),
        "client_mask": np.ones(clients, bool),
        "num_local_classes": np.full(clients, 2, "int32"),
    }
    return data, (with_canary, without_canary)


def audit_fedemb_round(
    noise_multiplier,
    delta,
    *,
    clip_norm=1.0,
    trials=1000,
    confidence=0.95,
    num_others=8,
    embedding_dim=4,
    pixel_value=50.0,
    seed=None,
):
    """White-box audit of one DP-FedEmb round of `kdpemb.models.FedEmbModel`.

    The backbone is `Dense(embedding_dim, use_bias=False)` on
    `trials + 4` pixels, its rows for the canary pixels all starting at
    one vector of norm 0.01; every virtual client is one user of two identities and
    trains locally for 2 steps (learning rate 0.5, head 10 times that),
    and the round (`train_on_batch`, full batch: every client of the
    schedule takes part) is applied with SGD(1.0). A canary user's images
    are nonzero on its own pixel only (out-of-distribution identities),
    so its update lies in that pixel's row (along the row's start); with
    the default `pixel_value` its norm is about 14 before clipping. Each row's
    change is observed. The claimed ε is the model's
    `privacy_statement(delta)` after the round: one Gaussian round under
    add/remove of one user (one user per virtual client).

    Args:
        noise_multiplier, delta, clip_norm, trials, confidence, seed: as
            `audit_dp_model`.
        num_others: int >= 1. Ordinary users (virtual clients).
        embedding_dim: int >= 1. D.
        pixel_value: float > 0. The canary images' one nonzero pixel.

    Returns:
        `AuditResult`.

    Example:

    >>> result = audit_fedemb_round(2.0, 1e-5, trials=100, seed=0)
    >>> result.violated
    False
    """
    from kdpemb.models import FedEmbModel
    from kdpemb.privacy import Schedule

    noise_multiplier, delta, trials, confidence = _check_common(
        noise_multiplier, delta, trials, confidence
    )
    clip_norm = validation.check_clip_norm(clip_norm)
    num_others = validation.check_positive_int(num_others, "num_others")
    embedding_dim = validation.check_positive_int(embedding_dim, "embedding_dim")
    pixel_value = validation.check_positive(pixel_value, "pixel_value")
    local_steps = 2
    data, rows = _fedemb_round(trials, num_others, pixel_value, local_steps, seed)
    clients = len(data["client_mask"])
    backbone = keras.Sequential(
        [
            keras.Input((trials + _OTHER_COORDINATES,)),
            keras.layers.Dense(embedding_dim, use_bias=False),
        ]
    )
    rng = np.random.default_rng(None if seed is None else seed + 1)
    kernel = rng.normal(size=(trials + _OTHER_COORDINATES, embedding_dim))
    # Every canary row starts at one small vector (norm 0.01).
    kernel[:trials] = 0.01 / np.sqrt(embedding_dim)
    backbone.set_weights([kernel.astype("float32")])
    schedule = Schedule.virtual_clients(
        clients, clients, sampling="full_batch", local_steps=local_steps
    )
    with _seeded_models(seed):
        model = FedEmbModel(
            backbone, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
            schedule=schedule, delta=delta, client_optimizer=0.5,
            head_lr_scale=10.0, seed=seed,
        )  # fmt: skip
        model.compile(keras.optimizers.SGD(1.0))
        model.train_on_batch(data)
    after = _kernel(backbone.layers[-1].kernel)[:trials]
    claimed = model.privacy_statement(delta).epsilon
    return _row_audit(kernel[:trials], after, rows, claimed, delta, confidence)


def audit_last_layer_dp_ls(
    noise_multiplier,
    delta,
    *,
    feature_clip_norm=1.0,
    trials=1000,
    confidence=0.95,
    dim=4,
    num_others=40,
    num_classes=2,
    seed=None,
):
    """White-box audit of one `LastLayerDPClassifier(method="dp-ls")` step.

    The other examples' features are zero on the first coordinate; the
    canary is `feature_clip_norm · e_0` with label 0, and without it an
    all-zero example with label 0 takes its place (it adds nothing to the
    Gram matrix or the class sums, and keeps the number of examples, so
    both fits release the statistics of the same schedule). Each of
    `trials` fits (half with the canary, half without; the model's own
    `fit`, fresh noise each time) releases a head, observed through the
    kernel row of the canary's coordinate. The claimed ε is the model's
    `privacy_statement(delta)` for its one step.

    Args:
        noise_multiplier: float > 0. z of the step.
        delta: float in (0, 1).
        feature_clip_norm: float > 0. C_x.
        trials: int >= 8. Fits in all.
        confidence: float in (0, 1).
        dim, num_others, num_classes: the size of the data.
        seed: int or None. Seeds the data and the noise (None: the noise
            from OS entropy).

    Returns:
        `AuditResult`.

    Example:

    >>> result = audit_last_layer_dp_ls(2.0, 1e-5, trials=100, seed=0)
    >>> result.violated
    False
    """
    from kdpemb.models import LastLayerDPClassifier

    noise_multiplier, delta, trials, confidence = _check_common(
        noise_multiplier, delta, trials, confidence
    )
    feature_clip_norm = validation.check_positive(
        feature_clip_norm, "feature_clip_norm"
    )
    rng = np.random.default_rng(seed)
    others = rng.normal(size=(num_others, dim))
    others[:, 0] = 0.0
    others *= feature_clip_norm / np.linalg.norm(others, axis=1, keepdims=True)
    labels = np.append(rng.integers(0, num_classes, num_others), 0)
    canary = np.zeros((1, dim))
    canary[0, 0] = feature_clip_norm
    datasets = (
        np.vstack([others, canary]).astype("float32"),
        np.vstack([others, 0.0 * canary]).astype("float32"),
    )
    with _seeded_models(seed):
        model = LastLayerDPClassifier(
            num_classes, "dp-ls", feature_clip_norm=feature_clip_norm,
            noise_multiplier=noise_multiplier, delta=delta, seed=seed,
        )  # fmt: skip
        releases = []
        for features in datasets:
            rows = []
            for _ in range(trials // 2):
                model.fit(features, labels, verbose=0)
                rows.append(_kernel(model.head.kernel)[0])
            releases.append(np.array(rows))
    # Each fit is one release of the same step: the claim is for one step.
    claimed = privacy.epsilon(model.privacy_mechanism(), steps=1, delta=delta)
    return audit_releases(releases[0], releases[1], claimed, delta, confidence)

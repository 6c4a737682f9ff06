"""One DP-FedEmb round (`fedemb_round`): reference, sensitivity, robustness.

The round functions are called directly, before noise, on hand-built
rounds and on rounds of `VirtualClients`, and compared with the NumPy
reference in `fedemb_reference`.
"""

import functools
from typing import NamedTuple

import keras
import numpy as np
import pytest

from kdpemb.data import VirtualClients
from kdpemb.models._shared import backends
from kdpemb.models.fedemb import fedemb_round
from tests.models import fedemb_reference as ref

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleSamplingWarning"
)

EMBEDDING_DIM = 3


class Round(NamedTuple):
    """A round's pre-noise result, as NumPy values."""

    total: np.ndarray  # The clipped sum (one kernel-shaped array).
    count: int
    num_nonfinite: int
    loss_sum: float


@functools.cache
def _compiled_round(config):
    """`run_round` for `config` on the linear backbone.

    Jitted on JAX (eager on TensorFlow) and cached per configuration; the
    backbone's values are arguments, so JAX compiles once per round shape.
    """
    template = ref.linear_backbone(EMBEDDING_DIM)
    trainer = fedemb_round.ClientTrainer(
        template, config, backends.current().value_and_grad
    )

    def run(theta, heads, data):
        result = fedemb_round.run_round(trainer, theta, [], heads, data)
        clipped = result.clipped
        return clipped.total, clipped.count, clipped.num_nonfinite, result.loss_sum

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(run)
    return run


def round_sum(
    backbone,
    data,
    *,
    lr=0.1,
    head_lr_scale=10.0,
    momentum=0.0,
    nesterov=False,
    reconstruction_steps=0,
    clip_norm=1e9,
    client_parallelism=1,
    rows=None,
    class_mean_heads=False,
):
    """Runs `fedemb_round.run_round` from zero heads on a round.

    `rows` pads the round with unsampled rows (one compiled shape for
    rounds of different sizes).
    """
    config = fedemb_round.RoundConfig(
        learning_rate=lr,
        momentum=momentum,
        nesterov=nesterov,
        head_lr_scale=head_lr_scale,
        reconstruction_steps=reconstruction_steps,
        clip_norm=clip_norm,
        client_parallelism=client_parallelism,
        full_aggregation=False,
        class_mean_heads=class_mean_heads,
    )
    if rows is not None:
        data = pad_rows(data, rows)
    num_rows, steps, batch = data["labels"].shape
    heads = np.zeros((num_rows, EMBEDDING_DIM, steps * batch), "float32")
    theta = [v.value for v in backbone.trainable_variables]
    tensors = {key: keras.ops.convert_to_tensor(value) for key, value in data.items()}
    run = _compiled_round(config)
    total, count, nonfinite, loss_sum = run(
        theta, keras.ops.convert_to_tensor(heads), tensors
    )
    return Round(
        total=np.asarray(keras.ops.convert_to_numpy(total[0])),
        count=int(keras.ops.convert_to_numpy(count)),
        num_nonfinite=int(keras.ops.convert_to_numpy(nonfinite)),
        loss_sum=float(keras.ops.convert_to_numpy(loss_sum)),
    )


def pad_rows(data, rows):
    extra = rows - data["client_mask"].shape[0]
    assert extra >= 0
    return {
        key: np.concatenate([value, np.zeros((extra, *value.shape[1:]), value.dtype)])
        for key, value in data.items()
    }


def reference_sum(kernel, data, clip_norm=1e9, **settings):
    """The sum of the hand-written clients' clipped updates."""
    total = np.zeros(kernel.shape)
    for client in ref.client_rows(data):
        head = np.zeros((kernel.shape[1], 1 + client["num_local_classes"]))
        update, _ = ref.client_update(kernel, head, client, **settings)
        total += ref.clip([update], clip_norm)[0]
    return total


def without_row(data, row):
    """The round without client `row` (later clients move up a row)."""
    order = [r for r in range(len(data["client_mask"])) if r != row] + [row]
    out = {key: value[order].copy() for key, value in data.items()}
    out["client_mask"][-1] = False
    return out


# --------------------------------------------------- no noise, no clip --


@pytest.mark.parametrize(
    ("momentum", "nesterov", "reconstruction_steps"),
    [(0.0, False, 0), (0.9, False, 0), (0.5, True, 1), (0.0, False, 2)],
)
def test_round_sum_equals_hand_written_clients(
    momentum, nesterov, reconstruction_steps
):
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=1)
    data = ref.make_round(2, classes=(3, 2), steps=3)
    settings = {
        "lr": 0.2,
        "head_lr_scale": 5.0,
        "momentum": momentum,
        "nesterov": nesterov,
        "reconstruction_steps": reconstruction_steps,
    }
    result = round_sum(backbone, data, **settings)
    expected = reference_sum(ref.kernel_of(backbone), data, **settings)
    assert np.abs(expected).max() > 1e-2  # The round does move the backbone.
    np.testing.assert_allclose(result.total, expected, rtol=2e-4, atol=1e-6)
    assert result.count == 2 and result.num_nonfinite == 0


def test_clipping_scales_each_client_update_to_the_clip_norm():
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=1)
    data = ref.make_round(3, classes=(3, 2), steps=2)
    settings = {"lr": 1.0, "head_lr_scale": 10.0}
    kernel = ref.kernel_of(backbone)
    unclipped = [
        ref.client_update(kernel, np.zeros((EMBEDDING_DIM, 4)), c, **settings)[0]
        for c in ref.client_rows(data)
    ]
    clip_norm = 0.5 * min(np.linalg.norm(u) for u in unclipped)
    result = round_sum(backbone, data, clip_norm=clip_norm, **settings)
    expected = sum(u * clip_norm / np.linalg.norm(u) for u in unclipped)
    np.testing.assert_allclose(result.total, expected, rtol=2e-4, atol=1e-7)


def test_clients_in_any_rows_of_the_round_are_all_trained():
    # A round of another source (fit accepts "any dataset of the same round
    # dicts") need not put its sampled clients in the first rows.
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=1)
    data = ref.make_round(4, classes=(3, 2), rows=4, steps=2)
    order = [2, 0, 3, 1]  # The sampled clients now sit in rows 1 and 3.
    shuffled = {key: value[order] for key, value in data.items()}
    assert shuffled["client_mask"].tolist() == [False, True, False, True]
    result = round_sum(backbone, shuffled, lr=0.2)
    expected = reference_sum(ref.kernel_of(backbone), data, lr=0.2, head_lr_scale=10.0)
    assert result.count == 2
    np.testing.assert_allclose(result.total, expected, rtol=2e-4, atol=1e-6)


# ---------------------------------------------------------- sensitivity --

SENSITIVITY = {"lr": 1.0, "clip_norm": 0.05, "rows": 12}


def population(num_users, seed):
    """Users with 2..4 examples of random identities, 4x4x1 images."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(2, 5, size=num_users)
    user_ids = np.repeat(np.arange(num_users), counts)
    images = rng.normal(size=(user_ids.size, *ref.IMAGE_SHAPE)).astype("float32")
    labels = rng.integers(0, 4, size=user_ids.size)
    return images, labels, user_ids


def sampled(data):
    """The round's sampled rows (what a correct round reads)."""
    return {key: value[data["client_mask"]] for key, value in data.items()}


def neighbouring_rounds(users_per_client, num_users, clients_per_round, seed):
    """Two rounds of D and D' = D minus one user that differ."""
    images, labels, user_ids = population(num_users, seed)
    kept = user_ids != seed % num_users
    common = {
        "users_per_client": users_per_client,
        "local_steps": 2,
        "batch_size": 2,
        "num_classes": 4,
        "max_clients_per_round": SENSITIVITY["rows"],
        "seed": 7 + seed,
    }
    if users_per_client == 1:
        # P = N: M is scaled so that q = M / N, a public rate, is the same.
        ratio = (num_users - 1) / num_users
        settings = [{"clients_per_round": clients_per_round}, {}]
        settings[1]["clients_per_round"] = clients_per_round * ratio
    else:
        # P is public and the same for N and N - 1 users.
        pool = -(-num_users // users_per_client)
        settings = [{"clients_per_round": clients_per_round, "num_clients": pool}] * 2
    full, neighbour = (
        VirtualClients(images[keep], labels[keep], user_ids[keep], **common, **extra)
        for keep, extra in zip((np.ones_like(kept), kept), settings, strict=True)
    )
    pairs = []
    for index in range(40):
        a, b = full.round(index), neighbour.round(index)
        if a["client_mask"].sum() != b["client_mask"].sum() or not all(
            np.array_equal(value, sampled(b)[key]) for key, value in sampled(a).items()
        ):
            pairs.append((a, b))
        if len(pairs) == 2:
            return pairs
    raise AssertionError("the removed user took part in no round")


# Local heads imprinted from the client's own data (head_init=
# "class_means") are one more function of that client's data: the bounds
# hold with them too.
@pytest.mark.parametrize("class_mean_heads", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_removing_a_single_user_client_moves_the_sum_by_exactly_c(
    seed, class_mean_heads
):
    # k = 1: removing a user removes one clipped update. Its norm is C when
    # clipping binds (a large learning rate), so the bound C is attained.
    clip_norm = SENSITIVITY["clip_norm"]
    settings = dict(SENSITIVITY, class_mean_heads=class_mean_heads)
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=seed)
    for a, b in neighbouring_rounds(1, num_users=10, clients_per_round=5, seed=seed):
        assert a["client_mask"].sum() == b["client_mask"].sum() + 1
        gap = np.linalg.norm(
            round_sum(backbone, a, **settings).total
            - round_sum(backbone, b, **settings).total
        )
        assert clip_norm * (1 - 1e-3) <= gap <= clip_norm * (1 + 1e-5)


@pytest.mark.parametrize("class_mean_heads", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_changing_a_multi_user_client_moves_the_sum_by_at_most_2c(
    seed, class_mean_heads
):
    # k > 1: removing a user changes the content of one virtual client.
    clip_norm = SENSITIVITY["clip_norm"]
    settings = dict(SENSITIVITY, class_mean_heads=class_mean_heads)
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=seed)
    gaps = [
        np.linalg.norm(
            round_sum(backbone, a, **settings).total
            - round_sum(backbone, b, **settings).total
        )
        for a, b in neighbouring_rounds(3, num_users=12, clients_per_round=2, seed=seed)
    ]
    assert max(gaps) <= 2 * clip_norm * (1 + 1e-5)
    assert min(gaps) > 0  # The user's removal did change the round.


def test_the_2c_bound_is_attained_by_opposite_client_contents():
    # Two contents of one virtual client whose updates point in opposite
    # directions: the second batch's images lie in the null space of W,
    # so negating them (another user's data) negates the client's update
    # (the first batch only trains the head, which starts at zeros).
    clip_norm = SENSITIVITY["clip_norm"]
    rng = np.random.default_rng(5)
    kernel = rng.normal(size=(ref.PIXELS, EMBEDDING_DIM))
    backbone = ref.linear_backbone(EMBEDDING_DIM, kernel=kernel)
    projector = np.eye(ref.PIXELS) - kernel @ np.linalg.pinv(kernel)
    data = ref.make_round(6, classes=(2, 2), steps=2, batch=2)
    data["example_mask"][0] = True
    data["labels"][0] = [[0, 1], [1, 0]]
    first = rng.normal(size=(2, ref.PIXELS))
    second = 3 * rng.normal(size=(2, ref.PIXELS)) @ projector
    sums = []
    for sign in (1.0, -1.0):
        images = np.stack([first, sign * second]).reshape(2, 2, *ref.IMAGE_SHAPE)
        data["images"][0] = images
        sums.append(round_sum(backbone, data, **SENSITIVITY).total)
    gap = np.linalg.norm(sums[0] - sums[1])
    assert 2 * clip_norm * (1 - 1e-2) <= gap <= 2 * clip_norm * (1 + 1e-5)


def test_a_class_mean_head_starts_at_each_local_classs_mean_embedding():
    # head_init="class_means": column c is the normalised mean of the
    # normalised embeddings of the client's unmasked examples of class c;
    # a column of no example keeps the head given.
    kernel = np.random.default_rng(3).normal(size=(ref.PIXELS, EMBEDDING_DIM))
    backbone = ref.linear_backbone(EMBEDDING_DIM, kernel=kernel)
    data = ref.make_round(4, classes=(3,), rows=1, steps=2, batch=4)
    data["example_mask"][0, 1, 2:] = False  # Two masked examples.
    client = {key: keras.ops.convert_to_tensor(value[0]) for key, value in data.items()}
    config = fedemb_round.RoundConfig(
        learning_rate=0.1, momentum=0.0, nesterov=False, head_lr_scale=1.0,
        reconstruction_steps=0, clip_norm=1.0, client_parallelism=1,
        full_aggregation=False, class_mean_heads=True,
    )  # fmt: skip
    trainer = fedemb_round.ClientTrainer(
        backbone, config, backends.current().value_and_grad
    )
    start = np.random.default_rng(4).normal(size=(EMBEDDING_DIM, 5)).astype("float32")

    def batch(step):
        return tuple(
            keras.ops.take(client[key], step, axis=0)
            for key in ("images", "labels", "example_mask")
        )

    theta = [v.value for v in backbone.trainable_variables]
    head = keras.ops.convert_to_numpy(
        trainer.class_mean_head(theta, [], keras.ops.convert_to_tensor(start), batch, 2)
    )
    embeddings = data["images"][0].reshape(-1, ref.PIXELS) @ kernel
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    labels = data["labels"][0].reshape(-1)
    mask = data["example_mask"][0].reshape(-1)
    for column in range(5):
        chosen = embeddings[mask & (labels == column)]
        if len(chosen):
            mean = chosen.sum(axis=0)
            np.testing.assert_allclose(head[:, column], mean / np.linalg.norm(mean),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
        else:
            np.testing.assert_array_equal(head[:, column], start[:, column])
    assert len(set(labels[mask].tolist())) >= 2  # Columns 3-4: none.


# ------------------------------------------------- robustness, layout --


def test_a_non_finite_client_update_is_zeroed_and_counted():
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=1)
    data = ref.make_round(7, classes=(3, 2, 2), rows=3, steps=2)
    data["images"][1, 0, 0] = np.inf
    settings = {"lr": 0.5, "clip_norm": 1.0}
    poisoned = round_sum(backbone, data, **settings)
    without = round_sum(backbone, without_row(data, 1), **settings)
    assert np.isfinite(poisoned.total).all()
    np.testing.assert_allclose(poisoned.total, without.total, rtol=1e-5, atol=1e-7)
    assert poisoned.num_nonfinite == 1 and without.num_nonfinite == 0
    assert poisoned.count == 3 and without.count == 2


@pytest.mark.parametrize("class_mean_heads", [False, True])
def test_vectorised_clients_equal_clients_one_after_another(class_mean_heads):
    # Padded with unsampled rows of garbage, which must count for nothing.
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=3)
    data = ref.make_round(8, classes=(3, 2, 2, 3), rows=5, steps=2)
    settings = {"lr": 0.5, "momentum": 0.5, "clip_norm": 0.3,
                "class_mean_heads": class_mean_heads}  # fmt: skip
    one = round_sum(backbone, data, client_parallelism=1, **settings)
    three = round_sum(backbone, data, client_parallelism=3, **settings)
    np.testing.assert_allclose(three.total, one.total, rtol=1e-4, atol=1e-6)
    assert one.count == three.count == 4
    np.testing.assert_allclose(three.loss_sum, one.loss_sum, rtol=1e-4)


def test_a_single_row_with_vectorised_clients_trains_it_once():
    # One row (a device's share of a small round): no vectorised map, the
    # same sum as clients one after another.
    backbone = ref.linear_backbone(EMBEDDING_DIM, seed=3)
    data = ref.make_round(8, classes=(3,), rows=1, steps=2)
    settings = {"lr": 0.5, "clip_norm": 0.3}
    one = round_sum(backbone, data, client_parallelism=1, **settings)
    four = round_sum(backbone, data, client_parallelism=4, **settings)
    np.testing.assert_allclose(four.total, one.total, rtol=1e-5, atol=1e-7)
    assert one.count == four.count == 1

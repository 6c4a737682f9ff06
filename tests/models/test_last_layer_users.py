"""LastLayerDPClassifier(unit="user"): per-user clipping, noise, accounting.

Each user adds one contribution per step: the mean over at most k of
their examples of the head gradient (DP-SGD), or of every statistic (the
closed forms), so removing a user moves the released sum by at most the
sensitivity of one example. Checked against float64 NumPy and backend
autodiff on hand-made slot batches and on replays of the users each fit
sampled. Tiny data throughout.
"""

import warnings

import dp_accounting
import keras
import numpy as np
import pytest

from kdpemb import privacy
from kdpemb.data import user_batches
from kdpemb.models._shared import backends
from kdpemb.models.last_layer import LastLayerDPClassifier
from kdpemb.models.last_layer import last_layer_stats as stats
from kdpemb.models.last_layer.last_layer_dp_sgd_head import clipped_user_head_gradient
from kdpemb.models.last_layer.last_layer_users import user_weights
from tests.models import last_layer_reference as ref
from tests.models.test_last_layer import make_model as example_level_model
from tests.models.test_last_layer import steps_of

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.DegenerateFeaturesWarning"),
]

DELTA = 1e-3
COUNTS = (1, 3, 2, 4, 1, 2, 3, 4, 2, 1, 3, 2)  # 12 users, 28 examples.


def user_data(counts=COUNTS, dim=5, num_classes=3, seed=0):
    """Features, labels and user ids, user u holding `counts[u]` examples."""
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(len(counts)) * 7 + 3, counts)  # Not 0..U-1.
    n = len(users)
    labels = rng.integers(0, num_classes, n)
    centers = 1.5 * rng.normal(size=(num_classes, dim))
    features = rng.normal(size=(n, dim)) + centers[labels]
    order = rng.permutation(n)  # A user's rows are not contiguous.
    return (
        features[order].astype("float32"),
        labels[order].astype("int32"),
        users[order],
    )


def make_model(num_classes, method="dp-sgd", optimizer=None, **overrides):
    """A seeded, compiled user-level classifier (k = 4, z = 0, huge C)."""
    overrides = {"unit": "user", "examples_per_user": 4, **overrides}
    return example_level_model(num_classes, method, optimizer, **overrides)


def flat(gradient):
    kernel, bias = gradient
    return np.concatenate([kernel, bias[None]], axis=0)


def user_means(kernel, bias, features, labels, slots):
    """Each user's mean autodiff gradient `[d + 1, K]` (kernel rows, then
    bias), for `slots`: one array of example indices per user."""
    grads = ref.per_example_gradients(kernel, bias, features, labels)
    return [np.mean([flat(grads[i]) for i in rows], axis=0) for rows in slots]


def clip(gradient, clip_norm):
    norm = np.sqrt(np.sum(gradient**2))
    return gradient * min(1.0, clip_norm / norm)


def slot_batch(features, slots, k, pad_row=0):
    """`(rows, mask)` in the slot layout: slot j holds `slots[j]`'s rows,
    then copies of `pad_row`; `None` is a slot of padding only."""
    index, mask = [], []
    for rows in slots:
        rows = [] if rows is None else list(rows)
        index += rows + [pad_row] * (k - len(rows))
        mask += [1.0] * len(rows) + [0.0] * (k - len(rows))
    return np.array(index), np.array(mask, "float32")


def residuals_of(features, labels, kernel, bias):
    logits = np.asarray(features, np.float64) @ kernel + bias
    return (ref.softmax(logits) - ref.one_hot(labels, kernel.shape[1])).astype(
        "float32"
    )


def head_gradient(features, residuals, clip_norm, mask, k):
    clipped = clipped_user_head_gradient(features, residuals, clip_norm, mask, k)
    counts = (clipped.count, clipped.num_nonfinite, clipped.num_within_clip)
    return ref.to_numpy(clipped.total[0]), [int(ref.to_numpy(c)) for c in counts]


# ---------------------------------------------------- the head gradient --


def test_the_clipped_sum_is_the_sum_of_the_clipped_user_mean_gradients():
    # Users of 1, 3 and 2 rows (k = 3), a padding slot, a NaN padding row
    # (no effect) and a user with a NaN row (left out alone). Brute force:
    # each user's mean of backend-autodiff per-example gradients, clipped.
    rng = np.random.default_rng(1)
    k, dim, num_classes = 3, 5, 3
    features = rng.normal(size=(10, dim)).astype("float32")
    features[[3, 4, 5]] *= 3.0  # A large-gradient user, clipped.
    labels = rng.integers(0, num_classes, 10).astype("int32")
    kernel = rng.normal(size=(dim, num_classes)) * 0.5
    bias = rng.normal(size=num_classes) * 0.1
    users = [[0], [3, 4, 5], [1, 2], None, [6, 7]]
    index, mask = slot_batch(features, users, k)
    x, y = features[index].copy(), labels[index]
    x[2] = np.nan  # A padding row of the first slot.
    x[13] = np.nan  # A real row of the last user.
    r = residuals_of(x, y, kernel, bias)

    finite = [rows for rows in users[:3]]
    means = user_means(kernel, bias, features, labels, finite)
    norms = [np.sqrt(np.sum(m**2)) for m in means]
    clip_norm = float(np.sqrt(min(norms) * max(norms)))  # Clips some, not all.
    expected = sum(clip(m, clip_norm) for m in means)

    total, (count, nonfinite, within) = head_gradient(x, r, clip_norm, mask, k)
    np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-6)
    assert (count, nonfinite) == (4, 1)  # Four users; the NaN one left out.
    assert max(norms) > clip_norm and within == sum(n <= clip_norm for n in norms)
    # Unclipped, the sum is of the means (1 / n_u), not of the rows.
    total, _ = head_gradient(x, r, 1e9, mask, k)
    np.testing.assert_allclose(total, sum(means), rtol=1e-5, atol=1e-6)


def test_removing_a_user_moves_the_clipped_sum_by_at_most_c():
    rng = np.random.default_rng(2)
    k, dim, num_classes, clip_norm = 4, 4, 3, 3.0
    features = rng.normal(size=(16, dim)).astype("float32")
    labels = rng.integers(0, num_classes, 16).astype("int32")
    features[12:16] = 40.0 * features[12]  # One user: four aligned large rows.
    labels[12:16] = labels[12]
    kernel, bias = np.zeros((dim, num_classes)), np.zeros(num_classes)
    users = [[0, 1], [2, 3, 4, 5], [6], [7, 8, 9], [10, 11], [12, 13, 14, 15]]

    def clipped_sum(slots):
        index, mask = slot_batch(features, slots, k)
        r = residuals_of(features[index], labels[index], kernel, bias)
        return head_gradient(features[index], r, clip_norm, mask, k)[0]

    full = clipped_sum(users)
    moves = [
        np.sqrt(np.sum((full - clipped_sum(users[:u] + users[u + 1 :])) ** 2))
        for u in range(len(users))
    ]
    assert max(moves) <= clip_norm * (1 + 1e-5)
    # The large user reaches C (summed rows would move it by 4C).
    assert moves[-1] == pytest.approx(clip_norm, rel=1e-4)
    assert min(moves) < 0.9 * clip_norm


# ------------------------------------------------------------ training --


class RecordedUsers:
    """Records the slot batches `UserIndices.sample` draws for `fit`."""

    def __init__(self, monkeypatch):
        self.batches = []
        sample = user_batches.UserIndices.sample

        def recording_sample(sampler, index):
            out = sample(sampler, index)
            self.batches.append((index, *(np.array(a) for a in out)))
            return out

        monkeypatch.setattr(user_batches.UserIndices, "sample", recording_sample)

    def used(self, steps):
        used = self.batches[-steps:]
        assert [b[0] for b in used] == list(range(steps))
        return [(index, mask) for _, index, mask in used]


def force_host_gathering(monkeypatch):
    def out_of_memory(arrays, held):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating the rows")

    monkeypatch.setattr(backends.current(), "hold_rows", out_of_memory)


def test_without_noise_a_full_batch_step_is_gradient_descent_on_user_means():
    # Every user every step, k >= every user's count: the step is
    # W − lr (1/U) Σ_u mean_{i∈u} ∇ℓ_i, not the mean over examples.
    features, labels, users = user_data()
    lr = 0.5
    model = make_model(3, optimizer=keras.optimizers.SGD(lr), head_init="random")
    weights = ref.EpochWeights()
    model.fit(features, labels, users=users, verbose=0, callbacks=[weights])
    kernel, bias = weights.kernels[0], weights.biases[0]
    slots = [np.flatnonzero(users == u) for u in np.unique(users)]
    mean = np.mean(user_means(kernel, bias, features, labels, slots), axis=0)
    np.testing.assert_allclose(
        ref.to_numpy(model.head.kernel), kernel - lr * mean[:-1], rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(ref.to_numpy(model.head.bias),
                               bias - lr * mean[-1], rtol=1e-4, atol=1e-6)  # fmt: skip
    examples = np.mean([flat(g) for g in ref.per_example_gradients(
        kernel, bias, features, labels)], axis=0)  # fmt: skip
    assert np.abs(examples - mean).max() > 1e-3  # The two are told apart.
    assert steps_of(model) == 1


@pytest.mark.parametrize("gathered_on", ["device", "host"])
def test_poisson_steps_replay_the_sampled_users_over_the_expected_count(
    monkeypatch, gathered_on
):
    # Three Poisson steps of B_u = 4 users (q = 1/3), k = 2 < some users'
    # counts, replayed from the sampled slots: per-user mean gradients,
    # clipped, summed, over B_u (not over the realised count of users).
    if gathered_on == "host":
        force_host_gathering(monkeypatch)
    recorded = RecordedUsers(monkeypatch)
    features, labels, users = user_data(seed=3)
    lr, clip_norm, k = 0.5, 0.4, 2
    model = make_model(3, optimizer=keras.optimizers.SGD(lr), seed=7,
                       clip_norm=clip_norm, examples_per_user=k)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Host gathering.
        model.fit(features, labels, users=users, batch_size=4, verbose=0)
    assert model._rows.on_device == (gathered_on == "device")
    assert steps_of(model) == 3
    kernel, bias = np.zeros((5, 3)), np.zeros(3)
    sizes = []
    for index, mask in recorded.used(3):
        real = mask.reshape(-1, k) > 0
        slots = [index.reshape(-1, k)[j][real[j]] for j in np.flatnonzero(real.any(1))]
        assert all(len(set(users[s])) == 1 for s in slots)  # One user a slot.
        sizes.append(len(slots))
        step = sum(
            clip(m, clip_norm)
            for m in user_means(kernel, bias, features, labels, slots)
        )
        kernel, bias = kernel - lr * step[:-1] / 4, bias - lr * step[-1] / 4
    assert any(size != 4 for size in sizes)
    np.testing.assert_allclose(ref.to_numpy(model.head.kernel), kernel,
                               rtol=1e-4, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(ref.to_numpy(model.head.bias), bias,
                               rtol=1e-4, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("batch_size", [None, 12], ids=["full_batch", "poisson"])
def test_the_noise_has_std_z_c_lr_over_the_expected_number_of_users(batch_size):
    # x = 0: the kernel's clipped sum is 0 and each step moves it by
    # −lr · N(0, (zC)²) / B_u, B_u the expected users (U = 16 for full
    # batch; round(16 / 12) = 1 Poisson step an epoch). Every user holds
    # k = 4 examples, so z·C·lr / B (B the expected examples) and
    # z·C·lr / (k B_u) are both 4 times smaller, far outside the bound.
    users = np.repeat(np.arange(16), 4)
    labels = np.random.default_rng(0).integers(0, 4, 64)
    z, clip_norm, lr = 1.3, 0.7, 0.5
    model = make_model(4, optimizer=keras.optimizers.SGD(lr), seed=5,
                       noise_multiplier=z, clip_norm=clip_norm)  # fmt: skip
    weights = ref.EpochWeights()
    model.fit(np.zeros((64, 8), "float32"), labels, users=users,
              batch_size=batch_size, epochs=10, verbose=0,
              callbacks=[weights])  # fmt: skip
    assert steps_of(model) == 10
    updates = np.stack(weights.kernel_updates())  # 10 steps × 32 draws.
    ref.assert_normal(updates, z * clip_norm * lr / (batch_size or 16))
    ref.assert_uncorrelated(list(updates))  # Fresh every step.


# ------------------------------------------------------------- privacy --


def test_the_statement_equals_dp_accounting_on_the_user_schedule():
    features, labels, users = user_data()
    z = 1.1
    model = make_model(3, noise_multiplier=z, clip_norm=0.5, delta=DELTA)
    model.fit(features, labels, users=users, batch_size=3, epochs=2, verbose=0)
    steps = 2 * round(12 / 3)
    assert steps_of(model) == steps
    assert model.schedule == privacy.Schedule.users(12, 3, examples_per_user=4)
    statement = model.privacy_statement()
    assert (statement.unit, statement.population, statement.steps) == (
        "user", 12, steps,
    )  # fmt: skip
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(3 / 12, dp_accounting.GaussianDpEvent(z)),
        steps,
    )
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-4,
    )
    expected = accountant.compose(event).get_epsilon(DELTA)
    assert statement.epsilon == pytest.approx(expected, rel=1e-3)
    summary = statement.summary()
    assert "user" in summary and "at most 4" in summary


def test_a_target_epsilon_is_calibrated_on_the_users_and_met():
    features, labels, users = user_data()
    model = make_model(3, target_epsilon=2.0, delta=DELTA, clip_norm=0.5)
    model.fit(features, labels, users=users, batch_size=3, epochs=2, verbose=0)
    epsilon = model.privacy_statement().epsilon
    assert 0.99 * 2.0 <= epsilon <= 2.0 * (1 + 1e-9)
    examples = privacy.epsilon(
        privacy.dp_sgd(model.step_noise_multiplier, 3, len(features)), 8, DELTA
    )
    assert examples < 0.9 * epsilon  # Accounted over U users, not N examples.
    with pytest.raises(ValueError, match="num_users"):
        model.fit(features, labels, users=users % 5, batch_size=3, verbose=0)


# -------------------------------------------------------- closed forms --


def weighted_ridge(features, labels, row_weights, num_classes, ridge):
    """(Xᵀ diag(w) X + λ I)⁻¹ Xᵀ diag(w) Y, in float64."""
    x = np.asarray(features, np.float64)
    y = ref.one_hot(labels, num_classes)
    weighted = (x * row_weights[:, None]).T
    return np.linalg.solve(weighted @ x + ridge * np.eye(x.shape[1]), weighted @ y)


def test_dp_ls_without_noise_is_ridge_least_squares_on_user_means():
    # k >= every count: weights 1 / n_u, λ = l2 · U over the 12 users.
    features, labels, users = user_data()
    model = make_model(3, "dp-ls", l2=0.05)
    model.fit(features, labels, users=users, verbose=0)
    counts = {u: np.sum(users == u) for u in np.unique(users)}
    weights = np.array([1.0 / counts[u] for u in users])
    expected = weighted_ridge(features, labels, weights, 3, 0.05 * 12)
    np.testing.assert_allclose(ref.to_numpy(model.head.kernel), expected,
                               rtol=1e-4, atol=1e-6)  # fmt: skip
    unweighted = ref.ridge_least_squares(features, labels, 3, 0.05)
    assert np.abs(unweighted - expected).max() > 1e-3


def test_dp_newton_without_noise_steps_on_the_users_mean_loss():
    features, labels, users = user_data(seed=4)
    model = make_model(3, "dp-newton", l2=0.1)
    model.fit(features, labels, users=users, verbose=0)
    counts = {u: np.sum(users == u) for u in np.unique(users)}
    w = np.array([1.0 / counts[u] for u in users])
    x = features.astype(np.float64)
    residual = ref.softmax(np.zeros((len(x), 3))) - ref.one_hot(labels, 3)
    gradient = (x * w[:, None]).T @ residual
    hessian = (x * (w * (1 / 3) * (2 / 3))[:, None]).T @ x  # p = 1/3 at W = 0.
    ridge = 0.1 * 12
    expected = -np.linalg.solve(hessian + ridge * np.eye(5), gradient)
    np.testing.assert_allclose(ref.to_numpy(model.head.kernel), expected,
                               rtol=1e-4, atol=1e-6)  # fmt: skip


def test_each_user_moves_every_closed_form_statistic_by_one_examples_bound():
    # A user of 6 identical rows at norm C_x: summed, they would move the
    # Gram matrix by 6 C_x²; as a mean over k = 4 of them, by C_x² at most.
    rng = np.random.default_rng(5)
    cx, k = 2.0, 4
    features = rng.normal(size=(20, 4))
    features[14:] = 5.0 * features[14]  # Clipped to norm C_x.
    assert np.linalg.norm(features[14]) > cx
    labels = rng.integers(0, 3, 20)
    labels[14:] = 0
    users = np.repeat(np.arange(6), [2, 3, 4, 1, 4, 6])
    kernel = rng.normal(size=(4, 3))
    bounds = [
        stats.GRAM_SENSITIVITY * cx**2,
        stats.CLASS_SUMS_SENSITIVITY * cx,
        stats.GRADIENT_SENSITIVITY * cx,
        stats.HESSIANS_SENSITIVITY * cx**2,
    ]

    def statistics(keep):
        w = user_weights(users[keep], k, np.random.default_rng(0))
        x, y = features[keep], labels[keep]
        gradient, hessians = stats.logistic_statistics(x, y, kernel, cx, True, w)
        return [stats.gram(x, cx, w), stats.class_sums(x, y, 3, cx, w),
                gradient, hessians]  # fmt: skip

    full = statistics(np.ones(20, bool))
    for user in range(6):
        less = statistics(users != user)
        for bound, a, b in zip(bounds, full, less, strict=True):
            assert np.sqrt(np.sum((a - b) ** 2)) <= bound * (1 + 1e-9)
    gram_move = np.sqrt(np.sum((full[0] - statistics(users != 5)[0]) ** 2))
    assert gram_move == pytest.approx(cx**2, rel=1e-9)  # The bound is reached.


def test_user_weights_average_at_most_k_examples_drawn_afresh():
    users = np.repeat([10, 20, 30], [5, 2, 1])
    draws = [user_weights(users, 2, np.random.default_rng(s)) for s in range(30)]
    for weights in draws:
        for u, expected in ((10, 2), (20, 2), (30, 1)):
            mine = weights[users == u]
            assert np.count_nonzero(mine) == expected
            assert mine.sum() == pytest.approx(1.0)
    chosen = {tuple(np.flatnonzero(w[:5])) for w in draws}
    assert len(chosen) > 3  # Fresh subsets of the user with 5 examples.


@pytest.mark.parametrize("method", ["dp-ls", "dp-newton", "dp-fc"])
def test_a_closed_form_step_costs_a_gaussian_over_the_users(method):
    features, labels, users = user_data()
    epochs = 1 if method == "dp-ls" else 3
    model = make_model(3, method, noise_multiplier=3.0, feature_clip_norm=2.0)
    model.fit(features, labels, users=users, epochs=epochs, verbose=0)
    statement = model.privacy_statement(DELTA)
    assert (statement.unit, statement.population) == ("user", 12)
    expected = privacy.epsilon(privacy.full_batch(3.0, 12), epochs, DELTA)
    assert statement.epsilon == pytest.approx(expected, rel=2e-3)
    assert "at most 4 examples" in statement.summary()


# -------------------------------------------------------------- errors --


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"unit": "user"}, "needs examples_per_user"),
        ({"examples_per_user": 4}, "unit='user'"),
        ({"unit": "person", "examples_per_user": 4}, "unit must be one of"),
        ({"unit": "user", "examples_per_user": 0}, "examples_per_user"),
        ({"unit": "user", "examples_per_user": 2.5}, "examples_per_user"),
        ({"unit": "user", "examples_per_user": True}, "examples_per_user"),
    ],
)
def test_bad_unit_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        LastLayerDPClassifier(3, noise_multiplier=1.0, **settings)


@pytest.mark.parametrize(
    ("unit", "settings", "fit_kwargs", "match"),
    [
        ("user", {}, {}, r"users=ids"),
        ("example", {}, {"users": "ok"}, "unit='user'"),
        ("user", {}, {"users": "short"}, "one user id per example"),
        ("user", {}, {"users": "2d"}, "1-D"),
        ("user", {}, {"users": "float"}, "integer or string ids"),
        ("user", {}, {"users": "ok", "batch_size": 13}, "users per step"),
        ("user", {"target_epsilon": 1.0, "delta": 0.1}, {"users": "ok"},
         "1/population = 1/12"),
        ("user", {"method": "dp-ls"}, {"users": "ok", "batch_size": 3},
         "batch_size=None"),
    ],
)  # fmt: skip
def test_bad_user_fits_are_refused_before_any_step(unit, settings, fit_kwargs, match):
    features, labels, users = user_data()
    kinds = {"ok": users, "short": users[:-1], "2d": users[:, None],
             "float": users + 0.5}  # fmt: skip
    if "users" in fit_kwargs:
        fit_kwargs = {**fit_kwargs, "users": kinds[fit_kwargs["users"]]}
    method = settings.pop("method", "dp-sgd")
    if unit == "example":
        model = LastLayerDPClassifier(3, noise_multiplier=1.0, seed=0)
    else:
        model = make_model(3, method, **settings)
    with pytest.raises(ValueError, match=match):
        model.fit(features, labels, verbose=0, **fit_kwargs)
    assert steps_of(model) == 0 and model.schedule is None


# -------------------------------------------------------------- saving --


def save_and_load(model, tmp_path):
    path = tmp_path / "classifier.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return keras.saving.load_model(path)


@pytest.mark.parametrize("method", ["dp-sgd", "dp-newton"])
def test_a_saved_user_level_classifier_keeps_its_unit_cap_and_count(method, tmp_path):
    features, labels, users = user_data()
    batch_size = 3 if method == "dp-sgd" else None
    model = make_model(3, method, noise_multiplier=2.0, seed=None,
                       examples_per_user=2, delta=DELTA)  # fmt: skip
    model.fit(features, labels, users=users, batch_size=batch_size, verbose=0)
    steps = steps_of(model)
    loaded = save_and_load(model, tmp_path)
    assert (loaded.unit, loaded.examples_per_user) == ("user", 2)
    assert loaded.schedule == model.schedule and steps_of(loaded) == steps
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    with pytest.raises(ValueError, match="num_users"):
        loaded.fit(features, labels, users=users % 5, batch_size=batch_size,
                   verbose=0)  # fmt: skip
    loaded.fit(features, labels, users=users, batch_size=batch_size, verbose=0)
    assert steps_of(loaded) == 2 * steps
    assert loaded.privacy_statement().epsilon == pytest.approx(
        privacy.epsilon(model.privacy_mechanism(), 2 * steps, DELTA), rel=1e-9
    )
    config = loaded.get_config()
    for unit, cap in (("example", None), ("user", 3)):
        with pytest.raises(ValueError, match="protects each"):
            LastLayerDPClassifier.from_config(
                {**config, "unit": unit, "examples_per_user": cap}
            )

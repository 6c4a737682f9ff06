"""FedEmbModel: whole rounds against NumPy, noise, heads, saving, errors.

Rounds are fed with `model.fit` (one round per `train_step`), either from
hand-built round dicts (`fedemb_reference.Rounds`) or from a tiny
`VirtualClients`. With the server optimizer SGD(1.0) and no momentum a
round moves the backbone by exactly the noisy mean update, so the tests
read the update off the weights.
"""

import warnings

import keras
import numpy as np
import pytest
from scipy import stats

from kdpemb import privacy
from kdpemb.callbacks import PrivacyBudget
from kdpemb.data import VirtualClients
from kdpemb.models import FedEmbModel, ReproducibleNoiseWarning, UnsupportedLayerError
from tests.models import fedemb_reference as ref

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.models.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.data.ReproducibleSamplingWarning"),
]

DELTA = 1e-3


def make_model(backbone, compile=True, **overrides):
    """A non-private (z = 0, no clipping) model; M = 2.5 of 10 clients."""
    settings = {
        "local_steps": 3,
        "client_optimizer": 0.2,
        "head_lr_scale": 5.0,
        "clip_norm": 1e9,
        "noise_multiplier": 0.0,
        "clients_per_round": 2.5,
        "num_users": 20,
        "users_per_client": 2,
        "seed": 0,
        **overrides,
    }
    model = FedEmbModel(backbone, **settings)
    if compile:
        model.compile(optimizer=keras.optimizers.SGD(1.0))
    return model


def fit_rounds(model, rounds, **kwargs):
    return model.fit(ref.Rounds(rounds), epochs=1, verbose=0, shuffle=False, **kwargs)


def weights_of(variable):
    return np.asarray(keras.ops.convert_to_numpy(variable), np.float64)


# ------------------------------------- no noise, no clipping = FedAvg --


@pytest.mark.parametrize(
    ("settings", "client_parallelism"),
    [
        ({}, 1),
        ({"momentum": 0.5, "nesterov": True, "reconstruction_steps": 1}, 1),
        ({"momentum": 0.9}, 3),
    ],
    ids=["sgd", "nesterov_reconstruction", "momentum_vectorised"],
)
def test_rounds_equal_hand_written_federated_averaging(settings, client_parallelism):
    # Two rounds of DP-FedEmb with z = 0 and a huge C: every client starts
    # from a zero head (none is carried between rounds), and the server
    # adds the sum of updates over M = 2.5, the expected count, not over
    # the 2 clients that took part.
    backbone = ref.linear_backbone(seed=1)
    momentum = settings.get("momentum", 0.0)
    client_optimizer = (
        keras.optimizers.SGD(
            0.2, momentum=momentum, nesterov=settings.get("nesterov", False)
        )
        if momentum
        else 0.2
    )
    model = make_model(
        backbone,
        client_optimizer=client_optimizer,
        reconstruction_steps=settings.get("reconstruction_steps", 0),
        client_parallelism=client_parallelism,
    )
    rounds = [ref.make_round(seed, classes=(3, 2), steps=3) for seed in (10, 11)]
    kernel = ref.kernel_of(backbone)
    fit_rounds(model, rounds)

    expected = kernel.astype(np.float64)
    for data in rounds:
        total = 0.0
        for client in ref.client_rows(data):
            head = np.zeros((3, client["num_local_classes"]))
            update, _ = ref.client_update(
                expected, head, client, lr=0.2, head_lr_scale=5.0, **settings
            )
            total = total + update
        expected = expected + total / 2.5
    assert np.abs(expected - kernel).max() > 1e-2
    np.testing.assert_allclose(ref.kernel_of(backbone), expected, rtol=2e-4, atol=1e-6)
    assert int(weights_of(model.private_steps)) == 2


def test_partial_aggregation_shares_only_the_backbone():
    backbone = ref.linear_backbone()
    model = make_model(backbone, compile=False)
    assert model.head is None
    shared = {id(v) for v in model.trainable_variables}
    assert shared == {id(v) for v in backbone.trainable_variables}


def test_dp_fedavg_aggregates_a_global_head_trained_on_global_labels():
    num_classes = 6
    backbone = ref.linear_backbone(seed=2)
    model = make_model(backbone, aggregation="full", num_classes=num_classes)
    assert {id(v) for v in model.trainable_variables} == {
        id(v) for v in [*backbone.trainable_variables, model.head]
    }
    rounds = [
        ref.make_round(seed, classes=(3, 2), steps=3, num_classes=num_classes)
        for seed in (20, 21)
    ]
    kernel = ref.kernel_of(backbone)
    fit_rounds(model, rounds)

    w, h = kernel.astype(np.float64), np.zeros((3, num_classes))
    for data in rounds:
        dw, dh = 0.0, 0.0
        for client in ref.client_rows(data, labels="global_labels"):
            client["num_local_classes"] = num_classes
            uw, uh = ref.client_update(w, h, client, lr=0.2, head_lr_scale=5.0)
            dw, dh = dw + uw, dh + uh
        # The second round starts from the aggregated head of the first.
        w, h = w + dw / 2.5, h + dh / 2.5
    assert np.abs(h).max() > 1e-2
    np.testing.assert_allclose(weights_of(model.head), h, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(ref.kernel_of(backbone), w, rtol=2e-4, atol=1e-6)


def test_reconstruction_steps_must_leave_a_step_that_trains_the_backbone():
    for steps in (3, 4):
        with pytest.raises(ValueError, match="reconstruction_steps"):
            make_model(ref.linear_backbone(), compile=False, reconstruction_steps=steps)


# ------------------------------------------------------------- heads --


def test_random_heads_are_fresh_for_every_client_and_round():
    # With W = 0 the embeddings are 0, so after one local step a client with
    # two classes moves W by -lr · a (H[:, 0] - H[:, 1])ᵀ, a = Xᵀ G[:, 0]
    # known from its data: the sum of a round's updates reveals every
    # client's starting head difference d = H[:, 0] - H[:, 1] ~ N(0, 2/D).
    dim, lr, clients = 3, 0.1, 4
    backbone = ref.linear_backbone(dim, kernel=np.zeros((ref.PIXELS, dim)))
    model = make_model(
        backbone,
        local_steps=1,
        client_optimizer=lr,
        head_init="random",
        clients_per_round=clients,
    )
    data = ref.make_round(30, classes=(2,) * clients, rows=clients, steps=1, batch=4)
    rows = ref.client_rows(data)
    columns = []
    for client in rows:
        labels, mask = client["labels"][0], client["example_mask"][0]
        g = (0.5 - (labels == 0)) * mask / mask.sum()
        columns.append(client["images"][0].reshape(len(labels), -1).T @ g)
    design = np.stack(columns, axis=1)  # [pixels, clients]
    differences = []
    for _ in range(2):
        backbone.set_weights([np.zeros((ref.PIXELS, dim), "float32")])
        fit_rounds(model, [data])
        total = ref.kernel_of(backbone) * clients  # Sum of the updates.
        d, *_ = np.linalg.lstsq(-lr * design, total, rcond=None)
        np.testing.assert_allclose(-lr * design @ d, total, atol=1e-6)
        differences.append(d)
    first, second = differences
    for i in range(clients):
        for j in range(i):
            assert np.abs(first[i] - first[j]).max() > 1e-3  # Per client.
        assert np.abs(first[i] - second[i]).max() > 1e-3  # Per round.
    draws = np.concatenate([first.ravel(), second.ravel()])
    chi2 = np.sum(draws**2) / (2 / dim)
    p = stats.chi2.cdf(chi2, draws.size)
    assert 1e-4 < p < 1 - 1e-4  # N(0, 1/D) heads: d has variance 2/D.


# ------------------------------------------------------------- noise --


def test_noise_has_std_z_c_over_m_once_per_round_and_fresh_every_round():
    # One local step from a zero head leaves the backbone unchanged, so the
    # round's change is the noise alone: N(0, (zC)²) / M, added once (not
    # per client, 3 of them) and divided by M = 4 (not by the 3 present).
    z, clip_norm, m = 1.5, 0.4, 4
    sigma = z * clip_norm / m
    backbone = keras.Sequential(
        [
            keras.Input(ref.IMAGE_SHAPE),
            keras.layers.Flatten(),
            keras.layers.Dense(256, use_bias=False),
        ]
    )
    model = make_model(
        backbone,
        local_steps=1,
        noise_multiplier=z,
        clip_norm=clip_norm,
        clients_per_round=m,
        seed=3,
    )
    data = ref.make_round(40, classes=(2, 3, 2), rows=4, steps=1)
    start = ref.kernel_of(backbone).ravel().astype(np.float64)
    fit_rounds(model, [data])
    after_one = ref.kernel_of(backbone).ravel().astype(np.float64)
    fit_rounds(model, [data, data])  # Two rounds in one fit.
    after_three = ref.kernel_of(backbone).ravel().astype(np.float64)
    first, next_two = after_one - start, after_three - after_one
    n = first.size

    def standardised_std(draws, scale):
        return (np.std(draws) / scale - 1) * np.sqrt(2 * n)

    assert abs(standardised_std(first, sigma)) < 5
    assert stats.kstest(first, "norm", args=(0.0, sigma)).pvalue > 1e-3
    assert abs(np.mean(first)) < 5 * sigma / np.sqrt(n)
    # Noise per client (std √3 σ) or over the realised count (4/3 σ) fails.
    for wrong in (np.sqrt(3) * sigma, 4 / 3 * sigma):
        assert stats.kstest(first, "norm", args=(0.0, wrong)).pvalue < 1e-6
    # Fresh draws: two independent rounds sum to std √2 σ (a reused draw
    # gives 2σ) and are uncorrelated with the first fit's.
    assert abs(standardised_std(next_two, np.sqrt(2) * sigma)) < 5
    assert abs(np.corrcoef(first, next_two)[0, 1]) < 5 / np.sqrt(n)


# ----------------------------------------------- non-finite, BatchNorm --


def test_a_non_finite_client_is_zeroed_counted_and_logged():
    backbone = ref.linear_backbone(seed=4)
    model = make_model(backbone, local_steps=2, clip_norm=1.0)
    start = backbone.get_weights()
    data = ref.make_round(50, classes=(3, 2, 2), rows=3, steps=2)
    poisoned = {key: value.copy() for key, value in data.items()}
    poisoned["images"][1, 0, 0] = np.inf
    history = fit_rounds(model, [poisoned])
    after_poisoned = ref.kernel_of(backbone)
    assert np.isfinite(after_poisoned).all()
    assert history.history["nonfinite_updates"] == [1]

    # The same round without that client (the last client moves up a row).
    without = {key: value[[0, 2, 1]].copy() for key, value in data.items()}
    without["client_mask"][2] = False
    backbone.set_weights(start)
    history = fit_rounds(model, [without])
    assert history.history["nonfinite_updates"] == [0]
    np.testing.assert_allclose(
        after_poisoned, ref.kernel_of(backbone), rtol=1e-5, atol=1e-7
    )
    assert np.abs(after_poisoned - start[0]).max() > 1e-3


def test_trainable_batch_norm_is_refused():
    backbone = keras.Sequential(
        [
            keras.Input(ref.IMAGE_SHAPE),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(name="bn"),
        ]
    )
    with pytest.raises(UnsupportedLayerError, match="GroupNormalization"):
        make_model(backbone, compile=False)


def test_frozen_batch_norm_is_accepted_and_its_statistics_never_change():
    norm = keras.layers.BatchNormalization(name="frozen_bn")
    backbone = keras.Sequential(
        [
            keras.Input(ref.IMAGE_SHAPE),
            keras.layers.Flatten(),
            keras.layers.Dense(3, use_bias=False),
            norm,
        ]
    )
    # Statistics from public data, far from what private batches give.
    norm.set_weights(
        [
            np.array(v, "float32")
            for v in ([1.5, 0.5, 2], [0.1, -0.2, 0.3], [0.4, -1, 2], [3, 0.5, 1.5])
        ]
    )
    norm.trainable = False
    before = [np.array(w) for w in norm.get_weights()]
    kernel = ref.kernel_of(backbone)
    model = make_model(backbone, local_steps=2)
    fit_rounds(model, [ref.make_round(60, steps=2), ref.make_round(61, steps=2)])
    for got, want in zip(norm.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.abs(ref.kernel_of(backbone) - kernel).max() > 1e-3


# ---------------------------------------------------- saving, resuming --


def tiny_clients(users_per_client=2, **overrides):
    """8 users with 3 examples each of 4 identities, 4x4x1 images."""
    rng = np.random.default_rng(0)
    user_ids = np.repeat(np.arange(8), 3)
    images = rng.normal(size=(user_ids.size, *ref.IMAGE_SHAPE)).astype("float32")
    labels = rng.integers(0, 4, size=user_ids.size)
    settings = {
        "clients_per_round": 1,
        "users_per_client": users_per_client,
        "local_steps": 2,
        "batch_size": 2,
        "num_classes": 4,
        "seed": 0,
        **overrides,
    }
    return VirtualClients(images, labels, user_ids, **settings)


def private_model(clients, **overrides):
    settings = {
        "local_steps": clients.local_steps,
        "client_optimizer": 0.1,
        "clip_norm": 0.5,
        # Much noise and q = 1/4 keep the PLD accounting fast.
        "noise_multiplier": 4.0,
        "clients_per_round": clients.clients_per_round,
        "users_per_client": clients.users_per_client,
        "seed": 0,
        **overrides,
    }
    model = FedEmbModel(ref.linear_backbone(), **settings)
    model.compile(optimizer=keras.optimizers.SGD(1.0, momentum=0.9))
    return model


def test_a_saved_model_keeps_counting_and_draws_fresh_noise(tmp_path):
    clients = tiny_clients()
    model = private_model(clients)
    model.fit(clients, epochs=1, verbose=0)
    steps = clients.rounds_per_epoch
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)

    assert privacy.read_private_steps(loaded) == steps
    assert loaded.privacy_statement(DELTA) == model.privacy_statement(DELTA)
    np.testing.assert_array_equal(
        ref.kernel_of(loaded.backbone), ref.kernel_of(model.backbone)
    )
    # The fixed test seed is not carried over: the noise is drawn afresh.
    assert model.seed == 0
    assert loaded.seed is None and loaded.get_config()["seed"] is None
    fixed = keras.random.SeedGenerator(model.seed)  # What seed=0 would start from.
    assert not np.array_equal(
        keras.ops.convert_to_numpy(loaded.noise_seed.state),
        keras.ops.convert_to_numpy(fixed.state),
    )

    if getattr(loaded, "optimizer", None) is None:
        loaded.compile(optimizer=keras.optimizers.SGD(1.0, momentum=0.9))
    loaded.fit(clients, epochs=1, verbose=0)
    assert privacy.read_private_steps(loaded) == 2 * steps
    statement = loaded.privacy_statement(DELTA)
    assert statement.steps == 2 * steps
    assert statement.epsilon == pytest.approx(
        privacy.epsilon(model.privacy_mechanism(), 2 * steps, DELTA), rel=1e-9
    )


def test_a_saved_model_keeps_its_server_optimizer(tmp_path):
    # The docstring: "model.save keeps the backbone, the head, the server
    # optimizer and private_steps". The server momentum must survive.
    clients = tiny_clients()
    model = private_model(clients)
    model.fit(clients, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)
    optimizer = getattr(loaded, "optimizer", None)
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert optimizer.momentum == pytest.approx(0.9)
    saved = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    restored = [keras.ops.convert_to_numpy(v) for v in optimizer.variables]
    assert len(restored) == len(saved)
    for got, want in zip(restored, saved, strict=True):
        np.testing.assert_allclose(got, want)


# ------------------------------------------------------------ privacy --


def test_privacy_budget_reports_the_users_epsilon():
    clients = tiny_clients()
    model = private_model(clients)
    budget = PrivacyBudget(DELTA, verbose=0)
    history = model.fit(clients, epochs=2, verbose=0, callbacks=[budget])
    steps = 2 * clients.rounds_per_epoch
    assert privacy.read_private_steps(model) == steps
    mechanism = model.privacy_mechanism()
    assert mechanism == clients.privacy_mechanism(4.0, clip_norm=0.5)
    expected = privacy.epsilon(mechanism, steps, DELTA)
    assert budget.epsilon == pytest.approx(expected, rel=1e-9)
    assert history.history["epsilon"][-1] == pytest.approx(expected, rel=1e-9)
    statement = budget.statement
    assert statement.unit == "user"
    assert statement.neighboring_relation == "replace_one"
    assert statement.steps == steps and statement.population == clients.num_users


def test_single_user_clients_are_add_or_remove_one():
    model = make_model(
        ref.linear_backbone(), compile=False, users_per_client=1, num_users=50
    )
    statement = model.privacy_statement(DELTA)
    assert statement.unit == "user"
    assert statement.neighboring_relation == "add_or_remove_one"


# ------------------------------------------------------------- errors --


@pytest.mark.parametrize(
    ("field", "override"),
    [
        ("clients_per_round", {"clients_per_round": 2}),
        ("users_per_client", {"users_per_client": 4}),
        ("local_steps", {"local_steps": 3}),
        ("num_users", {"num_users": 9}),
    ],
)
def test_settings_that_differ_from_the_virtual_clients_are_refused(field, override):
    clients = tiny_clients()
    model = private_model(clients, **override)
    with pytest.raises(ValueError, match=field):
        model.fit(clients, epochs=1, verbose=0)
    assert privacy.read_private_steps(model) == 0


def test_single_identity_users_alone_in_their_clients_are_refused():
    user_ids = np.repeat(np.arange(6), 2)
    images = np.zeros((12, *ref.IMAGE_SHAPE), "float32")
    clients = VirtualClients(
        images, user_ids, user_ids, clients_per_round=1, local_steps=2, seed=0
    )
    model = private_model(clients, users_per_client=1)
    with pytest.raises(ValueError, match="users_per_client"):
        model.fit(clients, epochs=1, verbose=0)


def test_bad_model_settings_are_refused():
    with pytest.raises(ValueError, match="SGD"):
        make_model(
            ref.linear_backbone(),
            compile=False,
            client_optimizer=keras.optimizers.Adam(0.1),
        )
    unbuilt = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        make_model(unbuilt, compile=False)
    with pytest.raises(ValueError, match="num_classes"):
        make_model(ref.linear_backbone(), compile=False, aggregation="full")


def test_a_fixed_seed_warns_and_none_does_not():
    with pytest.warns(ReproducibleNoiseWarning, match="seed"):
        make_model(ref.linear_backbone(), compile=False, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReproducibleNoiseWarning)
        make_model(ref.linear_backbone(), compile=False, seed=None)


# ------------------------------------------ settings that would mislead ε --


def test_settings_are_fixed_after_construction():
    # The traced round bakes the settings in while the accountant reads
    # them: a later change would make ε describe another training.
    clients = tiny_clients()
    model = private_model(clients)
    model.fit(clients, epochs=1, verbose=0)
    for name, value in [("noise_multiplier", 50.0), ("clip_norm", 0.1)]:
        with pytest.raises(AttributeError, match=name):
            setattr(model, name, value)
    assert model.noise_multiplier == 4.0 and model.clip_norm == 0.5


def test_a_tf_dataset_of_the_rounds_is_checked_like_the_rounds():
    clients = tiny_clients()
    model = private_model(clients, clients_per_round=2)
    if keras.backend.backend() == "tensorflow":
        with pytest.raises(ValueError, match="clients_per_round"):
            model.fit(clients.to_tf_dataset(), epochs=1, verbose=0)
    # A refused fit adopts nothing: another source is still refused.
    with pytest.raises(ValueError, match="num_users"):
        model.fit(ref.Rounds([]), epochs=1, verbose=0)
    assert privacy.read_private_steps(model) == 0


def test_validation_data_is_refused_before_any_round():
    clients = tiny_clients()
    model = private_model(clients)
    with pytest.raises(ValueError, match="validation_data"):
        model.fit(clients, epochs=1, verbose=0, validation_data=clients)
    assert privacy.read_private_steps(model) == 0


@pytest.mark.parametrize(
    "optimizer",
    [
        keras.optimizers.SGD(0.1, weight_decay=0.5),
        keras.optimizers.SGD(0.1, clipnorm=1.0),
        keras.optimizers.SGD(0.1, use_ema=True),
    ],
    ids=["weight_decay", "clipnorm", "ema"],
)
def test_client_sgd_options_that_would_be_ignored_are_refused(optimizer):
    with pytest.raises(ValueError, match="does not implement"):
        make_model(ref.linear_backbone(), compile=False, client_optimizer=optimizer)


def test_fractional_reconstruction_steps_are_refused():
    with pytest.raises(ValueError, match="reconstruction_steps"):
        make_model(ref.linear_backbone(), compile=False, reconstruction_steps=1.5)


def test_float16_loss_scaling_is_refused():
    model = make_model(ref.linear_backbone(), compile=False)
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
        )
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)

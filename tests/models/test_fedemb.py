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
from kdpemb.errors import DataDependentScheduleWarning
from kdpemb.models import FedEmbModel, ReproducibleNoiseWarning, UnsupportedLayerError
from kdpemb.privacy import Schedule, protocol
from tests.models import fedemb_reference as ref

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]

DELTA = 1e-3


SCHEDULE_ARGS = ("num_users", "clients_per_round", "users_per_client", "local_steps")


def make_schedule(num_users=20, clients_per_round=2.5, users_per_client=2, **args):
    """User-level rounds with P = ceil(N / k) given as a public count."""
    num_clients = -(-num_users // users_per_client) if users_per_client > 1 else None
    return Schedule.virtual_clients(
        num_users,
        clients_per_round,
        users_per_client=users_per_client,
        num_clients=num_clients,
        **args,
    )


def make_model(backbone, compile=True, **overrides):
    """A non-private (z = 0, no clipping) model; M = 2.5 of 10 clients."""
    schedule_args = {"local_steps": 3}
    schedule_args.update({k: overrides.pop(k) for k in SCHEDULE_ARGS if k in overrides})
    settings = {
        "client_optimizer": 0.2,
        "head_lr_scale": 5.0,
        "clip_norm": 1e9,
        "noise_multiplier": 0.0,
        "schedule": make_schedule(**schedule_args),
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


def test_a_server_learning_rate_schedule_scales_each_rounds_update():
    # Any Keras LearningRateSchedule on the server optimizer is indexed by
    # rounds (the server optimizer takes one step a round): here 1.0 in
    # the first round, then 0.25, as warm-up or cosine decay would be.
    backbone = ref.linear_backbone(seed=1)
    model = make_model(backbone, compile=False)
    rates = keras.optimizers.schedules.PiecewiseConstantDecay([0], [1.0, 0.25])
    model.compile(optimizer=keras.optimizers.SGD(rates))
    rounds = [ref.make_round(seed, classes=(3, 2), steps=3) for seed in (10, 11)]
    kernel = ref.kernel_of(backbone)
    fit_rounds(model, rounds)

    expected = kernel.astype(np.float64)
    for rate, data in zip((1.0, 0.25), rounds, strict=True):
        total = 0.0
        for client in ref.client_rows(data):
            head = np.zeros((3, client["num_local_classes"]))
            update, _ = ref.client_update(
                expected, head, client, lr=0.2, head_lr_scale=5.0
            )
            total = total + update
        expected = expected + rate * total / 2.5
    np.testing.assert_allclose(ref.kernel_of(backbone), expected, rtol=2e-4, atol=1e-6)
    assert int(weights_of(model.optimizer.iterations)) == 2


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


def test_class_mean_heads_start_each_client_nearer_its_own_data():
    # head_init="class_means" imprints each local head from the client's
    # examples: the local loss of the same round is then lower than from
    # random heads (cosine heads, no local step: the loss at the start).
    data = ref.make_round(31, classes=(3, 3), rows=2, steps=2, batch=4)
    losses = {}
    for init in ("random", "class_means"):
        model = make_model(
            ref.linear_backbone(4, seed=2),
            local_steps=2,
            head="cosine",
            head_scale=10.0,
            head_init=init,
            client_optimizer=1e-9,  # The loss is the starting heads'.
            log_local_loss=True,
            clients_per_round=2,
        )
        losses[init] = fit_rounds(model, [data]).history["local_loss"][0]
    assert losses["class_means"] < 0.5 * losses["random"], losses


def test_class_mean_heads_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="global head"):
        make_model(
            ref.linear_backbone(),
            compile=False,
            aggregation="full",
            num_classes=6,
            head_init="class_means",
        )
    with pytest.raises(ValueError, match="'class_means'"):
        make_model(
            ref.linear_backbone(), compile=False, head="cosine", head_init="zeros"
        )


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


def poisoned_round(value=np.inf):
    """A round of three clients whose second one holds a `value` pixel."""
    data = ref.make_round(50, classes=(3, 2, 2), rows=3, steps=2)
    poisoned = {key: value.copy() for key, value in data.items()}
    poisoned["images"][1, 0, 0, 0, 0, 0] = value
    return data, poisoned


@pytest.mark.parametrize("pixel", [np.inf, 1e30], ids=["inf", "1e30"])
def test_by_default_a_diverging_client_leaves_no_trace_in_the_logs(pixel):
    # Whether one user's data makes their client diverge is private: with
    # the defaults the logs hold only the step count (and ε, from the
    # callback), the same whether the diverging user took part or not.
    rounds = dict(zip(("clean", "poisoned"), poisoned_round(pixel), strict=True))
    logs = {}
    for name, data in rounds.items():
        model = make_model(
            ref.linear_backbone(seed=4),
            local_steps=2,
            clip_norm=1.0,
            noise_multiplier=1.0,
        )
        budget = PrivacyBudget(DELTA, verbose=0)
        history = fit_rounds(model, [data], callbacks=[budget])
        assert np.isfinite(ref.kernel_of(model.backbone)).all()
        logs[name] = history.history
    for history in logs.values():
        assert set(history) == {"private_steps", "epsilon"}
    assert logs["clean"] == logs["poisoned"]
    # The client did diverge: the opt-in log counts it.
    model = make_model(
        ref.linear_backbone(seed=4),
        local_steps=2,
        clip_norm=1.0,
        log_nonfinite_updates=True,
    )
    history = fit_rounds(model, [rounds["poisoned"]])
    assert history.history["nonfinite_updates"] == [1]


def test_a_non_finite_client_is_zeroed_and_counted_when_asked():
    backbone = ref.linear_backbone(seed=4)
    model = make_model(
        backbone, local_steps=2, clip_norm=1.0, log_nonfinite_updates=True
    )
    start = backbone.get_weights()
    data, poisoned = poisoned_round()
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
    """8 users with 3 examples each of 4 identities, 4x4x1 images; P is
    given as a public count (ceil(8 / k))."""
    rng = np.random.default_rng(0)
    user_ids = np.repeat(np.arange(8), 3)
    images = rng.normal(size=(user_ids.size, *ref.IMAGE_SHAPE)).astype("float32")
    labels = rng.integers(0, 4, size=user_ids.size)
    settings = {
        "clients_per_round": 1,
        "users_per_client": users_per_client,
        "num_clients": -(-8 // users_per_client) if users_per_client > 1 else None,
        "local_steps": 2,
        "batch_size": 2,
        "num_classes": 4,
        "seed": 0,
        **overrides,
    }
    return VirtualClients(images, labels, user_ids, **settings)


def private_model(**overrides):
    """A private model that takes its schedule from its first fit."""
    settings = {
        "client_optimizer": 0.1,
        "clip_norm": 0.5,
        # Much noise and q = 1/4 keep the PLD accounting fast.
        "noise_multiplier": 4.0,
        "seed": 0,
        **overrides,
    }
    model = FedEmbModel(ref.linear_backbone(), **settings)
    model.compile(optimizer=keras.optimizers.SGD(1.0, momentum=0.9))
    return model


def test_a_saved_model_keeps_counting_and_draws_fresh_noise(tmp_path):
    clients = tiny_clients()
    model = private_model(delta=DELTA)
    model.fit(clients, epochs=1, verbose=0)
    steps = clients.rounds_per_epoch
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)

    assert protocol.read_private_steps(loaded) == steps
    # The schedule taken from the rounds, and δ, are saved with the model.
    assert loaded.schedule == clients.schedule and loaded.delta == DELTA
    assert loaded.privacy_statement() == model.privacy_statement(DELTA)
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
    assert protocol.read_private_steps(loaded) == 2 * steps
    statement = loaded.privacy_statement(DELTA)
    assert statement.steps == 2 * steps
    assert statement.epsilon == pytest.approx(
        privacy.epsilon(model.privacy_mechanism(), 2 * steps, DELTA), rel=1e-9
    )


def test_a_saved_model_keeps_its_server_optimizer(tmp_path):
    # The docstring: "model.save keeps the backbone, the head, the server
    # optimizer and private_steps". The server momentum must survive.
    clients = tiny_clients()
    model = private_model()
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
    model = private_model()
    budget = PrivacyBudget(DELTA, verbose=0)
    history = model.fit(clients, epochs=2, verbose=0, callbacks=[budget])
    steps = 2 * clients.rounds_per_epoch
    assert protocol.read_private_steps(model) == steps
    mechanism = model.privacy_mechanism()
    assert mechanism == clients.schedule.privacy_mechanism(4.0, clip_norm=0.5)
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
    assert model.schedule.pool_is_public
    statement = model.privacy_statement(DELTA)
    assert statement.unit == "user"
    assert statement.neighboring_relation == "add_or_remove_one"


# ------------------------------------------------------------- errors --


@pytest.mark.parametrize(
    ("field", "override"),
    [
        ("sample_size", {"clients_per_round": 2}),
        ("users_per_client", {"users_per_client": 4}),
        ("local_steps", {"local_steps": 3}),
        ("population", {"num_users": 9}),
    ],
)
def test_a_given_schedule_that_differs_from_the_rounds_is_refused(field, override):
    clients = tiny_clients()
    settings = {
        "num_users": 8,
        "clients_per_round": 1,
        "users_per_client": 2,
        "local_steps": 2,
        **override,
    }
    model = private_model(schedule=make_schedule(**settings))
    with pytest.raises(ValueError, match=f"{field}: model"):
        model.fit(clients, epochs=1, verbose=0)
    assert protocol.read_private_steps(model) == 0


def test_the_schedule_is_taken_once_from_the_first_rounds():
    clients = tiny_clients()
    model = private_model()
    assert model.schedule is None
    with pytest.raises(ValueError, match=r"schedule=clients\.schedule"):
        model.privacy_mechanism()
    model.fit(clients, epochs=1, verbose=0)
    assert model.schedule == clients.schedule
    assert model.privacy_mechanism() == clients.schedule.privacy_mechanism(4.0, 0.5)
    # Rounds of another schedule are refused, naming both; nothing changes.
    other = tiny_clients(clients_per_round=2)
    with pytest.raises(ValueError, match=r"sample_size: model 1\.0, rounds 2") as error:
        model.fit(other, epochs=1, verbose=0)
    assert str(clients.schedule) in str(error.value)
    assert str(other.schedule) in str(error.value)
    assert model.schedule == clients.schedule
    assert protocol.read_private_steps(model) == clients.rounds_per_epoch
    with pytest.raises(AttributeError, match="set once"):
        model.schedule = other.schedule


def test_checks_that_need_the_schedule_run_at_the_first_fit_before_a_round():
    clients = tiny_clients(local_steps=2)
    model = private_model(reconstruction_steps=2)  # Fine until S is known.
    with pytest.raises(ValueError, match="reconstruction_steps=2"):
        model.fit(clients, epochs=1, verbose=0)
    assert model.schedule is None and protocol.read_private_steps(model) == 0
    with pytest.raises(ValueError, match="reconstruction_steps=2"):
        private_model(reconstruction_steps=2, schedule=clients.schedule)


def test_a_fit_on_a_dataset_of_rounds_needs_the_schedule_given():
    clients = tiny_clients()
    model = private_model()
    derived = clients.to_tf_dataset().map(lambda round_: round_)
    for source in (derived, ref.Rounds([])):
        with pytest.raises(ValueError, match=r"FedEmbModel\(\.\.\., schedule="):
            model.fit(source, epochs=1, verbose=0)
    assert model.schedule is None and protocol.read_private_steps(model) == 0
    # A dataset of rounds with another number of local steps is refused.
    wrong = private_model(schedule=make_schedule(8, 1, local_steps=3))
    with pytest.raises(ValueError, match="local_steps=3"):
        wrong.fit(derived, epochs=1, verbose=0)
    assert protocol.read_private_steps(wrong) == 0

    given = private_model(schedule=clients.schedule)
    given.fit(derived, epochs=1, verbose=0, shuffle=False)
    assert protocol.read_private_steps(given) == clients.rounds_per_epoch


def test_the_tf_dataset_of_the_rounds_is_checked_like_the_rounds():
    # to_tf_dataset() remembers its clients: the model takes or checks
    # their schedule as for the VirtualClients itself (review finding: a
    # model of M = 1 accepted rounds of M = 6 and reported a sixth of ε).
    clients = tiny_clients()
    other = tiny_clients(clients_per_round=2)
    assert other.schedule != clients.schedule
    mismatched = private_model(schedule=other.schedule)
    with pytest.raises(ValueError, match="another schedule"):
        mismatched.fit(clients.to_tf_dataset(), epochs=1, verbose=0)
    assert protocol.read_private_steps(mismatched) == 0
    adopting = private_model()
    adopting.fit(clients.to_tf_dataset(), epochs=1, verbose=0, shuffle=False)
    assert adopting.schedule == clients.schedule


def test_weights_with_steps_cannot_adopt_a_schedule(tmp_path):
    # load_weights restores private_steps, not the schedule of those steps:
    # adopting the next data's schedule would account them wrongly.
    clients = tiny_clients()
    model = private_model()
    model.fit(clients, epochs=1, verbose=0)
    path = str(tmp_path / "fedemb.weights.h5")
    model.save_weights(path)
    fresh = private_model()
    fresh.load_weights(path)
    assert protocol.read_private_steps(fresh) == clients.rounds_per_epoch
    with pytest.raises(ValueError, match="no schedule"):
        fresh.fit(tiny_clients(clients_per_round=2), epochs=1, verbose=0)
    assert fresh.schedule is None


def test_delta_is_given_once_to_the_model():
    model = make_model(ref.linear_backbone(), compile=False, delta=DELTA)
    assert model.delta == DELTA
    assert model.privacy_statement() == model.privacy_statement(DELTA)
    assert model.privacy_statement().delta == DELTA
    assert model.privacy_statement(DELTA / 10).delta == DELTA / 10
    without = make_model(ref.linear_backbone(), compile=False)
    with pytest.raises(ValueError, match=r"FedEmbModel\(\.\.\., delta="):
        without.privacy_statement()
    # δ must be below 1 / users (20 here), checked once the users are known.
    with pytest.raises(ValueError, match="1/population"):
        make_model(ref.linear_backbone(), compile=False, delta=0.06)


def test_a_user_count_derived_p_warns_at_fit_and_a_public_p_does_not():
    derived = tiny_clients(num_clients=None)
    assert not derived.schedule.pool_is_public
    model = private_model()
    with pytest.warns(DataDependentScheduleWarning, match="num_clients"):
        model.fit(derived, epochs=1, verbose=0)
    for clients in (tiny_clients(), tiny_clients(users_per_client=1)):
        assert clients.schedule.pool_is_public
        with warnings.catch_warnings():
            warnings.simplefilter("error", DataDependentScheduleWarning)
            private_model().fit(clients, epochs=1, verbose=0)


def test_single_identity_users_alone_in_their_clients_are_refused():
    user_ids = np.repeat(np.arange(6), 2)
    images = np.zeros((12, *ref.IMAGE_SHAPE), "float32")
    clients = VirtualClients(
        images, user_ids, user_ids, clients_per_round=1, local_steps=2, seed=0
    )
    model = private_model()
    with pytest.raises(ValueError, match="users_per_client"):
        model.fit(clients, epochs=1, verbose=0)
    assert model.schedule is None  # A refused fit adopts nothing.


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
    model = private_model()
    model.fit(clients, epochs=1, verbose=0)
    for name, value in [
        ("noise_multiplier", 50.0),
        ("clip_norm", 0.1),
        ("delta", 1e-9),
        ("log_nonfinite_updates", True),
    ]:
        with pytest.raises(AttributeError, match=name):
            setattr(model, name, value)
    assert model.noise_multiplier == 4.0 and model.clip_norm == 0.5


def test_validation_data_is_refused_before_any_round():
    clients = tiny_clients()
    model = private_model()
    with pytest.raises(ValueError, match="validation_data"):
        model.fit(clients, epochs=1, verbose=0, validation_data=clients)
    assert protocol.read_private_steps(model) == 0


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


def conv_backbone(side):
    """A backbone built for side x side x 1 images that runs on any size."""
    return keras.Sequential(
        [
            keras.Input((side, side, 1)),
            keras.layers.Conv2D(3, 3),
            keras.layers.GlobalAveragePooling2D(),
        ]
    )


@pytest.mark.parametrize("source", ["clients", "tf_dataset", "derived", "rounds"])
def test_images_the_backbone_was_not_built_for_are_refused_before_any_round(source):
    # Review finding: a backbone built for 24x24 trained on 16x16 rounds
    # without a word (extract refuses the same mismatch).
    clients = tiny_clients()  # 4x4x1 images.
    given = None if source in ("clients", "tf_dataset") else clients.schedule
    model = FedEmbModel(
        conv_backbone(6), client_optimizer=0.1, clip_norm=0.5,
        noise_multiplier=4.0, seed=0, schedule=given,
    )  # fmt: skip
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    x = {
        "clients": lambda: clients,
        "tf_dataset": clients.to_tf_dataset,
        "derived": lambda: clients.to_tf_dataset().map(lambda round_: round_),
        "rounds": lambda: ref.Rounds([ref.make_round(0, steps=2)]),
    }[source]()
    pattern = r"backbone takes images of shape \(6, 6, 1\).*of shape \(4, 4, 1\)"
    with pytest.raises(ValueError, match=pattern):
        model.fit(x, epochs=1, verbose=0, shuffle=False)
    assert model.schedule == given  # Nothing adopted.
    if source != "rounds":
        # Refused before Keras starts (a PyDataset of rounds tells its shape
        # only when its first round is traced; there, under JAX, Keras has
        # already detached the variables, and a failed first step leaves
        # them detached).
        assert protocol.read_private_steps(model) == 0
    # None dimensions match any size.
    fine = FedEmbModel(
        keras.Sequential([keras.Input((None, None, 1)), *conv_backbone(6).layers]),
        client_optimizer=0.1, clip_norm=0.5, noise_multiplier=4.0, seed=0,
    )  # fmt: skip
    fine._check_clients(clients)


def test_a_fixed_seed_warns_at_the_line_that_built_the_model():
    with pytest.warns(ReproducibleNoiseWarning) as record:
        FedEmbModel(ref.linear_backbone(), noise_multiplier=1.0, seed=1)
    ours = [w for w in record if w.category is ReproducibleNoiseWarning]
    assert [w.filename for w in ours] == [__file__]


def test_only_the_plan_settings_may_be_adopted_after_construction():
    from kdpemb.models._shared import frozen_settings

    model = FedEmbModel(ref.linear_backbone(), noise_multiplier=1.0)
    with pytest.raises(AttributeError, match="fixed at construction"):
        model.noise_multiplier = 2.0
    with pytest.raises(ValueError, match="clip_norm"):
        frozen_settings.adopt_plan(model, clip_norm=2.0)
    assert model.clip_norm == 1.0 and model.noise_multiplier == 1.0

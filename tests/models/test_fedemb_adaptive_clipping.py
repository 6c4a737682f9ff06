"""FedEmbModel(adaptive_clipping=...): C follows a quantile of the update
norms; the update and the count are accounted as one Gaussian."""

import math
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

from kdpemb.models import FedEmbModel
from kdpemb.privacy import AdaptiveClipping, protocol
from tests.models import fedemb_reference as ref
from tests.models.test_fedemb import DELTA, make_model, make_schedule, tiny_clients

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]


def current_c(model):
    return float(keras.ops.convert_to_numpy(model.current_clip_norm))


def pld_epsilon(z, q, steps, relation):
    accountant = dpa.pld.PLDAccountant(relation)
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    accountant.compose(dpa.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("users_per_client", [1, 2])
def test_the_update_and_the_count_are_accounted_as_one_gaussian(users_per_client):
    z_update, sigma_b, m = 1.2, 0.5, 2.5
    schedule = make_schedule(
        num_users=40, clients_per_round=m, users_per_client=users_per_client
    )
    clipping = AdaptiveClipping(count_stddev=sigma_b)
    model = FedEmbModel(
        ref.linear_backbone(),
        noise_multiplier=z_update,
        schedule=schedule,
        adaptive_clipping=clipping,
        delta=DELTA,
    )
    z_eff = (z_update**-2 + (2 * sigma_b) ** -2) ** -0.5
    mechanism = model.privacy_mechanism()
    assert mechanism.noise_multiplier == pytest.approx(z_eff, rel=1e-12)
    assert model.noise_multiplier == z_update
    relation = (
        dpa.NeighboringRelation.REPLACE_ONE
        if users_per_client > 1
        else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    q, steps = schedule.sampling_probability, 30
    with_count = pld_epsilon(z_eff, q, steps, relation)
    fixed = FedEmbModel(
        ref.linear_backbone(),
        noise_multiplier=z_update,
        schedule=schedule,
        delta=DELTA,
    )
    statement = protocol.PrivacyStatement.compute(mechanism, steps, DELTA)
    assert statement.epsilon == pytest.approx(with_count, rel=1e-9)
    fixed_epsilon = protocol.PrivacyStatement.compute(
        fixed.privacy_mechanism(), steps, DELTA
    ).epsilon
    assert fixed_epsilon == pytest.approx(pld_epsilon(z_update, q, steps, relation))
    assert statement.epsilon > 1.1 * fixed_epsilon


def test_target_epsilon_calibrates_z_eff_and_leaves_the_rest_to_the_update():
    clients = tiny_clients()
    m = clients.schedule.sample_size
    clipping = AdaptiveClipping(count_stddev=5.0)
    model = FedEmbModel(
        ref.linear_backbone(),
        target_epsilon=3.0,
        delta=DELTA,
        adaptive_clipping=clipping,
        client_parallelism=1,
        clip_norm=0.5,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    model.fit(clients, epochs=2, verbose=0)
    z = model.noise_multiplier
    z_eff = model.privacy_mechanism().noise_multiplier
    assert z_eff == pytest.approx((z**-2 + 10.0**-2) ** -0.5, rel=1e-12)
    assert z > z_eff
    relation = dpa.NeighboringRelation.REPLACE_ONE
    q, planned = clients.schedule.sampling_probability, model.planned_steps
    assert pld_epsilon(z_eff, q, planned, relation) <= 3.0
    assert pld_epsilon(0.98 * z_eff, q, planned, relation) > 3.0
    assert model.privacy_statement().epsilon <= 3.0
    assert clipping.count_stddev_for(m) == 5.0
    # A count noise too small for the target is refused with the fix.
    small = FedEmbModel(
        ref.linear_backbone(),
        target_epsilon=3.0,
        delta=DELTA,
        adaptive_clipping=AdaptiveClipping(count_stddev=0.01),
    )
    small.compile()
    with pytest.raises(ValueError, match="count_stddev"):
        small.fit(clients, epochs=1, verbose=0)
    assert protocol.read_private_steps(small) == 0


def client_norms(kernel, data, lr=0.2, head_lr_scale=5.0):
    norms = []
    for client in ref.client_rows(data):
        head = np.zeros((kernel.shape[1], client["num_local_classes"]))
        update, _ = ref.client_update(
            kernel.astype(np.float64), head, client, lr=lr, head_lr_scale=head_lr_scale
        )
        norms.append(np.linalg.norm(update))
    return np.sort(norms)


@pytest.mark.parametrize("target_quantile", [0.3, 0.7])
def test_c_settles_at_the_target_quantile_of_known_norms(target_quantile):
    # The server does not move (SGD(0)), so every round trains the same
    # three clients from the same backbone: fixed norms n1 < n2 < n3. With
    # σ_b tiny, b̄ is the exact share within C (0, 1/3, 2/3 or 1), and C
    # settles at the norm where that share crosses γ: n1 for γ = 0.3 (0
    # within is too few, 1/3 too many), n3 for γ = 0.7 (2/3 too few).
    data = ref.make_round(7, classes=(3, 2, 2), rows=3, steps=2)
    backbone = ref.linear_backbone(seed=2)
    norms = client_norms(ref.kernel_of(backbone), data)
    eta = 0.5
    model = make_model(
        backbone,
        compile=False,
        local_steps=2,
        clients_per_round=3,
        num_users=30,
        clip_norm=float(norms[0]) / 20,
        adaptive_clipping=AdaptiveClipping(target_quantile, eta, count_stddev=1e-6),
        client_parallelism=1,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.0))
    history = ref.Rounds([data] * 40)
    model.fit(history, epochs=1, verbose=0, shuffle=False)
    c = current_c(model)
    crossing = norms[0] if target_quantile == 0.3 else norms[2]
    # Around the crossing C moves by exp(±η |share - γ|): at most exp(±0.15).
    band = math.exp(eta * 0.3)
    assert crossing / band <= c <= crossing * band, (c, norms)
    assert model.get_config()["clip_norm"] == pytest.approx(float(norms[0]) / 20)


def test_c_is_saved_restored_and_keeps_moving(tmp_path):
    clients = tiny_clients()
    model = FedEmbModel(
        ref.linear_backbone(),
        noise_multiplier=1.0,
        clip_norm=10.0,
        adaptive_clipping=AdaptiveClipping(learning_rate=0.5, count_stddev=0.05),
        client_parallelism=1,
        delta=DELTA,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    history = model.fit(clients, epochs=1, verbose=0)
    c = current_c(model)
    assert c < 10.0  # C = 10 holds every update: it shrinks.
    assert history.history["clip_norm"][-1] == pytest.approx(c)
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)
    assert current_c(loaded) == c
    assert loaded.adaptive_clipping == model.adaptive_clipping
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    if getattr(loaded, "optimizer", None) is None:
        loaded.compile(optimizer=keras.optimizers.SGD(0.1))
    loaded.fit(clients, epochs=1, verbose=0)
    assert current_c(loaded) != c


def test_the_count_noise_is_its_own_draw_every_round():
    # One local step from a zero head leaves every update at zero, so each
    # round's backbone change is the update noise alone and every client
    # is within C: the change of C reveals the count's noise draw. The
    # update noise of the same seed is the same draw for draw with and
    # without adaptive clipping: the count takes nothing from its stream.
    z, c, m, sigma_b, eta = 1.0, 0.5, 9.0, 0.2, 1.0
    # M = 9 expected clients, 3 in the round: b̄ = 2/3 + noise / 9 stays
    # inside (0, 1), where it is not clipped.

    def build(**adaptive):
        backbone = keras.Sequential(
            [
                keras.Input(ref.IMAGE_SHAPE),
                keras.layers.Flatten(),
                keras.layers.Dense(64, use_bias=False),
            ]
        )
        backbone.set_weights([np.ones((16, 64), "float32")])
        model = make_model(
            backbone,
            compile=False,
            local_steps=1,
            noise_multiplier=z,
            clip_norm=c,
            clients_per_round=m,
            num_users=30,
            seed=4,
            **adaptive,
        )
        model.compile(optimizer=keras.optimizers.SGD(1.0))
        return model

    adaptive = build(adaptive_clipping=AdaptiveClipping(0.5, eta, sigma_b))
    fixed = build()
    assert not np.array_equal(
        keras.ops.convert_to_numpy(adaptive.count_seed.state),
        keras.ops.convert_to_numpy(adaptive.noise_seed.state),
    )
    data = ref.make_round(41, classes=(2, 3, 2), rows=3, steps=1)
    count_draws = []
    for _ in range(3):
        draws = []
        round_c = current_c(adaptive)
        for model, model_c in ((adaptive, round_c), (fixed, c)):
            before = ref.kernel_of(model.backbone).copy()
            model.fit(ref.Rounds([data]), epochs=1, verbose=0, shuffle=False)
            change = (ref.kernel_of(model.backbone) - before).ravel()
            draws.append(change * m / (z * model_c))
        np.testing.assert_allclose(draws[0], draws[1], rtol=1e-4, atol=1e-5)
        assert abs(np.std(draws[0]) - 1) < 0.2  # N(0, (z C)²) / M.
        after_c = current_c(adaptive)
        below = 0.5 - math.log(after_c / round_c) / eta  # b̄, not clipped
        assert 0 < below < 1
        within = 3 * 0.5  # Three clients, all within C: Σ (b - 1/2).
        count_draws.append(((below - 0.5) * m - within) / sigma_b)
    # A fresh, non-zero draw every round.
    assert len(set(np.round(count_draws, 3))) == 3
    assert all(abs(draw) > 1e-3 for draw in count_draws)

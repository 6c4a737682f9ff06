"""`FedEmbModel.simulated_deployment` after a tiny fit, against dp-accounting.

A deployment with s times the noise and s times the clients per round
over P' virtual clients is `PoissonSampled(q' = s·M / P', Gaussian(s·z))`
composed over the run's rounds, under the run's neighbouring relation
(replace-one when virtual clients hold several users). The expected ε is
built here by hand with dp-accounting, never read off the library.
"""

import dataclasses

import dp_accounting as dpa
import keras
import pytest

from kdpemb.models import FedEmbModel
from kdpemb.privacy import AdaptiveClipping, protocol
from tests.models import fedemb_reference as ref
from tests.models.test_fedemb import DELTA, tiny_clients
from tests.privacy.test_deployment import reference_epsilon, sampled_gaussian_run

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.DataDependentScheduleWarning"),
]

Relation = dpa.NeighboringRelation

# The run: 8 users, virtual clients of k = 2 users in a public pool of
# P = 6 (not ceil(8 / 2) = 4, so the ratio P / N = 0.75 is visible), M = 1.
USERS, POOL, Z, CLIP = 8, 6, 2.0, 0.5
DEPLOYMENT_DELTA = 1e-6


def fitted(users_per_client=2, num_clients=POOL, **settings):
    clients = tiny_clients(users_per_client=users_per_client, num_clients=num_clients)
    model = FedEmbModel(
        ref.linear_backbone(),
        client_optimizer=0.1,
        clip_norm=CLIP,
        noise_multiplier=Z,
        delta=DELTA,
        seed=0,
        **settings,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0, momentum=0.9))
    model.fit(clients, epochs=1, verbose=0)
    steps = protocol.read_private_steps(model)
    assert steps == clients.rounds_per_epoch > 0
    return model, steps


@pytest.fixture(scope="module")
def run():
    return fitted()


@pytest.fixture(scope="module")
def adaptive_run():
    return fitted(adaptive_clipping=AdaptiveClipping(count_stddev=0.8))


def test_scale_one_on_the_run_own_users_is_the_run_own_statement(run):
    model, steps = run
    own = model.privacy_statement()
    same = model.simulated_deployment(1, USERS)
    assert same.deployment.epsilon == own.epsilon
    for name in (
        "delta",
        "steps",
        "noise_multiplier",
        "sampling_probability",
        "population",
        "neighboring_relation",
        "accountant",
    ):
        assert getattr(same.deployment, name) == getattr(own, name), name
    assert own.steps == steps and own.sampling_probability == 1 / POOL
    # The same at another δ, given to both.
    at = model.simulated_deployment(1, USERS, delta=1e-4)
    assert at.deployment.epsilon == model.privacy_statement(1e-4).epsilon
    # And computed independently, so a shared mistake would show.
    event = sampled_gaussian_run(1 / POOL, Z, steps)
    expected = reference_epsilon(event, DELTA, "pld", Relation.REPLACE_ONE)
    assert own.epsilon == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("scale", "users", "clients"), [(3, 800, 600), (2.5, 1_000, 700), (4, 64, 64)]
)
def test_scale_s_is_dp_accounting_of_s_z_at_q_s_m_over_p(run, scale, users, clients):
    model, steps = run
    deployed = model.simulated_deployment(
        scale, users, delta=DEPLOYMENT_DELTA, deployment_clients=clients
    )
    event = sampled_gaussian_run(scale * 1 / clients, scale * Z, steps)
    expected = reference_epsilon(event, DEPLOYMENT_DELTA, "pld", Relation.REPLACE_ONE)
    statement = deployed.deployment
    assert expected > 0
    assert statement.epsilon == pytest.approx(expected, rel=1e-9)
    # The relation matters: add/remove would under-state a k = 2 deployment.
    add_remove = reference_epsilon(
        event, DEPLOYMENT_DELTA, "pld", Relation.ADD_OR_REMOVE_ONE
    )
    assert statement.epsilon > add_remove
    assert statement.neighboring_relation == "replace_one"
    assert statement.noise_multiplier == pytest.approx(scale * Z, rel=1e-12)
    assert statement.sampling_probability == pytest.approx(scale / clients, rel=1e-12)
    assert (statement.steps, statement.population) == (steps, users)
    assert statement.delta == DEPLOYMENT_DELTA
    assert deployed.deployment_clients_per_round == scale * 1
    assert deployed.scale == scale
    assert (deployed.run.noise_multiplier, deployed.run.pool_size) == (Z, POOL)


def test_one_user_per_client_is_add_remove_and_rdp_is_dp_accounting_too():
    model, steps = fitted(users_per_client=1, num_clients=None)
    for method in ("pld", "rdp"):
        deployed = model.simulated_deployment(
            5, 1_000, delta=DEPLOYMENT_DELTA, accountant=method
        )
        event = sampled_gaussian_run(5 * 1 / 1_000, 5 * Z, steps)
        expected = reference_epsilon(
            event, DEPLOYMENT_DELTA, method, Relation.ADD_OR_REMOVE_ONE
        )
        assert deployed.deployment.epsilon == pytest.approx(expected, rel=1e-9)
        assert deployed.deployment.neighboring_relation == "add_or_remove_one"
        assert deployed.deployment.accountant == method


def test_it_is_labelled_a_simulation_and_leaves_the_run_statement_alone(run):
    model, _ = run
    before = model.privacy_statement()
    deployed = model.simulated_deployment(3, 800, deployment_clients=600)
    assert "simulated deployment" in deployed.summary().lower()
    assert "simulated deployment" in str(deployed).lower()
    assert "simulated deployment" not in before.summary().lower()
    after = model.privacy_statement()
    for field in dataclasses.fields(after):
        assert getattr(after, field.name) == getattr(before, field.name), field.name
    assert protocol.read_private_steps(model) == before.steps
    assert (model.noise_multiplier, model.delta) == (Z, DELTA)
    assert model.schedule.population == USERS and model.schedule.pool_size == POOL
    # The run's own ε is carried along, and is the model's.
    assert deployed.run_epsilon is None or deployed.run_epsilon == before.epsilon


def test_with_adaptive_clipping_the_deployment_noise_is_s_times_z_eff(adaptive_run):
    model, steps = adaptive_run
    z_eff = model.privacy_mechanism().noise_multiplier
    # z_eff, by hand: the update (z) and the count (σ_b = 0.8, sensitivity 1/2).
    assert z_eff == pytest.approx((Z**-2 + (2 * 0.8) ** -2) ** -0.5, rel=1e-12)
    assert z_eff < model.noise_multiplier == Z
    scale = 3
    deployed = model.simulated_deployment(
        scale, 800, delta=DEPLOYMENT_DELTA, deployment_clients=600
    )
    assert deployed.deployment.noise_multiplier == pytest.approx(
        scale * z_eff, rel=1e-12
    )
    event = sampled_gaussian_run(scale / 600, scale * z_eff, steps)
    expected = reference_epsilon(event, DEPLOYMENT_DELTA, "pld", Relation.REPLACE_ONE)
    assert deployed.deployment.epsilon == pytest.approx(expected, rel=1e-9)
    # s = 1 on the run's users is the run's own (z_eff) statement.
    own = model.simulated_deployment(1, USERS)
    assert own.deployment.epsilon == model.privacy_statement().epsilon


@pytest.mark.parametrize("users", [800, 8_000, 803])
def test_default_deployment_clients_keep_the_run_ratio_of_clients_to_users(run, users):
    model, steps = run
    deployed = model.simulated_deployment(2, users, delta=DEPLOYMENT_DELTA)
    pool = deployed.deployment.mechanism["pool_size"]
    # P' / N' = P / N = 6 / 8, to within the rounding to a whole client.
    assert abs(pool - users * POOL / USERS) < 1
    assert pool > -(-users // 2)  # Not ceil(N' / k): that would be P' = N' / 2.
    assert deployed.deployment.sampling_probability == pytest.approx(2 / pool)
    given = model.simulated_deployment(
        2, users, delta=DEPLOYMENT_DELTA, deployment_clients=pool
    )
    assert given.deployment == deployed.deployment
    event = sampled_gaussian_run(2 / pool, 2 * Z, steps)
    expected = reference_epsilon(event, DEPLOYMENT_DELTA, "pld", Relation.REPLACE_ONE)
    assert deployed.deployment.epsilon == pytest.approx(expected, rel=1e-9)


def test_a_run_pool_of_ceil_n_over_k_keeps_ceil_n_over_k():
    model, _ = fitted(num_clients=USERS // 2)
    deployed = model.simulated_deployment(2, 1_001, delta=DEPLOYMENT_DELTA)
    assert deployed.deployment.mechanism["pool_size"] == 501  # ceil(1001 / 2)

import dataclasses
import json
import math
import re

import dp_accounting as dpa
import pytest

from kdpemb import privacy

Relation = dpa.NeighboringRelation

# The DP-FedEmb poster (Xu et al., CVPR 2023): runs of 2048 clients per
# round, 3200 rounds, stated for a deployment with 64x the noise and the
# clients per round over 10M users, at δ = 1e-7, with the RDP accountant.
POSTER_Q = 2048 * 64 / 10_000_000
POSTER_ROUNDS = 3_200
POSTER_DELTA = 1e-7


def sampled_gaussian_run(q, z, steps):
    """The DpEvent of `steps` Poisson-sampled Gaussian steps, built by hand."""
    step = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    return dpa.SelfComposedDpEvent(step, steps)


def reference_epsilon(event, delta, method, relation):
    if method == "pld":
        accountant = dpa.pld.PLDAccountant(relation)
    else:
        accountant = dpa.rdp.RdpAccountant(None, relation)
    return accountant.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_one_user_per_client_matches_dp_accounting_add_remove(method):
    run = privacy.Schedule.virtual_clients(200_000, 100)
    deployed = privacy.simulated_deployment(
        run,
        0.1,
        500,
        scale=8,
        deployment_users=4_000_000,
        delta=1e-8,
        accountant=method,
    )
    event = sampled_gaussian_run(8 * 100 / 4_000_000, 8 * 0.1, 500)
    expected = reference_epsilon(event, 1e-8, method, Relation.ADD_OR_REMOVE_ONE)
    statement = deployed.deployment
    assert statement.epsilon == pytest.approx(expected, rel=1e-9)
    assert statement.neighboring_relation == "add_or_remove_one"
    assert statement.noise_multiplier == 0.8
    assert deployed.deployment_clients_per_round == 800
    assert statement.sampling_probability == 8 * 100 / 4_000_000
    assert (statement.population, statement.steps) == (4_000_000, 500)
    assert (deployed.run.noise_multiplier, deployed.run.clients_per_round) == (
        0.1,
        100,
    )


def test_several_users_per_client_keep_replace_one_on_the_new_pool():
    run = privacy.Schedule.virtual_clients(20_000, 50, users_per_client=4)
    deployed = privacy.simulated_deployment(
        run, 0.2, 300, scale=5, deployment_users=1_000_003, delta=1e-8
    )
    pool = -(-1_000_003 // 4)  # ceil(users / k): 250_001 virtual clients.
    event = sampled_gaussian_run(5 * 50 / pool, 5 * 0.2, 300)
    expected = reference_epsilon(event, 1e-8, "pld", Relation.REPLACE_ONE)
    statement = deployed.deployment
    assert statement.epsilon == pytest.approx(expected, rel=1e-9)
    assert statement.neighboring_relation == "replace_one"
    assert statement.mechanism["users_per_client"] == 4
    assert statement.mechanism["pool_size"] == pool
    # Add/remove would under-state it: the relation must not be dropped.
    add_remove = reference_epsilon(event, 1e-8, "pld", Relation.ADD_OR_REMOVE_ONE)
    assert statement.epsilon > add_remove
    with pytest.raises(privacy.UnsupportedMechanismError):
        privacy.simulated_deployment(
            run,
            0.2,
            300,
            scale=5,
            deployment_users=1_000_003,
            delta=1e-8,
            accountant="rdp",
        )


@pytest.mark.parametrize("num_clients", [None, 7_000])
def test_scale_one_on_the_run_population_is_the_run_itself(num_clients):
    run = privacy.Schedule.virtual_clients(
        20_000, 50, users_per_client=3, num_clients=num_clients
    )
    own = privacy.PrivacyStatement.compute(run.privacy_mechanism(0.9, 0.5), 400, 1e-6)
    same = privacy.simulated_deployment(
        run, 0.9, 400, scale=1, deployment_users=20_000, delta=1e-6, clip_norm=0.5
    )
    for field in dataclasses.fields(privacy.PrivacyStatement):
        if field.name != "simulated":
            value = getattr(same.deployment, field.name)
            assert value == getattr(own, field.name), field.name
    assert same.deployment.mechanism == own.mechanism
    # The same figures, but held as a simulated deployment's, not the run's.
    assert same.deployment.simulated and not own.simulated
    assert same.deployment != own
    assert privacy.deployment_schedule(run, 1, 20_000) == run
    assert same.summary().startswith("Simulated deployment")
    # s = 1: the run's own ε is computed like the deployment's (PLD), and is it.
    assert same.run_epsilon == own.epsilon
    assert same.run.epsilon_accountant == "pld"


def test_it_is_never_shown_or_read_back_as_the_run_own_guarantee():
    run = privacy.Schedule.virtual_clients(100_000, 100)
    deployed = privacy.simulated_deployment(
        run, 0.05, 200, scale=20, deployment_users=10_000_000, delta=1e-8
    )
    # Composition, not inheritance: nothing takes it for a PrivacyStatement.
    assert not isinstance(deployed, privacy.PrivacyStatement)
    assert not hasattr(deployed, "epsilon")
    assert isinstance(deployed.deployment, privacy.PrivacyStatement)
    summary = deployed.summary()
    first_line = summary.splitlines()[0]
    assert first_line.startswith("Simulated deployment (NOT this run's guarantee)")
    for shown in ("s = 20", "noise multiplier 1 ", "2,000 clients per round"):
        assert shown in summary
    for shown in ("10,000,000 users", "noise multiplier 0.05", "100 clients"):
        assert shown in summary
    assert "PLD accountant" in summary
    assert "SIMULATED DEPLOYMENT" in str(deployed).splitlines()[0]
    data = json.loads(deployed.to_json())
    assert set(data) == {
        "kind",
        "scale",
        "deployment_clients_per_round",
        "deployment",
        "run",
    }
    assert data["kind"] == "simulated_deployment" and data["scale"] == 20
    assert "epsilon" not in data  # The deployment's ε is under "deployment".
    assert data["deployment"]["epsilon"] == deployed.deployment.epsilon
    assert data["run"]["epsilon"] == deployed.run_epsilon
    assert privacy.DeploymentStatement.from_json(deployed.to_json()) == deployed
    with pytest.raises(ValueError, match="DeploymentStatement"):
        privacy.PrivacyStatement.from_json(deployed.to_json())
    with pytest.raises(ValueError, match="DeploymentStatement"):
        privacy.PrivacyStatement.from_dict(data)
    # The flat form of earlier versions (kind next to epsilon) is refused too.
    flat = {**data["deployment"], "kind": "simulated_deployment", "scale": 20}
    with pytest.raises(ValueError, match="DeploymentStatement"):
        privacy.PrivacyStatement.from_dict(flat)
    with pytest.raises(ValueError, match="kind='simulated_deployment'"):
        privacy.DeploymentStatement.from_dict(data["deployment"])
    # Nor is the statement it holds read back as a run's (next test).
    with pytest.raises(ValueError, match=r"DeploymentStatement\.from_dict"):
        privacy.PrivacyStatement.from_dict(data["deployment"])


def deployment_of_the_poster_run():
    run = privacy.Schedule.virtual_clients(160_000, 2048)
    return privacy.simulated_deployment(
        run,
        0.02,
        200,
        scale=64,
        deployment_users=10_000_000,
        delta=1e-8,
        accountant="rdp",
    )


def test_the_deployment_it_holds_is_marked_simulated_and_never_read_as_a_run():
    # Issue 31, item 3: `.deployment` on its own (its summary, table, dict)
    # read as a guarantee: "(ε = 4.22, δ = 1e-08)-DP per user".
    deployed = deployment_of_the_poster_run()
    held = deployed.deployment
    assert isinstance(held, privacy.PrivacyStatement) and held.simulated
    label = "SIMULATED DEPLOYMENT (NOT this run's guarantee)"
    assert held.summary().startswith(f"{label}: (ε = 1.48, δ = 1e-08)-DP per user")
    assert held.rows()[0] == ("statement of", label)
    assert str(held).splitlines()[0] == f"Privacy statement of a {label}"
    assert "SIMULATED DEPLOYMENT" in str(held).splitlines()[1]
    # Its dict says so first, whether taken from the object or from the JSON.
    nested = held.to_dict()
    assert next(iter(nested.items())) == ("simulated", True)
    assert deployed.to_dict()["deployment"] == nested
    from_json = json.loads(deployed.to_json())["deployment"]
    assert from_json["simulated"] is True
    for data in (nested, from_json):
        refused = r"SIMULATED DEPLOYMENT.*DeploymentStatement\.from_dict"
        with pytest.raises(ValueError, match=refused):
            privacy.PrivacyStatement.from_dict(data)
        with pytest.raises(ValueError, match=r"DeploymentStatement\.from_dict"):
            privacy.PrivacyStatement.from_json(json.dumps(data))
    # The whole statement round-trips, its deployment still marked.
    back = privacy.DeploymentStatement.from_json(deployed.to_json())
    assert back == deployed and back.deployment.simulated
    assert privacy.DeploymentStatement.from_dict(deployed.to_dict()) == deployed
    # The DeploymentStatement's own summary and rows say it once, up front.
    assert deployed.summary().count("SIMULATED DEPLOYMENT") == 0
    assert deployed.summary().startswith("Simulated deployment (NOT this run's")
    assert "statement of (deployment)" not in dict(deployed.rows())


def test_earlier_json_and_run_statements_still_load_as_they_were():
    deployed = deployment_of_the_poster_run()
    # A DeploymentStatement written before "simulated" existed: still read,
    # and its deployment marked simulated.
    earlier = deployed.to_dict()
    earlier["deployment"] = {
        k: v for k, v in earlier["deployment"].items() if k != "simulated"
    }
    back = privacy.DeploymentStatement.from_dict(earlier)
    assert back == deployed and back.deployment.simulated
    # A run's own statement has no "simulated" entry, and loads as a run's,
    # also with an explicit "simulated": false.
    own = privacy.PrivacyStatement.compute(
        privacy.Schedule.virtual_clients(160_000, 2048).privacy_mechanism(1.0),
        10,
        1e-8,
        accountant="rdp",
    )
    assert "simulated" not in own.to_dict() and not own.simulated
    assert privacy.PrivacyStatement.from_json(own.to_json()) == own
    assert (
        privacy.PrivacyStatement.from_dict({**own.to_dict(), "simulated": False}) == own
    )
    assert not own.summary().startswith("SIMULATED")
    assert "statement of" not in dict(own.rows())
    # A DeploymentStatement built around a run's statement marks its copy
    # of it, and leaves the run's statement alone.
    wrapped = privacy.DeploymentStatement(
        deployment=own,
        scale=1.0,
        deployment_clients_per_round=2048.0,
        run=deployed.run,
    )
    assert wrapped.deployment.simulated and not own.simulated
    assert wrapped.deployment.epsilon == own.epsilon


def test_run_epsilon_is_the_run_own_rdp_epsilon_at_the_same_delta():
    run = privacy.Schedule.virtual_clients(100_000, 100)
    deployed = privacy.simulated_deployment(
        run, 0.05, 200, scale=20, deployment_users=10_000_000, delta=1e-8
    )
    event = sampled_gaussian_run(100 / 100_000, 0.05, 200)
    expected = reference_epsilon(event, 1e-8, "rdp", Relation.ADD_OR_REMOVE_ONE)
    assert deployed.run_epsilon == pytest.approx(expected, rel=1e-9)
    assert deployed.run_epsilon > 100 * deployed.deployment.epsilon
    assert deployed.run.epsilon_accountant == "rdp"
    label = "this run's own guarantee"
    shown = f"ε = {deployed.run_epsilon:.4g} at δ = 1e-08 (RDP accountant)"
    assert f"This run's own guarantee: {shown}." in deployed.summary()
    shorter = deployed.summary(run_guarantee=False)
    assert deployed.summary().startswith(shorter)
    assert "run's own guarantee" not in shorter and shorter.endswith("accountant.")
    assert (f"ε of the run ({label})", shown) in deployed.rows()
    run_data = json.loads(deployed.to_json())["run"]
    assert run_data["epsilon"] == deployed.run_epsilon
    assert label in run_data["epsilon_note"]


def test_run_epsilon_of_a_noiseless_run_is_infinite_and_survives_json():
    run = privacy.Schedule.virtual_clients(1_000, 10)
    deployed = privacy.simulated_deployment(
        run, 0.0, 5, scale=2, deployment_users=2_000, delta=1e-4
    )
    assert deployed.run_epsilon == float("inf")
    assert json.loads(deployed.to_json())["run"]["epsilon"] is None
    back = privacy.DeploymentStatement.from_json(deployed.to_json())
    assert back.run_epsilon == float("inf") and back == deployed
    assert "ε = ∞: NO guarantee" in deployed.summary()


def test_run_epsilon_of_replace_one_is_not_computed_unless_cheap():
    run = privacy.Schedule.virtual_clients(20_000, 50, users_per_client=4)
    deployed = privacy.simulated_deployment(
        run, 0.2, 30, scale=5, deployment_users=1_000_000, delta=1e-8
    )
    # RDP has no model of it and PLD at the run's small z may not finish.
    assert deployed.run_epsilon is None and deployed.run.epsilon_accountant is None
    assert "This run's own guarantee: not computed" in deployed.summary()
    run_data = json.loads(deployed.to_json())["run"]
    assert run_data["epsilon"] is None and run_data["epsilon_accountant"] is None
    back = privacy.DeploymentStatement.from_json(deployed.to_json())
    assert back.run_epsilon is None and back == deployed
    # s = 1: the run has the deployment's z, so PLD costs what it did there.
    same_noise = privacy.simulated_deployment(
        run, 1.0, 30, scale=1, deployment_users=40_000, delta=1e-8
    )
    event = sampled_gaussian_run(50 / 5_000, 1.0, 30)
    expected = reference_epsilon(event, 1e-8, "pld", Relation.REPLACE_ONE)
    assert same_noise.run_epsilon == pytest.approx(expected, rel=1e-9)
    assert same_noise.deployment.epsilon < same_noise.run_epsilon


def test_every_deployment_row_is_labelled_and_counts_are_integers():
    run = privacy.Schedule.virtual_clients(160_000, 2048)
    deployed = privacy.simulated_deployment(
        run,
        0.02,
        10,
        scale=640,
        deployment_users=100_000_000,
        delta=1e-9,
        accountant="rdp",
    )
    rows = deployed.rows()
    # The held statement's first row marks it simulated; here the
    # DeploymentStatement's own first row ("statement of") says so.
    marker, *deployment_rows = deployed.deployment.rows()
    assert marker[0] == "statement of" and "SIMULATED" in marker[1]
    assert rows[0][0] == "statement of" and "SIMULATED" in rows[0][1]
    deployment_fields = [field for field, _ in deployment_rows]
    for field in deployment_fields:
        assert (field + " (deployment)") in [name for name, _ in rows]
    assert not any(name in deployment_fields for name, _ in rows)
    assert ("clients per round (deployment)", "1,310,720") in rows
    assert "1,310,720 clients per round" in deployed.summary()
    assert "e+" not in deployed.summary().split("The deployment")[0]
    odd = privacy.simulated_deployment(
        run,
        0.9,
        10,
        scale=1.2345678,
        deployment_users=200_000,
        delta=1e-6,
        accountant="rdp",
    )
    assert "scale s = 1.2345678," in odd.summary()
    assert f"{1.2345678 * 2048:.10g} clients per round" in odd.summary()


def test_non_integer_clients_per_round_is_accounted_at_its_rate():
    run = privacy.Schedule.virtual_clients(10_000, 33)
    deployed = privacy.simulated_deployment(
        run, 0.4, 50, scale=1.5, deployment_users=20_000, delta=1e-6
    )
    assert deployed.deployment_clients_per_round == 49.5
    event = sampled_gaussian_run(49.5 / 20_000, 1.5 * 0.4, 50)
    expected = reference_epsilon(event, 1e-6, "pld", Relation.ADD_OR_REMOVE_ONE)
    assert deployed.deployment.epsilon == pytest.approx(expected, rel=1e-9)
    assert "49.5 clients per round" in deployed.summary()


def test_local_steps_are_carried_over():
    run = privacy.Schedule.virtual_clients(10_000, 20, local_steps=3)
    assert privacy.deployment_schedule(run, 4, 50_000).local_steps == 3


def test_poster_dp_fedemb_row_0_02_x_64_is_3_90():
    # 0.02 x 64: z = 1.28 with 2048 x 64 clients per round over 10M users.
    run = privacy.Schedule.virtual_clients(160_000, 2048)
    deployed = privacy.deployment_schedule(run, 64, 10_000_000)
    mechanism = deployed.privacy_mechanism(64 * 0.02)
    event = sampled_gaussian_run(POSTER_Q, 64 * 0.02, POSTER_ROUNDS)
    assert mechanism.event(POSTER_ROUNDS) == event
    epsilon = reference_epsilon(event, POSTER_DELTA, "rdp", Relation.ADD_OR_REMOVE_ONE)
    assert round(epsilon, 2) == 3.90  # The poster's DP-FedEmb figure.
    assert round(epsilon, 3) == 3.898
    # The poster's δ = 1e-7 is 1/N for N = 10M: kdpemb refuses δ >= 1/N.
    with pytest.raises(ValueError, match="not below 1/population"):
        privacy.simulated_deployment(
            run,
            0.02,
            POSTER_ROUNDS,
            scale=64,
            deployment_users=10_000_000,
            delta=POSTER_DELTA,
            accountant="rdp",
        )
    at_1e8 = privacy.simulated_deployment(
        run,
        0.02,
        POSTER_ROUNDS,
        scale=64,
        deployment_users=10_000_000,
        delta=1e-8,
        accountant="rdp",
    )
    assert at_1e8.deployment.epsilon == pytest.approx(
        reference_epsilon(event, 1e-8, "rdp", Relation.ADD_OR_REMOVE_ONE), rel=1e-9
    )


def test_poster_dp_fedavg_row_0_015_x_64_is_not_5_62_on_the_same_schedule():
    # 0.015 x 64 = z 0.96 on the DP-FedEmb row's q, rounds and δ gives 6.51
    # (RDP; PLD 6.06), not the poster's 5.62: that row used another schedule
    # that the poster does not state (see docs/privacy.md).
    run = privacy.Schedule.virtual_clients(160_000, 2048)
    mechanism = privacy.deployment_schedule(run, 64, 10_000_000).privacy_mechanism(
        64 * 0.015
    )
    event = mechanism.event(POSTER_ROUNDS)
    assert event == sampled_gaussian_run(POSTER_Q, 64 * 0.015, POSTER_ROUNDS)
    rdp = reference_epsilon(event, POSTER_DELTA, "rdp", Relation.ADD_OR_REMOVE_ONE)
    assert round(rdp, 2) == 6.51
    # Replace-one only makes it larger; 2360 rounds at this q would give 5.62
    # (the docs say 5.618).
    shorter = sampled_gaussian_run(POSTER_Q, 64 * 0.015, 2_360)
    shorter_epsilon = reference_epsilon(
        shorter, POSTER_DELTA, "rdp", Relation.ADD_OR_REMOVE_ONE
    )
    assert round(shorter_epsilon, 2) == 5.62
    assert round(shorter_epsilon, 3) == 5.618


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"scale": 0.5}, "scale must be >= 1"),
        ({"scale": float("nan")}, "scale must be a finite"),
        ({"deployment_users": 10_000}, "deployment_users=10000 is fewer"),
        (
            {"deployment_users": 30_000, "scale": 1_000},
            r"q = 1\.667 > 1.*deployment_users >= 50000",
        ),
        ({"deployment_clients": 100}, r"deployment_clients=100 with one user"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be >= 0"),
        ({"delta": 1e-5}, "not below 1/population"),
    ],
)
def test_bad_inputs_are_refused_with_the_value_and_the_fix(changes, match):
    run = privacy.Schedule.virtual_clients(20_000, 50)
    kwargs = {
        "noise_multiplier": 0.1,
        "steps": 10,
        "scale": 100,
        "deployment_users": 1_000_000,
        "delta": 1e-8,
    } | changes
    schedule_kwargs = {"deployment_clients": kwargs.pop("deployment_clients", None)}
    with pytest.raises(ValueError, match=match):
        privacy.simulated_deployment(run, **kwargs, **schedule_kwargs)


def test_only_user_level_poisson_schedules_are_extrapolated():
    with pytest.raises(TypeError, match=r"must be a kdpemb\.privacy\.Schedule"):
        privacy.deployment_schedule(privacy.dp_sgd(1.0, 10, 1_000), 2, 10_000)
    with pytest.raises(ValueError, match="user-level"):
        privacy.deployment_schedule(privacy.Schedule.examples(1_000, 10), 2, 10_000)
    fixed = privacy.Schedule.virtual_clients(1_000, 10, sampling="fixed")
    with pytest.raises(ValueError, match="Poisson"):
        privacy.deployment_schedule(fixed, 2, 10_000)


@pytest.mark.parametrize(
    ("z", "rdp_1e7", "pld_1e7", "rdp_1e8", "pld_1e8"),
    [(0.02, 3.90, 3.65, 4.22, 3.97), (0.015, 6.51, 6.06, 7.06, 6.60)],
)
def test_the_poster_table_of_the_docs(z, rdp_1e7, pld_1e7, rdp_1e8, pld_1e8):
    # docs/privacy.md, "Simulated deployment": each figure against
    # dp-accounting called directly, and kdpemb's at δ = 1e-8 against it.
    event = sampled_gaussian_run(POSTER_Q, 64 * z, POSTER_ROUNDS)
    add_remove = Relation.ADD_OR_REMOVE_ONE
    assert round(reference_epsilon(event, 1e-7, "rdp", add_remove), 2) == rdp_1e7
    assert round(reference_epsilon(event, 1e-7, "pld", add_remove), 2) == pld_1e7
    run = privacy.Schedule.virtual_clients(160_000, 2048)
    for method, figure in (("rdp", rdp_1e8), ("pld", pld_1e8)):
        ours = privacy.simulated_deployment(
            run,
            z,
            POSTER_ROUNDS,
            scale=64,
            deployment_users=10_000_000,
            delta=1e-8,
            accountant=method,
        ).deployment.epsilon
        theirs = reference_epsilon(event, 1e-8, method, add_remove)
        assert ours == pytest.approx(theirs, rel=1e-9)
        assert round(ours, 2) == figure


def test_the_docs_alternatives_for_the_dp_fedavg_row():
    add_remove = Relation.ADD_OR_REMOVE_ONE
    replace = sampled_gaussian_run(POSTER_Q, 64 * 0.015, POSTER_ROUNDS)
    assert round(reference_epsilon(replace, 1e-7, "pld", Relation.REPLACE_ONE), 2) == (
        9.68
    )
    other_run = sampled_gaussian_run(2000 * 64 / 1e7, 64 * 0.015, 2_500)
    assert round(reference_epsilon(other_run, 1e-7, "rdp", add_remove), 2) == 5.63


def test_deployment_clients_is_checked_first_against_its_range():
    run = privacy.Schedule.virtual_clients(20_000, 50, users_per_client=4)
    # 1_000_000 users in clients of <= 4 make 250_000 to 1_000_000 clients;
    # each of these would also fail q <= 1 (s·M = 5_000): the range comes first.
    for clients in (249_999, 1_000_001, 100):
        with pytest.raises(ValueError, match=r"outside \[250000, 1000000\]"):
            privacy.deployment_schedule(run, 100, 1_000_000, deployment_clients=clients)
    for clients in (250_000, 1_000_000):
        deployed = privacy.deployment_schedule(
            run, 100, 1_000_000, deployment_clients=clients
        )
        assert deployed.pool_size == clients
    one = privacy.Schedule.virtual_clients(20_000, 50)
    with pytest.raises(ValueError, match="exactly 1000000 clients"):
        privacy.deployment_schedule(one, 1e6, 1_000_000, deployment_clients=999_999)
    assert privacy.deployment_schedule(
        one, 2, 1_000_000, deployment_clients=1_000_000
    ) == privacy.deployment_schedule(one, 2, 1_000_000)


def _hinted(message, name):
    return float(
        re.search(rf"{name} (?:>=|<=) ([0-9]+(?:\.[0-9]+)?)", message).group(1)
    )


@pytest.mark.parametrize(
    ("clients_per_round", "users_per_client", "scale"),
    [(50.001, 4, 3.0), (33, 1, 12.5), (50, 3, 4.1)],
)
def test_the_q_above_one_hints_are_right(clients_per_round, users_per_client, scale):
    run = privacy.Schedule.virtual_clients(
        400, clients_per_round, users_per_client=users_per_client
    )
    pool = run.pool_size
    with pytest.raises(ValueError, match="q = ") as error:
        privacy.deployment_schedule(run, scale, 400)
    message = str(error.value)
    users = _hinted(message, "deployment_users")
    assert users == math.ceil(scale * clients_per_round) * users_per_client
    privacy.deployment_schedule(run, scale, int(users))  # The hint works,
    with pytest.raises(ValueError, match="q = "):  # and one client fewer does not.
        privacy.deployment_schedule(run, scale, int(users) - users_per_client)
    largest = _hinted(message, "scale")
    assert largest * clients_per_round <= pool  # Rounded down, never up.
    privacy.deployment_schedule(run, largest, 400)
    assert largest > 0.999 * pool / clients_per_round


def test_the_q_above_one_hint_names_deployment_clients_when_it_is_given():
    run = privacy.Schedule.virtual_clients(2_000, 50.5, users_per_client=4)
    with pytest.raises(ValueError, match="q = ") as error:
        privacy.deployment_schedule(run, 10, 2_000, deployment_clients=500)
    message = str(error.value)
    assert _hinted(message, "deployment_clients") == 505
    assert "Use deployment_clients >= 505, or scale <= " in message
    assert _hinted(message, "scale") * 50.5 <= 500
    privacy.deployment_schedule(run, 10, 2_000, deployment_clients=505)


def test_a_public_run_pool_is_not_guessed_for_another_population():
    run = privacy.Schedule.virtual_clients(
        20_000, 50, users_per_client=3, num_clients=7_000
    )
    assert privacy.deployment_schedule(run, 2, 20_000).pool_size == 7_000
    # One more user must not switch the pool to ceil(N'/k) = 6_667.
    with pytest.raises(ValueError, match=r"num_clients.*pass deployment_clients"):
        privacy.deployment_schedule(run, 2, 20_001)
    with pytest.raises(ValueError, match=r"\[33334, 100000\] \(e\.g\. 35000 "):
        privacy.simulated_deployment(
            run, 0.1, 10, scale=2, deployment_users=100_000, delta=1e-6
        )
    deployed = privacy.deployment_schedule(run, 2, 20_001, deployment_clients=7_001)
    assert deployed.pool_size == 7_001


@pytest.mark.parametrize("users_per_client", [1, 4])
def test_calibrate_run_noise_makes_the_deployment_spend_the_target(users_per_client):
    run = privacy.Schedule.virtual_clients(
        2_000, clients_per_round=16, users_per_client=users_per_client
    )
    users, scale, steps, delta, target = 1_000_000, 32, 50, 1e-8, 4.0
    z = privacy.calibrate_run_noise(
        run, steps, delta, target_epsilon=target, scale=scale, deployment_users=users
    )
    pool = math.ceil(users / users_per_client)
    relation = (
        dpa.NeighboringRelation.REPLACE_ONE
        if users_per_client > 1
        else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    )

    def deployment_epsilon(deployment_z):
        event = sampled_gaussian_run(scale * 16 / pool, deployment_z, steps)
        return reference_epsilon(event, delta, "pld", relation)

    assert deployment_epsilon(scale * z) <= target  # Never above the target ...
    assert deployment_epsilon(0.99 * scale * z) > target  # ... and not loose.
    statement = privacy.simulated_deployment(
        run, z, steps, scale=scale, deployment_users=users, delta=delta
    )
    assert statement.deployment.epsilon <= target

"""Schedule.users and the cap `examples_per_user` of user-level DP-SGD."""

import json

import pytest

from kdpemb import privacy
from kdpemb.privacy import ledger
from kdpemb.privacy.composed_step import ComposedSampledGaussian
from kdpemb.privacy.gaussian_release import GaussianRelease
from kdpemb.privacy.mechanisms import SampledGaussian
from kdpemb.privacy.schedule import Schedule


def test_users_schedule_samples_users_from_a_pool_of_users():
    schedule = Schedule.users(5_000, 50, examples_per_user=4)
    assert (schedule.population, schedule.pool_size, schedule.unit) == (
        5_000,
        5_000,
        "user",
    )
    assert schedule.sampling_probability == pytest.approx(0.01)
    mechanism = schedule.privacy_mechanism(1.1, 0.5)
    assert mechanism == SampledGaussian(
        noise_multiplier=1.1,
        sampling="poisson",
        sample_size=50,
        pool_size=5_000,
        population=5_000,
        unit="user",
        clip_norm=0.5,
        examples_per_user=4,
    )
    # The accounting is that of one user per virtual client: add/remove.
    same = Schedule.virtual_clients(5_000, 50).privacy_mechanism(1.1, 0.5)
    assert mechanism.relation_name == same.relation_name == "add_or_remove_one"
    assert mechanism.event(100) == same.event(100)
    assert mechanism != same  # The cap is part of the mechanism's identity.


def test_users_schedule_full_batch_and_fixed():
    full = Schedule.users(300)
    assert (full.sampling, full.sample_size, full.examples_per_user) == (
        "full_batch",
        300,
        None,
    )
    assert full == Schedule.virtual_clients(300, None, sampling="full_batch")
    fixed = Schedule.users(300, 30, sampling="fixed", examples_per_user=2)
    assert fixed.privacy_mechanism(1.0).relation_name == "replace_one"


def test_the_cap_is_in_the_relation_and_the_description():
    schedule = Schedule.users(1_000, 10, examples_per_user=3)
    relation = schedule.privacy_mechanism(1.0, 2.0).describe_relation()
    assert relation == (
        "add or remove all data of one user (each step averages at most 3 of "
        "the user's examples into one contribution clipped to C)"
    )
    assert "at most 3 examples per user per step" in schedule.describe()
    assert "each user joins a step" in schedule.describe()
    fixed = Schedule.users(1_000, 10, sampling="fixed", examples_per_user=3)
    assert "at most 3 of the user's examples" in (
        fixed.privacy_mechanism(1.0).describe_relation()
    )
    plain = Schedule.users(1_000, 10).privacy_mechanism(1.0)
    assert plain.describe_relation() == "add or remove all data of one user"


def test_the_cap_round_trips_through_configs_json_and_the_ledger(tmp_path):
    schedule = Schedule.users(1_000, 10, examples_per_user=3)
    config = json.loads(json.dumps(schedule.get_config()))
    assert config["examples_per_user"] == 3
    assert Schedule.from_config(config) == schedule
    assert Schedule.from_config(config | {"examples_per_user": 4}) != schedule
    mechanism = schedule.privacy_mechanism(1.0, 1.0)
    assert mechanism.parameters()["examples_per_user"] == 3
    path = tmp_path / "ledger.json"
    ledger.write_ledger(path, mechanism, steps=5, durable=False)
    assert ledger.read_ledger(path, mechanism)["steps"] == 5
    other = Schedule.users(1_000, 10, examples_per_user=4).privacy_mechanism(1.0, 1.0)
    with pytest.raises(ValueError, match="examples_per_user"):
        ledger.read_ledger(path, other)


def test_older_configs_and_ledgers_without_the_field_still_load(tmp_path):
    schedule = Schedule.examples(1_000, 10)
    config = schedule.get_config()
    assert config.pop("examples_per_user") is None
    assert Schedule.from_config(config) == schedule
    mechanism = schedule.privacy_mechanism(1.0)
    assert "examples_per_user" not in mechanism.parameters()
    path = tmp_path / "ledger.json"
    ledger.write_ledger(path, mechanism, steps=2, durable=False)
    assert ledger.read_ledger(path, mechanism)["steps"] == 2


def test_a_composed_step_keeps_the_cap():
    base = Schedule.users(1_000, 10, examples_per_user=3).privacy_mechanism(1.0)
    releases = [GaussianRelease(2.0, 1.0), GaussianRelease(2.0, 1.0)]
    composed = ComposedSampledGaussian.compose(base, releases)
    assert composed.examples_per_user == 3
    assert composed.with_noise_multiplier(1.0).examples_per_user == 3
    assert "at most 3 of the user's examples" in composed.describe_relation()


def test_a_statement_of_a_capped_run_names_the_cap():
    mechanism = Schedule.users(1_000, 10, examples_per_user=3).privacy_mechanism(
        1.0, 1.0
    )
    statement = privacy.PrivacyStatement.compute(mechanism, steps=10, delta=1e-5)
    assert "at most 3 of the user's examples" in statement.summary()
    assert statement.mechanism["examples_per_user"] == 3
    again = privacy.PrivacyStatement.from_json(statement.to_json())
    assert again.relation_description == statement.relation_description


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Schedule.users(0, 1), "num_users must be a positive integer"),
        (lambda: Schedule.users(10, 11), "users_per_step=11 is more than the 10"),
        (lambda: Schedule.users(10, 0), "users_per_step must be > 0"),
        (
            lambda: Schedule.users(10, 2.5, sampling="fixed"),
            "users_per_step must be a whole number",
        ),
        (lambda: Schedule.users(10, 2, sampling="epochs"), "sampling must be one"),
        (
            lambda: Schedule.users(10, 2, examples_per_user=0),
            "examples_per_user must be a positive integer, got 0",
        ),
        (
            lambda: Schedule.users(10, 2, examples_per_user=2.0),
            "examples_per_user must be a positive integer",
        ),
        (
            lambda: Schedule(100, 10, examples_per_user=2),
            "needs unit='user' with users_per_client=1, got unit='example'",
        ),
        (
            lambda: Schedule.virtual_clients(100, 10, users_per_client=2).__class__(
                100, 10, unit="user", users_per_client=2, examples_per_user=2
            ),
            "users_per_client=2",
        ),
        (
            lambda: Schedule(
                100, 10, "epochs", "user", steps_per_epoch=10, examples_per_user=2
            ),
            "not sampling='epochs'",
        ),
    ],
)
def test_bad_user_schedules_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()

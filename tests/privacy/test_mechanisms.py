import dataclasses
import warnings

import dp_accounting as dpa
import numpy as np
import pytest

from kdpemb import privacy
from kdpemb.errors import SmallPopulationWarning

Relation = dpa.NeighboringRelation


def test_dp_sgd_is_poisson_sampled_gaussian_under_add_remove():
    mechanism = privacy.dp_sgd(1.1, 256, 60_000, clip_norm=1.0)
    assert mechanism.sampling_probability == 256 / 60_000
    assert mechanism.neighboring_relation == Relation.ADD_OR_REMOVE_ONE
    assert mechanism.unit == "example"
    assert mechanism.event(10) == dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(256 / 60_000, dpa.GaussianDpEvent(1.1)), 10
    )


def test_full_batch_is_a_plain_gaussian_per_step():
    mechanism = privacy.full_batch(3.0, 1_000)
    assert mechanism.sampling_probability == 1.0
    assert mechanism.step_event() == dpa.GaussianDpEvent(3.0)


def test_fixed_size_batches_are_sampled_without_replacement_under_replace_one():
    mechanism = privacy.dp_sgd(1.0, 100, 1_000, sampling="fixed")
    assert mechanism.neighboring_relation == Relation.REPLACE_ONE
    assert mechanism.step_event() == dpa.SampledWithoutReplacementDpEvent(
        1_000, 100, dpa.GaussianDpEvent(1.0)
    )


@pytest.mark.parametrize(
    "k, relation", [(1, Relation.ADD_OR_REMOVE_ONE), (4, Relation.REPLACE_ONE)]
)
def test_virtual_clients_relation_depends_on_users_per_client(k, relation):
    mechanism = privacy.virtual_clients(1.0, 10, 1_000, users_per_client=k)
    assert mechanism.neighboring_relation == relation
    assert mechanism.unit == "user"
    assert mechanism.pool_size == -(-1_000 // k)
    assert mechanism.sampling_probability == 10 / mechanism.pool_size
    assert mechanism.population == 1_000


def test_steps_for_epochs_rounds_up_exactly():
    assert privacy.dp_sgd(1.0, 256, 60_000).steps_for_epochs(60) == 14_063
    assert privacy.dp_sgd(1.0, 10, 100).steps_for_epochs(3) == 30  # Not 31.
    assert privacy.full_batch(1.0, 100).steps_for_epochs(7) == 7
    assert (
        privacy.virtual_clients(1.0, 25, 1_000, users_per_client=4).steps_for_epochs(2)
        == 20
    )
    assert privacy.dp_sgd(1.0, 1, 10).steps_for_epochs(1e-9) == 1
    with pytest.raises(ValueError, match="epochs must be > 0"):
        privacy.dp_sgd(1.0, 1, 10).steps_for_epochs(0)


def test_gaussian_releases_compose_into_one_effective_gaussian():
    mechanism = privacy.gaussian_releases(
        [(3.0, 1.0, "gram"), privacy.GaussianRelease(8.0, 2.0, "sums")],
        num_examples=500,
    )
    assert mechanism.noise_multiplier == pytest.approx((3.0**-2 + 4.0**-2) ** -0.5)
    assert mechanism.step_event() == dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(3.0), dpa.GaussianDpEvent(4.0)]
    )
    rescaled = mechanism.with_noise_multiplier(1.0)
    assert rescaled.noise_multiplier == pytest.approx(1.0)
    ratio = [r.noise_std for r in rescaled.releases]
    assert ratio[0] / ratio[1] == pytest.approx(3.0 / 8.0)


def test_mechanisms_are_frozen_and_serialisable():
    mechanism = privacy.virtual_clients(
        1.0, 10, 1_000, users_per_client=2, clip_norm=0.5
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        mechanism.noise_multiplier = 0.0
    params = mechanism.parameters()
    assert params["type"] == "SampledGaussian" and params["users_per_client"] == 2


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: privacy.dp_sgd(1.0, 0, 100), "batch_size must be > 0"),
        (
            lambda: privacy.dp_sgd(1.0, 200, 100),
            "batch_size=200 is more than the 100 units",
        ),
        (lambda: privacy.dp_sgd(-0.5, 10, 100), "noise_multiplier must be >= 0"),
        (lambda: privacy.dp_sgd(float("inf"), 10, 100), "finite"),
        (lambda: privacy.dp_sgd(1.0, 10, 0), "num_examples must be a positive integer"),
        (
            lambda: privacy.dp_sgd(1.0, 10, 100, sampling="shuffle"),
            "sampling must be one of",
        ),
        (
            lambda: privacy.dp_sgd(1.0, 10.5, 100, sampling="fixed"),
            "batch_size must be a whole number",
        ),
        (lambda: privacy.dp_sgd(1.0, 10, 100, clip_norm=0.0), "clip_norm must be > 0"),
        (
            lambda: privacy.virtual_clients(1.0, 300, 1_000, users_per_client=4),
            "more than the 250 virtual clients",
        ),
        (
            lambda: privacy.virtual_clients(1.0, 1, 10, users_per_client=20),
            "users_per_client=20 is larger than the number of users",
        ),
        (
            lambda: privacy.SampledGaussian(
                1.0, "poisson", 1, 10, 10, users_per_client=2
            ),
            "unit must be 'user'",
        ),
        (lambda: privacy.gaussian_releases([], 10), "non-empty"),
        (lambda: privacy.GaussianRelease(1.0, 0.0), "sensitivity must be > 0"),
        (lambda: privacy.zcdp(0.0, 10), "rho must be > 0"),
        (
            lambda: privacy.zcdp(0.1, 10, neighboring_relation="swap"),
            "Unknown neighbouring",
        ),
        (lambda: privacy.tree_aggregation(1.0, 0, 10), "steps_per_epoch"),
        (
            lambda: privacy.SampledGaussian(
                1.0, "poisson", 10, 100, 10_000, unit="user"
            ),
            "must equal population",
        ),
        (
            lambda: privacy.SampledGaussian(
                1.0, "poisson", 10, 100, 10_000, unit="user", users_per_client=4
            ),
            "2500 to 10000",
        ),
        (lambda: privacy.dp_sgd(1.0, 10, 100).event(2.5), "integer >= 0"),
        (lambda: privacy.dp_sgd(1.0, 10, 100).event(True), "integer >= 0"),
    ],
)
def test_bad_schedules_fail_when_built_with_the_value_and_the_fix(build, message):
    with pytest.raises(ValueError, match=message):
        build()


RELEASE = privacy.GaussianRelease(noise_std=2.0, sensitivity=1.0, name="sum")
POPULATION_BUILDERS = {
    "dp_sgd": lambda n: privacy.dp_sgd(1.0, 1, n),
    "full_batch": lambda n: privacy.full_batch(1.0, n),
    "virtual_clients": lambda n: privacy.virtual_clients(1.0, 1, n),
    "gaussian_releases": lambda n: privacy.gaussian_releases([RELEASE], n),
    "zcdp": lambda n: privacy.zcdp(0.1, n),
    "tree_aggregation": lambda n: privacy.tree_aggregation(1.0, 1, n),
    "Schedule.examples": lambda n: privacy.Schedule.examples(n, 1),
    "Schedule.virtual_clients": lambda n: privacy.Schedule.virtual_clients(n, 1),
}


@pytest.mark.parametrize(
    "build", POPULATION_BUILDERS.values(), ids=list(POPULATION_BUILDERS)
)
def test_a_population_of_one_warns_at_the_callers_line(build):
    # Review finding: one user trained and got a statement without a word
    # (with delta=0.5 < 1/1 accepted).
    with pytest.warns(SmallPopulationWarning, match="single") as record:
        build(1)
    assert {w.filename for w in record} == {__file__}  # The caller's line.
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallPopulationWarning)
        build(2)


def test_a_model_of_one_example_warns_before_its_first_step():
    from kdpemb.models import LastLayerDPClassifier

    model = LastLayerDPClassifier(2, noise_multiplier=1.0, delta=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallPopulationWarning)
        with pytest.raises(SmallPopulationWarning):
            model.fit(np.ones((1, 3), "float32"), np.zeros(1, int), verbose=0)
    assert privacy.protocol.read_private_steps(model) == 0

"""`calibrate` returns the ε bound its multiplier met: what the command
line states, between the accountant's own ε and the target."""

import pytest

from kdpemb import privacy
from kdpemb.privacy import calibration


def test_the_stated_bound_is_at_least_the_accountants_epsilon_and_close():
    mechanism = privacy.dp_sgd(1.0, 256, 60_000)
    found = calibration.calibrate(mechanism, 2_000, 1e-5, target_epsilon=1.0)
    assert found.noise_multiplier == privacy.calibrate_noise_multiplier(
        mechanism, 2_000, 1e-5, target_epsilon=1.0
    )
    own = privacy.Accountant(
        mechanism.with_noise_multiplier(found.noise_multiplier)
    ).epsilon(2_000, 1e-5)
    # Searched on a coarser grid: a bound above the default grid's ε,
    # by less than rtol / 2 of the target, and within the target.
    assert own < found.epsilon <= 1.0
    assert found.epsilon - own <= 0.005 / 2 * 1.0
    assert found.accountant == "pld"


@pytest.mark.parametrize(
    "mechanism, accountant",
    [
        (privacy.dp_sgd(1.0, 256, 60_000), "rdp"),
        (privacy.full_batch(1.0, 1_000), "pld"),  # One exact Gaussian.
    ],
    ids=["rdp", "exact"],
)
def test_where_the_search_ran_on_the_accountants_own_epsilon_it_is_that_one(
    mechanism, accountant
):
    found = calibration.calibrate(
        mechanism, 500, 1e-5, target_epsilon=2.0, accountant=accountant
    )
    own = privacy.Accountant(
        mechanism.with_noise_multiplier(found.noise_multiplier), accountant
    ).epsilon(500, 1e-5)
    assert found.epsilon == own <= 2.0
    assert found.accountant == accountant


def test_a_statement_from_a_given_epsilon_is_checked():
    mechanism = privacy.dp_sgd(1.1, 256, 60_000)
    statement = privacy.PrivacyStatement.from_epsilon(mechanism, 10, 1e-5, 0.5, "pld")
    computed = privacy.PrivacyStatement.compute(mechanism, 10, 1e-5)
    assert statement.epsilon == 0.5
    assert statement.mechanism == computed.mechanism and statement.steps == 10
    for epsilon, accountant in [(-1.0, "pld"), (float("nan"), "pld"), (1.0, "x")]:
        with pytest.raises(ValueError):
            privacy.PrivacyStatement.from_epsilon(
                mechanism, 10, 1e-5, epsilon, accountant
            )

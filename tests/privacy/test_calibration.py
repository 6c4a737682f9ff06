import pytest

from kdpemb import privacy

SCHEDULES = [
    ("dp_sgd", privacy.dp_sgd(1.0, 256, 60_000), 2_000, 1e-5, "pld"),
    ("dp_sgd_rdp", privacy.dp_sgd(1.0, 256, 60_000), 2_000, 1e-5, "rdp"),
    ("full_batch", privacy.full_batch(1.0, 5_000), 10, 1e-6, "pld"),
    (
        "virtual_clients_k4",
        privacy.virtual_clients(1.0, 100, 40_000, users_per_client=4),
        300,
        1e-6,
        "pld",
    ),
    ("fixed", privacy.dp_sgd(1.0, 100, 10_000, sampling="fixed"), 500, 1e-6, "rdp"),
]


@pytest.mark.parametrize("target", [1.0, 4.0])
@pytest.mark.parametrize(
    "mechanism, steps, delta, method",
    [s[1:] for s in SCHEDULES],
    ids=[s[0] for s in SCHEDULES],
)
def test_calibration_round_trips_within_one_percent(
    mechanism, steps, delta, method, target
):
    z = privacy.calibrate_noise_multiplier(
        mechanism, target, delta, steps, accountant=method
    )
    achieved = privacy.epsilon(
        mechanism.with_noise_multiplier(z), steps, delta, accountant=method
    )
    assert 0.99 * target <= achieved <= target
    # It is the smallest: 1% less noise no longer meets the target.
    less = privacy.epsilon(
        mechanism.with_noise_multiplier(0.99 * z), steps, delta, accountant=method
    )
    assert less > target


def test_an_unreachable_target_names_the_limit_and_the_fixes():
    mechanism = privacy.full_batch(1.0, 1_000)
    with pytest.raises(privacy.CalibrationError, match=r"cannot be met.*fewer steps"):
        privacy.calibrate_noise_multiplier(
            mechanism, 1e-4, 1e-5, 10_000, max_noise_multiplier=50.0
        )


def test_calibration_validates_its_inputs():
    mechanism = privacy.dp_sgd(1.0, 100, 10_000)
    with pytest.raises(ValueError, match="1/population"):
        privacy.calibrate_noise_multiplier(mechanism, 1.0, 1e-3, 100)
    with pytest.raises(ValueError, match="target_epsilon must be > 0"):
        privacy.calibrate_noise_multiplier(mechanism, 0.0, 1e-6, 100)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        privacy.calibrate_noise_multiplier(mechanism, 1.0, 1e-6, 0)
    with pytest.raises(privacy.UnsupportedMechanismError):
        privacy.calibrate_noise_multiplier(
            privacy.virtual_clients(1.0, 10, 1_000, users_per_client=2),
            1.0,
            1e-6,
            10,
            accountant="rdp",
        )
    with pytest.raises(TypeError, match="no single noise multiplier"):
        privacy.calibrate_noise_multiplier(
            privacy.zcdp(0.1, 1_000), 1.0, 1e-6, 10, accountant="rdp"
        )


def test_a_tiny_target_that_the_accountant_rounds_to_zero_is_calibrated():
    # At q = 1e-4 the PLD accountant reports ε = 0 exactly for z >= 100; the
    # search passes through such points and must not take log(0).
    mechanism = privacy.dp_sgd(1.0, 10, 100_000)
    assert (
        privacy.Accountant(mechanism.with_noise_multiplier(1000.0)).epsilon(1e-6, 1)
        == 0.0
    )
    for target in (1e-4, 1e-3):
        z = privacy.calibrate_noise_multiplier(mechanism, target, 1e-6, 1)
        spent = privacy.Accountant(mechanism.with_noise_multiplier(z)).epsilon(1e-6, 1)
        assert 0.9 * target <= spent <= target

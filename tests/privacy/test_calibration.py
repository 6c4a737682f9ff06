import dp_accounting as dpa
import pytest

from kdpemb import privacy
from kdpemb.privacy import calibration

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
        mechanism, steps, delta, target_epsilon=target, accountant=method
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
            mechanism, 10_000, 1e-5, target_epsilon=1e-4, max_noise_multiplier=50.0
        )


def test_calibration_validates_its_inputs():
    mechanism = privacy.dp_sgd(1.0, 100, 10_000)
    with pytest.raises(ValueError, match="1/population"):
        privacy.calibrate_noise_multiplier(mechanism, 100, 1e-3, target_epsilon=1.0)
    with pytest.raises(ValueError, match="target_epsilon must be > 0"):
        privacy.calibrate_noise_multiplier(mechanism, 100, 1e-6, target_epsilon=0.0)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        privacy.calibrate_noise_multiplier(mechanism, 0, 1e-6, target_epsilon=1.0)
    with pytest.raises(privacy.UnsupportedMechanismError):
        privacy.calibrate_noise_multiplier(
            privacy.virtual_clients(1.0, 10, 1_000, users_per_client=2),
            10,
            1e-6,
            target_epsilon=1.0,
            accountant="rdp",
        )
    with pytest.raises(TypeError, match="no single noise multiplier"):
        privacy.calibrate_noise_multiplier(
            privacy.zcdp(0.1, 1_000), 10, 1e-6, target_epsilon=1.0, accountant="rdp"
        )


def test_a_tiny_target_that_the_accountant_rounds_to_zero_is_calibrated():
    # At q = 1e-4 the PLD accountant reports ε = 0 exactly for z >= 100; the
    # search passes through such points and must not take log(0).
    mechanism = privacy.dp_sgd(1.0, 10, 100_000)
    assert (
        privacy.Accountant(mechanism.with_noise_multiplier(1000.0)).epsilon(1, 1e-6)
        == 0.0
    )
    for target in (1e-4, 1e-3):
        z = privacy.calibrate_noise_multiplier(
            mechanism, 1, 1e-6, target_epsilon=target
        )
        spent = privacy.Accountant(mechanism.with_noise_multiplier(z)).epsilon(1, 1e-6)
        assert 0.9 * target <= spent <= target


def _spy_on_accountants(monkeypatch):
    """Records (noise multiplier, grid) of every accountant the search builds."""
    built = []

    class Spy(privacy.Accountant):
        def __init__(self, mechanism, method="pld", **kwargs):
            super().__init__(mechanism, method, **kwargs)
            interval = kwargs.get("value_discretization_interval", 1e-4)
            built.append((mechanism.noise_multiplier, interval))

    monkeypatch.setattr(calibration, "Accountant", Spy)
    return built


SAMPLED = [
    ("dp_sgd", privacy.dp_sgd(1.0, 256, 60_000), 1_000, 1e-5),
    (
        "virtual_clients_k4",
        privacy.virtual_clients(1.0, 100, 40_000, users_per_client=4),
        300,
        1e-6,
    ),
]


@pytest.mark.parametrize("target", [0.1, 2.0, 30.0])
@pytest.mark.parametrize(
    "mechanism, steps, delta", [s[1:] for s in SAMPLED], ids=[s[0] for s in SAMPLED]
)
def test_sampled_calibration_meets_the_target_on_the_default_grid(
    mechanism, steps, delta, target, monkeypatch
):
    """Searched on coarser grids, checked here on the accountant's own grid."""
    built = _spy_on_accountants(monkeypatch)
    z = privacy.calibrate_noise_multiplier(
        mechanism, steps, delta, target_epsilon=target
    )
    achieved = privacy.Accountant(mechanism.with_noise_multiplier(z)).epsilon(
        steps, delta
    )
    assert (1 - 0.005) * target <= achieved <= target
    # Never accounted far below the answer, where distributions are wide.
    assert min(noise for noise, _ in built) >= z / 2.5
    assert len(built) <= 20


@pytest.mark.parametrize(
    "mechanism, steps, delta", [s[1:] for s in SAMPLED], ids=[s[0] for s in SAMPLED]
)
def test_a_target_of_1000_is_met_without_accounting_absurdly_small_noise(
    mechanism, steps, delta, monkeypatch
):
    built = _spy_on_accountants(monkeypatch)
    z = privacy.calibrate_noise_multiplier(
        mechanism, steps, delta, target_epsilon=1000.0
    )
    assert min(noise for noise, _ in built) >= z / 2.5
    # The default grid is too slow here (minutes); a grid 10x finer than
    # any the search used also puts ε at most at the target, and close.
    finest = min(interval for _, interval in built if interval > 1e-4)
    check = privacy.Accountant(
        mechanism.with_noise_multiplier(z), value_discretization_interval=finest / 10
    ).epsilon(steps, delta)
    assert (1 - 0.005) * 1000 <= check <= 1000


@pytest.mark.parametrize("level", [1, 9])
@pytest.mark.parametrize(
    "mechanism, steps, delta",
    [
        (privacy.dp_sgd(0.6, 256, 60_000), 500, 1e-5),
        (privacy.dp_sgd(1.19, 285, 10_000), 620, 1e-9),
        (privacy.virtual_clients(1.19, 285, 40_000, users_per_client=4), 620, 1e-9),
        (privacy.virtual_clients(0.49, 3841, 40_000, users_per_client=4), 827, 1e-6),
    ],
    ids=["dp_sgd", "dp_sgd_small_delta", "k4_small_delta", "k4_epsilon_near_900"],
)
def test_a_coarse_grid_bounds_the_default_grid(mechanism, steps, delta, level):
    """What the search relies on: ε on the default grid 1e-4 is at most ε on
    the grid 2^level · 1e-4 at the slightly smaller δ, plus that grid step.

    (Without the margins dp-accounting's grids are not quite nested: the
    FFT round-off of a finer grid and the grid values it returns beyond
    ε ≈ 745 put it up to a few 1e-4 above a coarser one.)
    """
    default = privacy.Accountant(mechanism).epsilon(steps, delta)
    grids = calibration._Grids(
        lambda z, interval: privacy.Accountant(
            mechanism.with_noise_multiplier(z), value_discretization_interval=interval
        ),
        delta,
        steps,
        z_max=1e9,
        epsilon_at_max=None,
    )
    z = mechanism.noise_multiplier
    assert default <= grids.bound(z, level)
    margins, error = grids.excess(z, level)
    assert margins > 0 and error >= 0


@pytest.mark.parametrize("target", [0.1, 10.0, 1000.0])
def test_unsampled_releases_are_calibrated_on_the_exact_gaussian(target):
    """DP-LS: two Gaussian releases; ε(z) in closed form, checked two ways."""
    releases = privacy.gaussian_releases(
        [(1.0, 1.0, "Gram matrix"), (1.0, 1.0, "class sums")], num_examples=50_000
    )
    z = privacy.calibrate_noise_multiplier(releases, 1, 1e-6, target_epsilon=target)
    calibrated = releases.with_noise_multiplier(z)
    exact = dpa.get_epsilon_gaussian(calibrated.noise_multiplier, 1e-6)
    # The exact ε is cheap: the search leaves only 1e-6 of the target unused.
    assert (1 - 2e-6) * target <= exact <= target * (1 + 1e-9)
    assert privacy.Accountant(calibrated).epsilon(1, 1e-6) <= target
    # dp-accounting's PLD of the same event: pessimistic, so at or above.
    pld = (
        dpa.pld.PLDAccountant(value_discretization_interval=target * 1e-3)
        .compose(calibrated.event(1))
        .get_epsilon(1e-6)
    )
    assert exact <= pld <= exact * 1.01 + 1e-3


@pytest.mark.parametrize(
    "mechanism, steps, delta",
    [
        (privacy.dp_sgd(1.0, 256, 60_000), 500, 1e-5),
        (privacy.full_batch(1.0, 10_000), 20, 1e-6),
    ],
    ids=["dp_sgd", "full_batch"],
)
def test_more_budget_never_asks_for_more_noise(mechanism, steps, delta):
    targets = [0.1, 0.5, 2.0, 8.0, 40.0, 200.0]
    noise = [
        privacy.calibrate_noise_multiplier(mechanism, steps, delta, target_epsilon=t)
        for t in targets
    ]
    assert noise == sorted(noise, reverse=True)
    assert len(set(noise)) == len(noise)


def test_a_tiny_delta_is_searched_on_the_default_grid(monkeypatch):
    """Below δ = 1e-10 the default grid's FFT round-off may exceed the coarse
    grids' δ slack (ε 4e-4 above the bound at δ = 1e-11 on one schedule)."""
    built = _spy_on_accountants(monkeypatch)
    mechanism = privacy.dp_sgd(1.0, 10**9, 10**11)
    z = privacy.calibrate_noise_multiplier(mechanism, 50, 1e-12, target_epsilon=1.0)
    assert {interval for _, interval in built} == {1e-4}
    achieved = privacy.Accountant(mechanism.with_noise_multiplier(z)).epsilon(50, 1e-12)
    assert 0.995 <= achieved <= 1.0


def test_the_rdp_search_logs_no_line_per_dropped_order(caplog):
    # dp-accounting drops RDP orders it cannot evaluate at small noise and
    # logs each one; a search visits many small multipliers.
    mechanism = privacy.virtual_clients(1.0, clients_per_round=3, num_users=100)
    rdp = privacy.Accountant(mechanism.with_noise_multiplier(0.3), "rdp")
    with caplog.at_level("WARNING", logger="absl"):
        rdp.epsilon(40, 1e-3)
        assert calibration.RDP_DROPPED_ORDER in caplog.text  # What is muted.
        caplog.clear()
        z = privacy.calibrate_noise_multiplier(
            mechanism, 40, 1e-3, target_epsilon=30.0, accountant="rdp"
        )
    assert calibration.RDP_DROPPED_ORDER not in caplog.text
    assert z < 0.3  # The search did go through the orders that are dropped.
    # The filter is gone after the search.
    with caplog.at_level("WARNING", logger="absl"):
        privacy.Accountant(mechanism.with_noise_multiplier(0.31), "rdp").epsilon(
            40, 1e-3
        )
    assert calibration.RDP_DROPPED_ORDER in caplog.text

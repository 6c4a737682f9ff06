import dataclasses
import math

import dp_accounting as dpa
import numpy as np
import pytest

from kdpemb import privacy

MNIST, BATCH, DELTA = 60_000, 256, 1e-5
# TensorFlow Privacy's MNIST tutorial: (noise multiplier, epochs, reported ε).
TF_PRIVACY_TUTORIAL = [(1.1, 60, 3.01), (1.3, 15, 1.19), (0.7, 45, 7.10)]
# The orders TensorFlow Privacy's compute_dp_sgd_privacy used.
TF_PRIVACY_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def mnist_schedule(noise_multiplier, epochs):
    mechanism = privacy.dp_sgd(noise_multiplier, BATCH, MNIST)
    return mechanism, mechanism.steps_for_epochs(epochs)


@pytest.mark.parametrize("noise, epochs, published", TF_PRIVACY_TUTORIAL)
def test_rdp_curve_reproduces_the_published_epsilon_with_the_classic_conversion(
    noise, epochs, published
):
    """Our event and step count, converted the 2019 way, give the published ε."""
    mechanism, steps = mnist_schedule(noise, epochs)
    accountant = dpa.rdp.RdpAccountant(TF_PRIVACY_ORDERS).compose(
        mechanism.event(steps)
    )
    orders = np.array(TF_PRIVACY_ORDERS)
    classic = np.min(accountant.rdp - math.log(DELTA) / (orders - 1))
    assert classic == pytest.approx(published, rel=5e-3)


@pytest.mark.parametrize("noise, epochs, published", TF_PRIVACY_TUTORIAL)
def test_modern_accountants_do_not_exceed_the_published_epsilon(
    noise, epochs, published
):
    """Tolerance: RDP in [0.75, 1] × published; PLD in [0.65 × published, RDP]."""
    mechanism, steps = mnist_schedule(noise, epochs)
    rdp = privacy.epsilon(mechanism, steps, DELTA, accountant="rdp")
    pld = privacy.epsilon(mechanism, steps, DELTA, accountant="pld")
    assert 0.75 * published <= rdp <= published
    assert 0.65 * published <= pld <= rdp


@pytest.mark.parametrize(
    "z, steps, delta", [(1.0, 1, 1e-5), (3.0, 1, 1e-6), (4.0, 16, 1e-5)]
)
def test_full_batch_pld_matches_the_analytic_gaussian_mechanism(z, steps, delta):
    """T full-batch Gaussian steps are one Gaussian with noise z/√T (Balle & Wang)."""
    mechanism = privacy.full_batch(z, num_examples=1_000)
    analytic = dpa.get_epsilon_gaussian(z / math.sqrt(steps), delta)
    pld = privacy.epsilon(mechanism, steps, delta)
    assert analytic <= pld <= analytic * 1.002 + 1e-4


@pytest.mark.parametrize(
    "mechanism, relation",
    [
        (privacy.dp_sgd(0.8, 100, 10_000), dpa.NeighboringRelation.ADD_OR_REMOVE_ONE),
        (privacy.full_batch(6.0, 10_000), dpa.NeighboringRelation.ADD_OR_REMOVE_ONE),
        (
            privacy.virtual_clients(1.0, 50, 20_000, users_per_client=2),
            dpa.NeighboringRelation.REPLACE_ONE,
        ),
        (
            privacy.gaussian_releases([(4.0, 1.0), (6.0, 2.0)], num_examples=10_000),
            dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
        ),
    ],
    ids=["poisson", "full_batch", "virtual_clients_k2", "releases"],
)
@pytest.mark.parametrize("steps", [1, 23, 150])
def test_accountants_agree_with_dp_accounting_on_the_same_event(
    mechanism, relation, steps
):
    delta = 1e-6
    event = mechanism.event(steps)
    pld = dpa.pld.PLDAccountant(relation).compose(event).get_epsilon(delta)
    assert privacy.epsilon(mechanism, steps, delta) == pytest.approx(pld, rel=2e-3)
    if relation == dpa.NeighboringRelation.ADD_OR_REMOVE_ONE:
        rdp = dpa.rdp.RdpAccountant(None, relation).compose(event).get_epsilon(delta)
        ours = privacy.epsilon(mechanism, steps, delta, accountant="rdp")
        assert ours == pytest.approx(rdp, rel=1e-9)


def test_incremental_composition_equals_a_fresh_computation():
    mechanism = privacy.dp_sgd(1.0, 128, 50_000)
    incremental = privacy.Accountant(mechanism)
    values = [incremental.epsilon(steps, 1e-6) for steps in (100, 350, 351, 1200)]
    fresh = [
        privacy.Accountant(mechanism).epsilon(s, 1e-6) for s in (100, 350, 351, 1200)
    ]
    np.testing.assert_allclose(values, fresh, rtol=1e-6)
    assert values == sorted(values)
    # Going back to fewer steps recomputes (the cache only extends forward).
    assert incremental.epsilon(100, 1e-6) == values[0]
    assert privacy.Accountant(mechanism).epsilon(200, 1e-6) == pytest.approx(
        incremental.epsilon(200, 1e-6), rel=1e-6
    )


@pytest.mark.parametrize("method", privacy.ACCOUNTANTS)
def test_epsilon_grows_with_steps_and_shrinks_with_noise(method):
    def eps(z, steps):
        return privacy.epsilon(
            privacy.dp_sgd(z, 64, 8_000), steps, 1e-5, accountant=method
        )

    assert eps(1.0, 10) < eps(1.0, 100) < eps(1.0, 1000)
    assert eps(2.0, 100) < eps(1.0, 100) < eps(0.7, 100)


@pytest.mark.parametrize("method", privacy.ACCOUNTANTS)
def test_delta_and_epsilon_are_inverse(method):
    mechanism = privacy.dp_sgd(1.1, 256, MNIST)
    accountant = privacy.Accountant(mechanism, method)
    epsilon = accountant.epsilon(2000, 1e-6)
    assert accountant.delta(2000, epsilon) == pytest.approx(1e-6, rel=0.02)
    assert (
        accountant.delta(2000, epsilon * 1.2)
        < 1e-6
        < accountant.delta(2000, epsilon / 1.2)
    )


@pytest.mark.parametrize("method", privacy.ACCOUNTANTS)
def test_zero_noise_gives_no_guarantee(method):
    mechanism = privacy.dp_sgd(0.0, 64, 8_000)
    accountant = privacy.Accountant(mechanism, method)
    assert accountant.epsilon(1, 1e-5) == math.inf
    assert accountant.delta(1, 100.0) == 1.0


def test_setup_releases_count_before_the_first_step():
    covariance = privacy.GaussianRelease(noise_std=8.0, sensitivity=1.0, name="cov")
    plain = privacy.full_batch(5.0, 10_000)
    with_setup = privacy.full_batch(5.0, 10_000, setup=(covariance,))
    accountant = privacy.Accountant(with_setup)
    assert privacy.Accountant(plain).epsilon(0, 1e-6) == 0.0
    assert accountant.epsilon(0, 1e-6) == pytest.approx(
        dpa.get_epsilon_gaussian(8.0, 1e-6), rel=2e-3
    )
    # Gaussians compose exactly: 1/z² adds up.
    combined = (5.0**-2 * 3 + 8.0**-2) ** -0.5
    assert accountant.epsilon(3, 1e-6) == pytest.approx(
        dpa.get_epsilon_gaussian(combined, 1e-6), rel=2e-3
    )


def test_pld_refuses_what_dp_accounting_cannot_model_and_rdp_accounts_it():
    fixed = privacy.dp_sgd(1.0, 256, MNIST, sampling="fixed")
    tree = privacy.tree_aggregation(8.0, steps_per_epoch=100, num_examples=6_400)
    zcdp = privacy.zcdp(rho=0.001, population=10_000)
    for mechanism in (fixed, tree, zcdp):
        with pytest.raises(privacy.UnsupportedMechanismError, match="'rdp'"):
            privacy.Accountant(mechanism, "pld")
        assert 0 < privacy.epsilon(mechanism, 100, 1e-6, accountant="rdp") < math.inf


def test_fixed_size_sampling_is_replace_one_with_sensitivity_2c():
    """dp-accounting's without-replacement RDP bound takes σ / (2C)."""
    fixed = privacy.dp_sgd(1.0, 256, MNIST, sampling="fixed")
    assert fixed.neighboring_relation == dpa.NeighboringRelation.REPLACE_ONE
    reference = dpa.rdp.RdpAccountant(None, dpa.NeighboringRelation.REPLACE_ONE)
    halved = dpa.SampledWithoutReplacementDpEvent(MNIST, 256, dpa.GaussianDpEvent(0.5))
    reference.compose(halved, 500)
    assert privacy.epsilon(fixed, 500, 1e-6, accountant="rdp") == pytest.approx(
        reference.get_epsilon(1e-6), rel=1e-9
    )


@pytest.mark.parametrize("method", privacy.ACCOUNTANTS)
def test_replace_one_full_batch_equals_add_remove_with_half_the_noise(method):
    """Replacing a unit moves a clipped sum by 2C: a Gaussian of multiplier z/2."""
    k4 = privacy.virtual_clients(
        2.0, None, 4_000, users_per_client=4, sampling="full_batch"
    )
    add_remove = privacy.full_batch(1.0, 4_000)
    assert privacy.epsilon(k4, 50, 1e-6, accountant=method) == pytest.approx(
        privacy.epsilon(add_remove, 50, 1e-6, accountant=method), rel=1e-3
    )


def test_fixed_batches_of_everything_equal_the_replace_one_full_batch():
    """At q = 1 sampling without replacement is the full batch: same RDP."""
    everything = privacy.dp_sgd(2.0, 1_000, 1_000, sampling="fixed")
    add_remove_half_noise = privacy.full_batch(1.0, 1_000)
    assert privacy.epsilon(everything, 100, 1e-4, accountant="rdp") == pytest.approx(
        privacy.epsilon(add_remove_half_noise, 100, 1e-4, accountant="rdp"), rel=0.02
    )


def test_zcdp_epsilon_is_below_the_classic_conversion():
    """ρ-zCDP implies (ρ + 2√(ρ log(1/δ)), δ)-DP (Bun & Steinke 2016)."""
    rho, steps, delta = 0.002, 50, 1e-6
    epsilon = privacy.epsilon(privacy.zcdp(rho, 10_000), steps, delta, accountant="rdp")
    total = rho * steps
    classic = total + 2 * math.sqrt(total * math.log(1 / delta))
    assert 0.8 * classic <= epsilon <= classic


def test_tree_aggregation_composes_epochs_and_a_partial_epoch():
    mechanism = privacy.tree_aggregation(10.0, steps_per_epoch=64, num_examples=6_400)
    reference = dpa.rdp.RdpAccountant(None, dpa.NeighboringRelation.REPLACE_SPECIAL)
    tree = dpa.SingleEpochTreeAggregationDpEvent
    reference.compose(tree(10.0, 64), 3).compose(tree(10.0, 10))
    assert privacy.epsilon(
        mechanism, 3 * 64 + 10, 1e-6, accountant="rdp"
    ) == pytest.approx(reference.get_epsilon(1e-6), rel=1e-9)


@pytest.mark.parametrize("method", privacy.ACCOUNTANTS)
@pytest.mark.parametrize("target", [0.5, 2.0])
def test_max_steps_is_the_last_step_within_the_target(method, target):
    mechanism = privacy.dp_sgd(2.0, 500, 10_000)
    accountant = privacy.Accountant(mechanism, method)
    budget = accountant.max_steps(1e-5, target_epsilon=target)
    fresh = privacy.Accountant(mechanism, method)
    assert budget >= 1
    assert fresh.epsilon(budget, 1e-5) <= target < fresh.epsilon(budget + 1, 1e-5)
    assert (
        accountant.max_steps(1e-5, target_epsilon=target, limit=budget // 2)
        == budget // 2
    )
    assert accountant.max_steps(1e-5, target_epsilon=target, limit=budget + 5) == budget


def test_max_steps_is_zero_when_one_step_is_too_many():
    accountant = privacy.Accountant(privacy.full_batch(0.5, 10_000))
    assert accountant.max_steps(1e-6, target_epsilon=0.1) == 0


@pytest.mark.parametrize(
    "delta, message",
    [
        (0.0, r"in \(0, 1\)"),
        (1.0, r"in \(0, 1\)"),
        (-1e-5, r"in \(0, 1\)"),
        (1e-4, "1/population"),
        (float("nan"), "finite"),
        ("1e-5", "finite"),
    ],
)
def test_bad_delta_is_refused_with_the_reason(delta, message):
    mechanism = privacy.dp_sgd(1.0, 100, 10_000)
    with pytest.raises(ValueError, match=message):
        privacy.Accountant(mechanism).epsilon(10, delta)


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_schedules_without_steps_are_refused(steps):
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        privacy.epsilon(privacy.dp_sgd(1.0, 100, 10_000), steps, 1e-6)


def test_accountant_refuses_unknown_methods_and_non_mechanisms():
    with pytest.raises(ValueError, match="pld"):
        privacy.Accountant(privacy.dp_sgd(1.0, 100, 10_000), "prv")
    with pytest.raises(TypeError, match="Mechanism"):
        privacy.Accountant(dpa.GaussianDpEvent(1.0))


# One Gaussian: the exact (analytic) privacy loss -----------------------------

ONE_GAUSSIAN = [
    ("full_batch", privacy.full_batch(3.0, 10_000), 7),
    ("full_batch_small_z", privacy.full_batch(0.4, 10_000), 3),
    (
        "releases_with_setup",
        privacy.gaussian_releases(
            [(4.0, 1.0), (6.0, 2.0)], num_examples=10_000, setup=[(20.0, 1.0)]
        ),
        5,
    ),
    (
        "virtual_clients_full_batch_k4",
        privacy.virtual_clients(
            2.0, None, 40_000, users_per_client=4, sampling="full_batch"
        ),
        12,
    ),
]


@pytest.mark.parametrize("delta", [1e-5, 1e-9])
@pytest.mark.parametrize(
    "mechanism, steps", [c[1:] for c in ONE_GAUSSIAN], ids=[c[0] for c in ONE_GAUSSIAN]
)
def test_one_gaussian_is_exact_and_within_dp_accountings_pessimistic_pld(
    mechanism, steps, delta
):
    """The closed form is exact: at or just below dp-accounting's PLD bound."""
    relation = mechanism.neighboring_relation
    reference = dpa.pld.PLDAccountant(relation).compose(mechanism.event(steps))
    pld = reference.get_epsilon(delta)
    accountant = privacy.Accountant(mechanism)
    assert accountant.exact
    exact = accountant.epsilon(steps, delta)
    assert pld * (1 - 1e-3) - 1e-4 <= exact <= pld * (1 + 1e-9)
    # And δ at that ε agrees too (dp-accounting's δ is an upper bound).
    assert accountant.delta(steps, pld) <= reference.get_delta(pld) * (1 + 1e-6)
    assert accountant.delta(steps, exact) == pytest.approx(delta, rel=1e-6)


@pytest.mark.parametrize("noise, sensitivity", [(0.3, 1.0), (1.0, 1.0), (5.0, 2.0)])
@pytest.mark.parametrize("epsilon", [0.05, 0.5, 2.0, 8.0])
def test_closed_form_delta_equals_the_integral_of_the_hockey_stick(
    noise, sensitivity, epsilon
):
    """δ(ε) = ∫ max(0, p(x) - e^ε q(x)) dx for p = N(Δ, σ²), q = N(0, σ²)."""
    from scipy import integrate, stats

    from kdpemb.privacy import analytic_gaussian

    def hockey_stick(x):
        p = stats.norm.pdf(x, loc=sensitivity, scale=noise)
        q = stats.norm.pdf(x, scale=noise)
        return max(p - math.exp(epsilon) * q, 0.0)

    # The integrand is positive where the privacy loss exceeds ε.
    start = noise**2 * epsilon / sensitivity + sensitivity / 2
    integral, _ = integrate.quad(
        hockey_stick, start, start + 40 * noise, epsabs=0, epsrel=1e-10, limit=200
    )
    closed = analytic_gaussian.delta_for_epsilon(noise / sensitivity, epsilon)
    assert closed == pytest.approx(integral, rel=1e-7)


@pytest.mark.parametrize("z", [0.5, 2.0, 8.0])
def test_replace_one_full_batch_is_the_gaussian_of_twice_the_sensitivity(z):
    """Replacing one unit moves the clipped sum from -C to +C: Δ = 2C."""
    from kdpemb.privacy import analytic_gaussian

    k4 = privacy.virtual_clients(
        z, None, 4_000, users_per_client=4, sampling="full_batch"
    )
    accountant = privacy.Accountant(k4)
    assert accountant.exact
    for epsilon in (0.5, 3.0):
        assert accountant.delta(1, epsilon) == pytest.approx(
            analytic_gaussian.delta_for_epsilon(z / 2, epsilon), rel=1e-12
        )
        assert accountant.delta(1, epsilon) > analytic_gaussian.delta_for_epsilon(
            z, epsilon
        )


def test_the_closed_form_agrees_with_dp_accountings_own_analytic_gaussian():
    from kdpemb.privacy import analytic_gaussian

    for noise in (0.01, 0.1, 0.7, 3.0, 300.0):
        for delta in (1e-3, 1e-6, 1e-12):
            ours = analytic_gaussian.epsilon_for_delta(noise, delta)
            theirs = dpa.get_epsilon_gaussian(noise, delta)
            assert ours == pytest.approx(theirs, rel=1e-8, abs=1e-12)
            # Rounded up: δ at our ε meets the target, and 1e-6 less does not.
            assert analytic_gaussian.delta_for_epsilon(noise, ours) <= delta * (
                1 + 1e-8
            )
            if ours > 0:
                assert analytic_gaussian.delta_for_epsilon(noise, ours * 0.999999) > (
                    delta
                )
    for epsilon in (0.1, 1.0, 30.0, 1000.0):
        noise = analytic_gaussian.noise_for_epsilon(epsilon, 1e-6)
        assert noise == pytest.approx(dpa.get_sigma_gaussian(epsilon, 1e-6), rel=1e-9)
        assert analytic_gaussian.epsilon_for_delta(noise, 1e-6) <= epsilon * (1 + 1e-12)
        assert analytic_gaussian.epsilon_for_delta(noise * 0.999999, 1e-6) > epsilon


def test_log_ndtr_is_accurate_in_both_tails():
    from scipy import special

    from kdpemb.privacy import analytic_gaussian

    for x in np.concatenate([np.linspace(-80, 8, 881), -np.logspace(1, 4, 31)]):
        assert analytic_gaussian.log_ndtr(float(x)) == pytest.approx(
            special.log_ndtr(x), rel=1e-12, abs=1e-300
        )


# σ/Δ from 0.5 to 1e7, log-spaced: up to where δ(ε) is a difference of
# two terms 1e7 times larger (issue 31, item 5).
EXACT_NOISES = [float(s) for s in np.geomspace(0.5, 1e7, 30)]
EXACT_DELTAS = [1e-3, 1e-5, 1e-8, 1e-10, 1e-12]


def exact_delta(noise, epsilon):
    """δ(ε) of Balle and Wang's Theorem 8 at 60 digits (mpmath)."""
    import mpmath

    with mpmath.workdps(60):
        noise, epsilon = mpmath.mpf(noise), mpmath.mpf(epsilon)
        shift, scaled = 1 / (2 * noise), epsilon * noise
        return mpmath.ncdf(shift - scaled) - mpmath.exp(epsilon) * mpmath.ncdf(
            -shift - scaled
        )


def exact_epsilon(noise, delta, guess):
    """The smallest ε with δ(ε) <= delta, by bisection at 60 digits: an upper
    end within 1e-25 relative of it (0 if δ(0) <= delta). `guess` only
    narrows the first bracket, which is checked (else ε in [0, 1e4])."""
    import mpmath

    with mpmath.workdps(60):
        if exact_delta(noise, 0) <= delta:
            return mpmath.mpf(0)
        low, high = (
            mpmath.mpf(guess) * (1 - mpmath.mpf("1e-4")),
            mpmath.mpf(guess) * (1 + mpmath.mpf("1e-4")),
        )
        if not (exact_delta(noise, low) > delta >= exact_delta(noise, high)):
            low, high = mpmath.mpf(0), mpmath.mpf(10_000)
        while high - low > high * mpmath.mpf("1e-25"):
            middle = (low + high) / 2
            if exact_delta(noise, middle) <= delta:
                high = middle
            else:
                low = middle
        return high


@pytest.mark.parametrize("delta", EXACT_DELTAS)
def test_the_closed_form_is_rounded_up_against_60_digits(delta):
    """ε(δ), δ(ε) and σ(ε, δ) are never below the exact values (mpmath, 60
    digits), at σ/Δ from 0.5 to 1e7, and within 1e-6 relative of them."""
    from kdpemb.privacy import analytic_gaussian

    for noise in EXACT_NOISES:
        ours = analytic_gaussian.epsilon_for_delta(noise, delta)
        exact = exact_epsilon(noise, delta, ours)
        assert ours >= exact, (noise, ours, float(exact))
        assert ours <= exact * (1 + 1e-6) + 1e-300, (noise, ours, float(exact))
        if exact == 0:
            continue
        # δ at the exact ε (and at ours) is rounded up, and not by much.
        for epsilon in (float(exact), ours):
            stated = analytic_gaussian.delta_for_epsilon(noise, epsilon)
            true = exact_delta(noise, epsilon)
            assert true <= stated <= true * (1 + 1e-6), (noise, epsilon)
        # σ for ε = ours: the exact σ is at most `noise` (ours >= exact ε).
        sigma = analytic_gaussian.noise_for_epsilon(ours, delta)
        assert exact_delta(sigma, ours) <= delta, (noise, sigma)
        assert sigma <= noise * (1 + 1e-6), (noise, sigma)


def test_sampled_schedules_never_get_the_closed_form(monkeypatch):
    """Poisson steps (alone or after Gaussian releases) go through the PLD."""
    from kdpemb.privacy import analytic_gaussian

    def refuse(*args):
        raise AssertionError("closed form used for a sampled schedule")

    monkeypatch.setattr(analytic_gaussian, "epsilon_for_delta", refuse)
    monkeypatch.setattr(analytic_gaussian, "delta_for_epsilon", refuse)
    covariance = privacy.GaussianRelease(noise_std=10.0, sensitivity=1.0)
    sampled = [
        privacy.dp_sgd(0.8, 100, 10_000),
        privacy.virtual_clients(1.0, 50, 20_000, users_per_client=2),
        dataclasses.replace(privacy.dp_sgd(0.8, 100, 10_000), setup=(covariance,)),
    ]
    for mechanism in sampled:
        accountant = privacy.Accountant(mechanism)
        assert not accountant.exact
        event = mechanism.event(40)
        reference = dpa.pld.PLDAccountant(mechanism.neighboring_relation)
        pld = reference.compose(event).get_epsilon(1e-6)
        assert accountant.epsilon(40, 1e-6) == pytest.approx(pld, rel=1e-9)
        assert accountant.delta(40, 1.0) == pytest.approx(
            reference.get_delta(1.0), rel=1e-9
        )
    # The same patch breaks the unsampled case: it does use the closed form.
    with pytest.raises(AssertionError, match="closed form"):
        privacy.Accountant(privacy.full_batch(1.0, 1_000)).epsilon(3, 1e-6)
    assert not privacy.Accountant(privacy.full_batch(1.0, 1_000), "rdp").exact


@pytest.mark.parametrize(
    "mechanism",
    [
        privacy.dp_sgd(1.0, batch_size=100, num_examples=10_000),
        privacy.virtual_clients(1.0, 50, 20_000, users_per_client=2),
    ],
    ids=["poisson", "virtual_clients_k2"],
)
def test_a_wide_loss_range_coarsens_the_grid_and_stays_an_upper_bound(
    monkeypatch, mechanism
):
    """Where one step would need more than MAX_PLD_POINTS grid steps, the grid
    is the loss range / MAX_PLD_POINTS: ε is then dp-accounting's own PLD on
    that grid, and at least its ε on the finer grid asked for."""
    from kdpemb.privacy import accountant as accountant_module

    monkeypatch.setattr(accountant_module, "MAX_PLD_POINTS", 2**12)
    steps, fine = 20, 1e-4
    event = mechanism.event(steps)
    relation = mechanism.neighboring_relation
    accountant = privacy.Accountant(mechanism, "pld")
    coarse = accountant.value_discretization_interval_used
    assert coarse > 10 * fine  # The range is wider than 2**12 · 1e-4.
    got = accountant.epsilon(steps, 1e-6)
    reference = dpa.pld.PLDAccountant(relation, coarse).compose(event)
    assert got == pytest.approx(reference.get_epsilon(1e-6), rel=1e-9)
    finer = dpa.pld.PLDAccountant(relation, fine).compose(event)
    assert got >= finer.get_epsilon(1e-6)
    assert got <= 1.05 * finer.get_epsilon(1e-6)


def test_the_closed_form_at_tiny_noise_is_no_guarantee_and_does_not_overflow():
    # The rounding bound grows as 1/σ²; δ stays at most 1 (and ε finite).
    from kdpemb.privacy import analytic_gaussian

    for noise in (1e-6, 1e-10, 1e-150):
        assert analytic_gaussian.delta_for_epsilon(noise, 0.0) == 1.0
        assert analytic_gaussian.delta_for_epsilon(noise, 1.0) <= 1.0
        assert analytic_gaussian.epsilon_for_delta(noise, 1e-5) > 1e6
    mechanism = privacy.full_batch(1e-6, num_examples=1000)
    assert privacy.delta(mechanism, 10**6, 1.0) == 1.0

"""The user-level sensitivity argument for virtual clients, checked numerically.

One round sums the clipped updates (norm <= C) of Poisson-sampled virtual
clients and adds N(0, (zC)² I). Removing one user:
- k = 1: removes that user's virtual client's update: the output pair is
  (1-q)·N(0) + q·N(u) against N(0), with ‖u‖ <= C (add/remove).
- k > 1: changes the content of one virtual client, whose update u becomes
  any u' in the C-ball: the pair is (1-q)·N(0) + q·N(u) against
  (1-q)·N(0) + q·N(u') (replace-one); the other clients' sum is the same
  in both worlds and is post-processing.
Here the hockey-stick divergence δ(ε) of those pairs is integrated on a
grid and compared with what kdpemb reports.
"""

import numpy as np
import pytest
from scipy import stats

from kdpemb import privacy
from kdpemb.privacy import mechanisms

SIGMA_GRID = np.linspace(-14.0, 14.0, 400_001)


def _mixture(x, q, shift, sigma):
    return (1 - q) * stats.norm.pdf(x, 0.0, sigma) + q * stats.norm.pdf(x, shift, sigma)


def _hockey_stick(p, q, epsilon, x):
    return np.trapezoid(np.maximum(p - np.exp(epsilon) * q, 0.0), x)


def exact_delta(q, z, epsilon, relation):
    """δ(ε) of one round, for clip norm 1 and noise std z, by integration."""
    x = SIGMA_GRID * max(z, 1.0)
    if relation == "replace":
        p, r = _mixture(x, q, -1.0, z), _mixture(x, q, 1.0, z)
        return _hockey_stick(p, r, epsilon, x)
    with_unit, without = _mixture(x, q, 1.0, z), stats.norm.pdf(x, 0.0, z)
    return max(
        _hockey_stick(with_unit, without, epsilon, x),
        _hockey_stick(without, with_unit, epsilon, x),
    )


def reported_delta(users_per_client, q, z, epsilon):
    num_users = 10_000 * users_per_client
    pool = mechanisms.num_virtual_clients(num_users, users_per_client)
    mechanism = privacy.virtual_clients(
        z,
        clients_per_round=q * pool,
        num_users=num_users,
        users_per_client=users_per_client,
    )
    return privacy.Accountant(mechanism, "pld").delta(steps=1, epsilon=epsilon)


# The grid integral is accurate to ~1e-9 relative; PLD rounds pessimistically
# (never below the exact δ) and stays within 1% of it.
INTEGRATION_RTOL = 1e-6

CASES = [(0.3, 0.8, 0.5), (0.3, 0.8, 1.5), (0.05, 1.2, 0.3), (1.0, 2.0, 0.5)]


@pytest.mark.parametrize("q, z, epsilon", CASES)
def test_one_user_per_client_reports_the_add_remove_delta(q, z, epsilon):
    exact = exact_delta(q, z, epsilon, "add_remove")
    reported = reported_delta(1, q, z, epsilon)
    assert exact * (1 - INTEGRATION_RTOL) <= reported <= exact * 1.01 + 1e-9


@pytest.mark.parametrize("q, z, epsilon", CASES)
def test_several_users_per_client_report_the_replace_one_delta(q, z, epsilon):
    exact = exact_delta(q, z, epsilon, "replace")
    reported = reported_delta(4, q, z, epsilon)
    assert exact * (1 - INTEGRATION_RTOL) <= reported <= exact * 1.01 + 1e-9


@pytest.mark.parametrize("q, z, epsilon", CASES)
def test_add_remove_with_z_would_under_report_and_with_half_z_is_loose(q, z, epsilon):
    """The two tempting shortcuts for k > 1: one unsound, one needlessly loose."""
    true_delta = exact_delta(q, z, epsilon, "replace")
    assert exact_delta(q, z, epsilon, "add_remove") < 0.9 * true_delta
    half_noise = exact_delta(q, z / 2, epsilon, "add_remove")
    if q == 1:  # Full batch: replace-one is exactly a sensitivity of 2C.
        assert half_noise == pytest.approx(true_delta, rel=INTEGRATION_RTOL)
    else:
        assert half_noise > 1.1 * true_delta


def _delta_2d(q, z, u, v, epsilon, grid):
    xx, yy = grid

    def density(shift):
        gauss = stats.norm.pdf(xx - shift[0], 0, z) * stats.norm.pdf(
            yy - shift[1], 0, z
        )
        base = stats.norm.pdf(xx, 0, z) * stats.norm.pdf(yy, 0, z)
        return (1 - q) * base + q * gauss

    p, r = density(u), density(v)
    cell = (xx[0, 1] - xx[0, 0]) * (yy[1, 0] - yy[0, 0])
    return float(np.sum(np.maximum(p - np.exp(epsilon) * r, 0.0)) * cell)


def test_antipodal_updates_are_the_worst_case_in_the_clip_ball():
    """Any two updates in the C-ball leak no more than +C and -C do."""
    q, z, epsilon = 0.3, 0.8, 0.5
    axis = np.linspace(-7.0, 7.0, 701)
    grid = np.meshgrid(axis, axis)
    worst = _delta_2d(q, z, (1.0, 0.0), (-1.0, 0.0), epsilon, grid)
    assert worst == pytest.approx(exact_delta(q, z, epsilon, "replace"), rel=1e-3)
    rng = np.random.default_rng(0)
    pairs = [
        ((1.0, 0.0), (0.0, 0.0)),
        ((1.0, 0.0), (0.0, 1.0)),
        ((0.5, 0.0), (-0.5, 0)),
    ]
    for _ in range(12):
        a, b = rng.normal(size=(2, 2))
        ra, rb = rng.uniform(size=2) ** 0.5
        pairs.append(
            (tuple(ra * a / np.linalg.norm(a)), tuple(rb * b / np.linalg.norm(b)))
        )
    for u, v in pairs:
        assert _delta_2d(q, z, u, v, epsilon, grid) <= worst + 1e-9


def test_virtual_client_epsilon_matches_dp_accounting_for_its_relation():
    import dp_accounting as dpa

    q, z, steps, delta = 0.01, 0.9, 500, 1e-6
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps
    )
    for k, relation in [
        (1, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE),
        (3, dpa.NeighboringRelation.REPLACE_ONE),
    ]:
        mechanism = privacy.virtual_clients(
            z,
            clients_per_round=q * 10_000,
            num_users=30_000 if k == 3 else 10_000,
            users_per_client=k,
        )
        reference = dpa.pld.PLDAccountant(relation).compose(event).get_epsilon(delta)
        ours = privacy.epsilon(mechanism, steps, delta)
        assert ours == pytest.approx(reference, rel=1e-3)
    k1 = privacy.epsilon(privacy.virtual_clients(z, 100, 10_000), steps, delta)
    k3 = privacy.epsilon(
        privacy.virtual_clients(z, 100, 30_000, users_per_client=3), steps, delta
    )
    assert k3 > 1.2 * k1  # Same q and z: the 2C sensitivity costs privacy.


def test_rdp_refuses_virtual_clients_of_several_users():
    mechanism = privacy.virtual_clients(1.0, 64, 10_000, users_per_client=4)
    with pytest.raises(privacy.UnsupportedMechanismError, match=r"replace-one.*'pld'"):
        privacy.Accountant(mechanism, "rdp")
    with pytest.raises(privacy.UnsupportedMechanismError):
        privacy.epsilon(mechanism, 10, 1e-6, accountant="rdp")
    # With one user per client RDP applies (add/remove) and is looser than PLD.
    single = privacy.virtual_clients(1.0, 64, 10_000)
    rdp = privacy.epsilon(single, 1000, 1e-6, accountant="rdp")
    assert rdp >= privacy.epsilon(single, 1000, 1e-6)

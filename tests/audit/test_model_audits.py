"""Audits of the models' own training: below the claimed ε for the real
mechanisms, above it for each broken variant (noise / 10, clipping removed).

Every audit is seeded (data and noise), so each test is deterministic on
its backend. With these trial counts on seeds 0-4 (`python
examples/audit_dp_sgd.py --quick --seeds 5`), the real bounds stay below
0.61 and the broken ones above 3.3, on both backends, against claims of
1.99.
"""

import dp_accounting
import pytest

from kdpemb import audit

DELTA = 1e-5
BROKEN = ["noise_divided_by_10", "clipping_removed"]


def gaussian_epsilon(noise_multiplier, steps):
    """ε of `steps` full-batch Gaussian steps (add/remove), from dp-accounting."""
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), steps)
    return accountant.get_epsilon(DELTA)


AUDITS = {
    "DPModel white-box": (lambda: audit.audit_dp_model(2.0, DELTA, seed=0), 2.0, 1),
    "DPModel black-box": (
        lambda: audit.audit_dp_model(4.0, DELTA, mode="black-box", steps=4, seed=0),
        4.0,
        4,
    ),
    "LastLayerDPClassifier dp-sgd": (
        lambda: audit.audit_last_layer_dp_sgd(2.0, DELTA, seed=0),
        2.0,
        1,
    ),
    "FedEmbModel round": (
        lambda: audit.audit_fedemb_round(2.0, DELTA, seed=0),
        2.0,
        1,
    ),
}


@pytest.mark.parametrize("name", AUDITS)
def test_model_audit_stays_below_the_models_own_claim(name):
    run, noise_multiplier, steps = AUDITS[name]
    result = run()
    # The claim is the unamplified Gaussian (full-batch steps), composed.
    assert result.claimed_epsilon == pytest.approx(
        gaussian_epsilon(noise_multiplier, steps), rel=1e-3
    )
    assert 1.5 < result.claimed_epsilon < 2.5
    assert not result.violated, result


@pytest.mark.parametrize("broken", BROKEN)
@pytest.mark.parametrize("name", AUDITS)
def test_model_audit_catches_the_broken_variant(name, broken, request):
    request.getfixturevalue(broken)
    result = AUDITS[name][0]()
    assert result.violated, result


def dp_ls_audit():
    return audit.audit_last_layer_dp_ls(2.0, DELTA, trials=1200, seed=0)


def test_last_layer_dp_ls_audit_stays_below_the_claimed_epsilon():
    result = dp_ls_audit()
    assert result.claimed_epsilon == pytest.approx(gaussian_epsilon(2.0, 1), rel=1e-3)
    assert not result.violated, result


def test_last_layer_dp_ls_audit_catches_noise_divided_by_10(host_noise_divided_by_10):
    result = dp_ls_audit()
    assert result.violated, result


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"mode": "grey-box"}, "mode must be one of"),
        ({"steps": 3}, "white-box audit observes one step"),
        ({"trials": 6}, "trials must be >= 8"),
        ({"num_classes": 1}, "num_classes must be >= 2"),
    ],
)
def test_audit_dp_model_refuses_bad_arguments(arguments, message):
    with pytest.raises(ValueError, match=message):
        audit.audit_dp_model(2.0, DELTA, **arguments)

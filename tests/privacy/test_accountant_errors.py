"""The accountant's errors are kdpemb's, in one line, never dp-accounting's
dump of the events; RDP orders that would state ε = 0 are refused."""

import pytest

from kdpemb import privacy
from kdpemb.errors import AccountingError, UnsupportedMechanismError

MNIST = privacy.dp_sgd(1.0, batch_size=256, num_examples=60_000)


def fixed_size():
    return privacy.dp_sgd(1.0, batch_size=256, num_examples=60_000, sampling="fixed")


def virtual_clients():
    return privacy.virtual_clients(1.0, 10, 100, users_per_client=2)


@pytest.mark.parametrize(
    "mechanism, accountant, cause",
    [
        (fixed_size, "pld", "(dp-accounting: Unsupported event"),
        (virtual_clients, "rdp", "(dp-accounting: neighboring_relation must be"),
    ],
    ids=["pld_fixed_size", "rdp_replace_one"],
)
def test_an_unsupported_mechanism_says_why_in_one_line(mechanism, accountant, cause):
    with pytest.raises(UnsupportedMechanismError) as caught:
        privacy.epsilon(mechanism(), 10, 1e-5, accountant=accountant)
    message = str(caught.value)
    assert cause in message
    assert "\n" not in message and len(message) < 600
    # No repr of dp-accounting's events (kilobytes for a composed schedule).
    assert "DpEvent(" not in message and "SelfComposed" not in message
    other = "rdp" if accountant == "pld" else "pld"
    assert f"accountant={other!r}" in message


@pytest.mark.parametrize(
    "orders", [[], [float("inf")], [1], [0.5, 2], [float("nan")], "2", [True]]
)
def test_rdp_orders_that_would_misstate_epsilon_are_refused(orders):
    # dp-accounting states ε = 0 for no orders or only infinite ones.
    with pytest.raises((ValueError, TypeError), match="rdp_orders"):
        privacy.Accountant(MNIST, "rdp", rdp_orders=orders)


def test_valid_rdp_orders_are_used():
    few = privacy.Accountant(MNIST, "rdp", rdp_orders=[2, 4.5, 8])
    default = privacy.Accountant(MNIST, "rdp")
    assert few.epsilon(100, 1e-5) >= default.epsilon(100, 1e-5) > 0


def test_a_failure_inside_dp_accounting_is_a_one_line_kdpemb_error():
    # An order dp-accounting cannot evaluate: its numpy error, reworded.
    with pytest.raises(AccountingError) as caught:
        privacy.Accountant(MNIST, "rdp", rdp_orders=[2.0, 1e300]).epsilon(10, 1e-5)
    error = caught.value
    message = str(error)
    assert message.startswith("The RDP accountant (dp-accounting) failed on")
    assert "noise_multiplier=1.0" in message and "accountant='pld'" in message
    assert "\n" not in message and error.detail
    assert error.__cause__ is None and error.__suppress_context__


def test_a_kdpemb_check_inside_the_accountant_is_not_reworded():
    # kdpemb's own refusal (a loss range too wide for any grid) stays as is.
    with pytest.raises(
        ValueError, match=r"noise multiplier of at least 0\.01"
    ) as caught:
        privacy.epsilon(MNIST.with_noise_multiplier(1e-4), 10, 1e-5, accountant="pld")
    assert not isinstance(caught.value, AccountingError)

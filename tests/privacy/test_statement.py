import json
import math

import pytest
from rich.console import Console

from kdpemb import privacy


@pytest.fixture(scope="module")
def statement():
    mechanism = privacy.virtual_clients(
        0.9, 50, 20_000, users_per_client=4, clip_norm=0.1
    )
    return privacy.PrivacyStatement.compute(mechanism, 1_000, 1e-6)


def test_statement_names_unit_relation_sampling_and_accountant(statement):
    assert statement.unit == "user"
    assert statement.neighboring_relation == "replace_one"
    assert "2C" in statement.relation_description
    assert statement.sampling == "poisson"
    assert statement.accountant == "pld"
    assert (statement.steps, statement.noise_multiplier, statement.clip_norm) == (
        1_000,
        0.9,
        0.1,
    )
    mechanism = privacy.virtual_clients(0.9, 50, 20_000, users_per_client=4)
    assert statement.epsilon == privacy.epsilon(mechanism, 1_000, 1e-6)
    summary = statement.summary()
    assert "per user" in summary and "PLD" in summary and "1000 steps" in summary


def test_statement_json_round_trip_has_the_required_fields(statement):
    data = json.loads(statement.to_json())
    for key in ("epsilon", "delta", "noise_multiplier", "steps", "accountant", "unit"):
        assert key in data
    assert privacy.PrivacyStatement.from_json(statement.to_json()) == statement


def test_statement_renders_as_a_rich_table(statement):
    console = Console(record=True, width=120)
    console.print(statement)
    text = console.export_text()
    assert "Privacy statement" in text and f"{statement.epsilon:.4g}" in text
    assert "replace_one" in text and "user" in text


def test_no_noise_is_stated_as_no_guarantee_and_stays_valid_json():
    statement = privacy.PrivacyStatement.compute(
        privacy.dp_sgd(0.0, 10, 1_000), 5, 1e-5
    )
    assert not statement.is_private and math.isinf(statement.epsilon)
    assert json.loads(statement.to_json())["epsilon"] is None
    assert privacy.PrivacyStatement.from_json(statement.to_json()).epsilon == math.inf
    assert "NO differential privacy" in statement.summary()


def test_statement_refuses_an_accountant_of_another_mechanism():
    accountant = privacy.Accountant(privacy.dp_sgd(1.0, 10, 1_000))
    with pytest.raises(ValueError, match="another mechanism"):
        privacy.PrivacyStatement.compute(
            privacy.dp_sgd(2.0, 10, 1_000), 5, 1e-5, accountant
        )


def test_a_single_step_is_stated_in_the_singular():
    mechanism = privacy.full_batch(2.0, 1_000, clip_norm=1.0)
    one = privacy.PrivacyStatement.compute(mechanism, 1, 1e-6).summary()
    two = privacy.PrivacyStatement.compute(mechanism, 2, 1e-6).summary()
    assert "; 1 step;" in one and "; 2 steps;" in two

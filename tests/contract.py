"""The contract every private model keeps, checked in one call.

As keras-hub's `run_backbone_test`: one harness, run on every private
model (`tests/test_private_model_contract.py`), so that a new trainer is
held to the same promises as the old ones:

1. it implements the privacy protocol: a `private_steps` variable that
   starts at 0, and a `privacy_mechanism()` (which may ask for a first
   `fit` when the schedule comes from the data);
2. `fit` counts exactly one private step per `train_step`, and
   `PrivacyBudget` reports the ε that an independent accountant gives;
3. the statement names the model's unit, steps and δ;
4. `save` / `load` keeps the count, and a loaded model keeps counting;
5. a loaded model draws noise that the saved file does not predict (two
   loads of one file, trained on the same data, end apart);
6. a fit that would go past a target ε is refused before any step, with
   the weights and the count untouched.
"""

import dataclasses
from collections.abc import Callable

import keras
import numpy as np
import pytest

from kdpemb import privacy
from kdpemb.callbacks import PrivacyBudget
from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.privacy import protocol


@dataclasses.dataclass
class ContractCase:
    """How to build and fit one private model for the contract.

    Attributes:
        name: str. For messages.
        build: `() -> keras.Model`, compiled, with no fixed seed.
        fit: `(model, epochs, callbacks) -> History`, on fixed data.
        steps_per_epoch: int. Private steps one epoch takes.
        unit: str. "example" or "user".
        delta: float. δ for the budget and the statement.
        first_epochs: int. Epochs of the first fit (1 for a one-step method).
    """

    name: str
    build: Callable
    fit: Callable
    steps_per_epoch: int
    unit: str
    delta: float
    first_epochs: int = 2


def weights(model):
    return np.concatenate(
        [np.ravel(keras.ops.convert_to_numpy(w)) for w in model.trainable_weights]
    )


def steps(model):
    return protocol.read_private_steps(model)


def run_private_model_contract(case, tmp_path):
    """Checks the whole contract on `case`; see the module docstring."""
    model = case.build()
    # 1. The protocol.
    assert steps(model) == 0, case.name
    try:
        assert isinstance(model.privacy_mechanism(), privacy.Mechanism)
    except ValueError as error:  # The schedule comes from the first fit.
        assert "fit" in str(error), error

    # 2. One private step per train_step; ε as an independent accountant says.
    budget = PrivacyBudget(delta=case.delta, verbose=0)
    history = case.fit(model, case.first_epochs, [budget])
    taken = steps(model)
    assert taken == case.first_epochs * case.steps_per_epoch, case.name
    mechanism = model.privacy_mechanism()
    assert mechanism.unit == case.unit
    expected = privacy.Accountant(mechanism).epsilon(taken, case.delta)
    assert history.history["epsilon"][-1] == pytest.approx(expected, rel=1e-3)
    assert len(history.history["epsilon"]) == case.first_epochs
    assert history.history["epsilon"][0] <= history.history["epsilon"][-1]

    # 3. The statement.
    statement = privacy.privacy_statement(model, case.delta)
    assert (statement.unit, statement.steps) == (case.unit, taken)
    assert statement.epsilon == pytest.approx(expected, rel=1e-3)
    # The callback composes epoch by epoch, which may round ε differently.
    assert budget.statement.epsilon == pytest.approx(statement.epsilon, rel=1e-3)
    assert dataclasses.replace(budget.statement, epsilon=statement.epsilon) == statement

    # 4. Save, load, keep counting.
    path = str(tmp_path / f"{case.name}.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert steps(loaded) == taken
    assert loaded.privacy_mechanism() == mechanism
    np.testing.assert_array_equal(weights(loaded), weights(model))
    case.fit(loaded, 1, [])
    assert steps(loaded) == taken + case.steps_per_epoch

    # 5. Fresh noise after loading: the file does not predict it.
    again = keras.saving.load_model(path)
    case.fit(again, 1, [])
    assert not np.allclose(weights(again), weights(loaded)), (
        f"{case.name}: two loads of one file trained alike: the noise (or "
        "the sampling) was restored from the file"
    )

    # 6. Refusal past a target, before any step.
    epsilons = [
        privacy.Accountant(mechanism).epsilon(taken + extra, case.delta)
        for extra in (0, 1)
    ]
    target = (epsilons[0] + epsilons[1]) / 2  # Met now, not after one step.
    before = weights(model)
    refusing = PrivacyBudget(delta=case.delta, target_epsilon=target, verbose=0)
    with pytest.raises(PrivacyBudgetExhaustedError, match="No privacy budget"):
        case.fit(model, 1, [refusing])
    assert steps(model) == taken
    np.testing.assert_array_equal(weights(model), before)

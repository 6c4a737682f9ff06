"""`.keras` files saved by kdpemb 0.1.0 (before its trainers moved into
packages) still load, state their mechanism and keep counting.

The files were made once by `tests/fixtures/saved_models/make_saved_models.py`
from the cases of `tests/test_private_model_contract.py`; each was fitted
for the contract's first epochs and saved.
"""

import json
import pathlib

import keras
import pytest

from kdpemb.privacy import protocol
from tests.test_private_model_contract import CASES

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "saved_models"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
# Contract cases of models that 0.1.0 could not build: no file to load.
NEW_SINCE_0_1 = {"dp_model_user"}  # DPModel(unit="user"), 0.2.0.


def test_every_private_model_of_the_contract_has_a_saved_file():
    assert sorted(MANIFEST) == sorted(set(CASES) - NEW_SINCE_0_1)
    assert {entry["class"] for entry in MANIFEST.values()} >= {
        "DPModel", "FedEmbModel", "LastLayerDPClassifier", "ToyDPRegressor",
    }  # fmt: skip


@pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning")
@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_a_model_saved_before_the_move_loads_and_keeps_counting(name):
    saved = MANIFEST[name]
    model = keras.saving.load_model(FIXTURES / f"{name}.keras")
    assert type(model).__name__ == saved["class"]
    assert protocol.read_private_steps(model) == saved["private_steps"]
    assert repr(model.privacy_mechanism()) == saved["mechanism"]
    assert model.compiled  # With its optimizer and loss, as saved.
    case = CASES[name]()
    case.fit(model, 1, [])
    steps = saved["private_steps"] + case.steps_per_epoch
    assert protocol.read_private_steps(model) == steps

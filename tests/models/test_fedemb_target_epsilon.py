"""FedEmbModel(target_epsilon=...): calibrated once, enforced at every fit."""

import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.models import FedEmbModel
from kdpemb.privacy import protocol
from tests.models import fedemb_reference as ref
from tests.models.test_fedemb import DELTA, tiny_clients

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]

TARGET = 2.0


def target_model(**overrides):
    settings = {
        "client_optimizer": 0.1,
        "clip_norm": 0.5,
        "target_epsilon": TARGET,
        "delta": DELTA,
        "client_parallelism": 1,
        **overrides,
    }
    model = FedEmbModel(ref.linear_backbone(), **settings)
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    return model


def dp_accounting_epsilon(z, q, steps):
    """ε of `steps` Poisson rounds at rate q under replace-one (k = 2), from
    dp-accounting itself."""
    accountant = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    accountant.compose(dpa.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


def kernel(model):
    return ref.kernel_of(model.backbone).copy()


def test_the_first_fit_calibrates_z_to_the_target_and_a_second_fit_is_refused(
    capsys,
):
    clients = tiny_clients()
    model = target_model(schedule=clients.schedule)
    with pytest.raises(ValueError, match="fit the model first"):
        model.privacy_mechanism()
    model.fit(clients, epochs=2, verbose=1)
    planned = 2 * clients.rounds_per_epoch
    out = capsys.readouterr().out
    assert f"calibrating the noise for ε = {TARGET:g}" in out
    assert f"over {planned} rounds" in out and "compiling the round" in out
    assert model.planned_steps == planned
    z = model.noise_multiplier
    assert z == model.calibrated_noise_multiplier > 0
    assert model.privacy_mechanism().noise_multiplier == z
    # dp-accounting directly: z meets the target, 2% less noise misses it.
    q = clients.schedule.sampling_probability
    assert dp_accounting_epsilon(z, q, planned) <= TARGET
    assert dp_accounting_epsilon(0.98 * z, q, planned) > TARGET
    assert model.privacy_statement().epsilon <= TARGET

    before, steps = kernel(model), protocol.read_private_steps(model)
    with pytest.raises(PrivacyBudgetExhaustedError) as error:
        model.fit(clients, epochs=1, verbose=0)
    message = str(error.value)
    assert f"target_epsilon={TARGET}" in message and "at most 0 more rounds" in message
    assert f"{steps} of the {planned} rounds" in message and "ε =" in message
    assert protocol.read_private_steps(model) == steps
    np.testing.assert_array_equal(kernel(model), before)
    with pytest.raises(PrivacyBudgetExhaustedError):
        model.train_on_batch(clients[0])
    assert protocol.read_private_steps(model) == steps


def test_a_loaded_model_keeps_its_plan_and_refuses_past_it(tmp_path):
    clients = tiny_clients()
    per_epoch = clients.rounds_per_epoch
    model = target_model(planned_steps=3 * per_epoch)
    model.fit(clients, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)
    assert loaded.noise_multiplier == model.noise_multiplier
    assert (loaded.target_epsilon, loaded.planned_steps) == (TARGET, 3 * per_epoch)
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    if getattr(loaded, "optimizer", None) is None:
        loaded.compile(optimizer=keras.optimizers.SGD(1.0))
    before = kernel(loaded)
    with pytest.raises(PrivacyBudgetExhaustedError, match=f"at most {2 * per_epoch}"):
        loaded.fit(clients, epochs=3, verbose=0)
    np.testing.assert_array_equal(kernel(loaded), before)
    assert protocol.read_private_steps(loaded) == per_epoch
    loaded.fit(clients, epochs=2, verbose=0)  # Exactly the plan.
    assert protocol.read_private_steps(loaded) == 3 * per_epoch
    assert loaded.privacy_statement().epsilon <= TARGET


def test_a_first_fit_longer_than_the_given_plan_is_refused_before_a_round():
    clients = tiny_clients()
    model = target_model(planned_steps=1)
    before = kernel(model)
    with pytest.raises(PrivacyBudgetExhaustedError, match="at most 1 more round"):
        model.fit(clients, epochs=1, verbose=0)
    np.testing.assert_array_equal(kernel(model), before)
    assert protocol.read_private_steps(model) == 0


def test_target_epsilon_settings_are_checked():
    backbone = ref.linear_backbone()
    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        FedEmbModel(backbone, noise_multiplier=1.0, target_epsilon=1.0, delta=DELTA)
    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        FedEmbModel(backbone)
    with pytest.raises(ValueError, match="needs delta"):
        FedEmbModel(backbone, target_epsilon=1.0)
    with pytest.raises(ValueError, match="belong to a target_epsilon"):
        FedEmbModel(backbone, noise_multiplier=1.0, planned_steps=10)


def test_an_unsized_round_source_is_refused_with_a_target():
    clients = tiny_clients()
    model = target_model(schedule=clients.schedule)

    def endless():
        while True:
            yield clients[0]

    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(endless(), epochs=1, verbose=0)
    assert model.noise_multiplier is None

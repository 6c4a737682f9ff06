"""Every private model keeps the contract of `tests/contract.py`."""

import keras
import pytest

from kdpemb.testing import ToyDPRegressor, toy_regression_data
from tests.contract import ContractCase, run_private_model_contract


def toy_case():
    data = toy_regression_data(64, 3, steps_per_epoch=3)

    def build():
        model = ToyDPRegressor(
            num_examples=64, num_features=3, noise_multiplier=1.0,
            sampling_probability=0.25,
        )  # fmt: skip
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    def fit(model, epochs, callbacks):
        return model.fit(data, epochs=epochs, callbacks=callbacks, verbose=0)

    return ContractCase("toy_dp_regressor", build, fit, 3, "example", 1e-3)


def fedemb_case(sampling="poisson", **privacy_settings):
    from kdpemb.data import VirtualClients
    from kdpemb.datasets import synthetic_identities
    from kdpemb.models import FedEmbModel

    data = synthetic_identities(16, 4, image_size=8, seed=0)
    rounds = {"rounds_per_epoch": 2} if sampling == "poisson" else {}
    clients = VirtualClients(
        data, clients_per_round=3 if sampling == "poisson" else 4,
        users_per_client=2, num_clients=8, batch_size=4, workers=1,
        sampling=sampling, **rounds,
    )  # fmt: skip
    assert clients.rounds_per_epoch == 2

    def build():
        # Dense only: the contract is about the protocol, and convolutions
        # compile slowly under JAX on a CPU.
        backbone = keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Rescaling(1 / 255),
                keras.layers.Flatten(),
                keras.layers.Dense(4),
            ]
        )
        model = FedEmbModel(
            backbone, schedule=clients.schedule, clip_norm=1.0,
            client_parallelism=1, **(privacy_settings or {"noise_multiplier": 1.0}),
        )  # fmt: skip
        model.compile()
        return model

    def fit(model, epochs, callbacks):
        return model.fit(clients, epochs=epochs, callbacks=callbacks, verbose=0)

    name = "_".join(["fedemb", *privacy_settings][:2])
    return ContractCase(name, build, fit, 2, "user", 1e-3)


def last_layer_case(method):
    import numpy as np

    from kdpemb.models import LastLayerDPClassifier

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 200)
    features = (rng.normal(size=(200, 6)) + 2 * np.eye(3, 6)[labels]).astype("f4")
    sampled = method == "dp-sgd"
    clip = {"clip_norm": 1.0} if sampled else {"feature_clip_norm": 3.0}

    def build():
        model = LastLayerDPClassifier(3, method, noise_multiplier=2.0, **clip)
        model.compile()
        return model

    def fit(model, epochs, callbacks):
        return model.fit(
            features, labels, batch_size=50 if sampled else None, epochs=epochs,
            callbacks=callbacks, verbose=0,
        )  # fmt: skip

    steps_per_epoch = 4 if sampled else 1
    first_epochs = 1 if method == "dp-ls" else 2
    return ContractCase(
        f"last_layer_{method}", build, fit, steps_per_epoch, "example", 1e-3,
        first_epochs,
    )  # fmt: skip


def dp_model_case(**settings):
    import numpy as np

    from kdpemb.models import DPModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")

    def build():
        network = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(5, "relu"), keras.layers.Dense(2)]
        )
        model = DPModel(network, clip_norm=1.0, **settings)
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
        return model

    # At user level: 15 users of 4 examples, 5 expected users a step.
    unit = settings.get("unit", "example")
    by_user = {"users": np.arange(60) % 15} if unit == "user" else {}
    batch_size = 5 if by_user else 20

    def fit(model, epochs, callbacks):
        return model.fit(
            x, y, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
            verbose=0, **by_user,
        )  # fmt: skip

    name = "_".join(["dp_model", *settings][:2])
    return ContractCase(name, build, fit, 3, unit, 1e-3)


def _adaptive_clipping():
    from kdpemb.privacy import AdaptiveClipping

    return AdaptiveClipping(count_stddev=1.0)


CASES = {
    "toy_dp_regressor": toy_case,
    "fedemb": fedemb_case,
    # The contract's fits take 2 + 1 epochs of 2 rounds: plan 6 rounds. The
    # targets are small: PLD's cost grows with ε (at ε = 20 the accountant
    # calls took 15 s more than at ε = 2, on each backend).
    "fedemb_target_epsilon": lambda: fedemb_case(
        target_epsilon=2.0, delta=1e-3, planned_steps=6
    ),
    # DP-FTRL: 2 rounds per epoch without sampling, tree noise.
    "fedemb_tree": lambda: fedemb_case("epochs", noise="tree", noise_multiplier=2.0),
    "fedemb_adaptive_clipping": lambda: fedemb_case(
        adaptive_clipping=_adaptive_clipping(), noise_multiplier=1.0
    ),
    # The contract's fits take 2 + 1 epochs of 3 steps: plan 9 steps.
    "dp_model_target_epsilon": lambda: dp_model_case(
        target_epsilon=2.0, delta=1e-3, planned_steps=9
    ),
    "dp_model_user": lambda: dp_model_case(
        unit="user", examples_per_user=3, noise_multiplier=1.0
    ),
    **{
        f"last_layer_{method}": (lambda m=method: last_layer_case(m))
        for method in ("dp-sgd", "dp-ls", "dp-newton", "dp-fc")
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_private_model_keeps_the_contract(name, tmp_path):
    run_private_model_contract(CASES[name](), tmp_path)

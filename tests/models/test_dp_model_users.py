"""DPModel(unit="user"): user-level DP-SGD. Each claim by a test that can fail.

The per-user sensitivity of the clipped sum (flat and per layer, ghost and
fallback paths) is tested on the engine, `test_user_clipped_gradients.py`;
the sampling of users and the cap on the sampler, `test_user_batches.py`.
Here: the model's step, noise, accounting, statement, errors and saving.
"""

import dp_accounting
import keras
import numpy as np
import pytest
from keras import layers

from kdpemb import privacy
from kdpemb.models import DPModel
from kdpemb.privacy import protocol

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleNoiseWarning"
)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((3,)), layers.Dense(4, activation="tanh"), layers.Dense(1)]
    )


def user_data(counts=(1, 3, 2, 5, 1, 4), seed=0):
    """Rows of users with `counts` examples each (user ids 10, 11, ...),
    in an order that mixes the users."""
    rng = np.random.default_rng(seed)
    users = np.repeat(10 + np.arange(len(counts)), counts)
    order = rng.permutation(len(users))
    users = users[order]
    x = rng.normal(size=(len(users), 3)).astype("float32")
    y = rng.normal(size=(len(users), 1)).astype("float32")
    return x, y, users


def weights(model):
    return [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]


@pytest.mark.parametrize(
    "settings",
    [{}, {"physical_batch_size": 10}, {"gradient_method": "vectorized"}],
    ids=["ghost", "physical", "whole-model"],
)
def test_no_noise_and_a_huge_clip_norm_is_the_step_on_the_users_mean_gradients(
    settings,
):
    # Every user in every step (batch_size=None), k at least every user's
    # count: the step is (1/U) Σ_u mean_{i∈u} ∇ℓ_i, which Keras takes with
    # sample weights N / (U n_u) under its mean over the N examples.
    x, y, users = user_data()
    names, inverse, counts = np.unique(users, return_inverse=True, return_counts=True)
    sample_weight = len(x) / (len(names) * counts[inverse])
    reference = mlp()
    reference.compile(keras.optimizers.SGD(0.5), "mse")
    model = DPModel(mlp(), unit="user", examples_per_user=5, clip_norm=1e6,
                    noise_multiplier=0.0, seed=0, **settings)  # fmt: skip
    model.compile(keras.optimizers.SGD(0.5), "mse")
    model.fit(x, y, users=users, batch_size=None, epochs=2, verbose=0)
    reference.fit(x, y, sample_weight=sample_weight, batch_size=len(x), epochs=2,
                  verbose=0, shuffle=False)  # fmt: skip
    for got, want in zip(weights(model.network), weights(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # Not the example-level step (each example weighted alike):
    example_level = mlp()
    example_level.compile(keras.optimizers.SGD(0.5), "mse")
    example_level.fit(x, y, batch_size=len(x), epochs=2, verbose=0, shuffle=False)
    assert not np.allclose(weights(model.network)[0], weights(example_level)[0])
    statement = model.privacy_statement(delta=1e-3)
    assert (statement.unit, statement.steps, statement.population) == ("user", 2, 6)


def test_a_small_clip_norm_weights_every_user_alike_however_many_examples():
    # C far below every user's gradient: each user's clipped gradient has
    # norm C exactly, so the step (lr · Σ_u C û_u / U) has norm at most lr·C
    # and a user with 5 examples weighs as much as one with 1.
    x, y, users = user_data()
    c, lr = 1e-4, 1.0
    model = DPModel(mlp(), unit="user", examples_per_user=5, clip_norm=c,
                    noise_multiplier=0.0, seed=0)  # fmt: skip
    model.compile(keras.optimizers.SGD(lr), "mse")
    before = np.concatenate([w.ravel() for w in weights(model.network)])
    model.fit(x, y, users=users, batch_size=None, epochs=1, verbose=0)
    after = np.concatenate([w.ravel() for w in weights(model.network)])
    move = np.linalg.norm(after - before)
    assert 0.0 < move <= lr * c * (1 + 1e-4)


class StepWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(np.concatenate([w.ravel() for w in weights(self.model)]))


def test_noise_std_is_z_c_over_the_expected_users_per_step():
    # Zero weights and zero targets: every gradient is 0, so each step moves
    # the weights by lr · N(0, (zC)²) / B_u, whatever the users' counts:
    # not / B (expected examples, here 3 per user) nor / (k · B_u).
    z, c, users_per_step = 1.5, 0.2, 4.0
    x, _, users = user_data(counts=(3,) * 16)
    network = keras.Sequential(
        [keras.Input((3,)), layers.Dense(256, kernel_initializer="zeros")]
    )
    model = DPModel(network, unit="user", examples_per_user=2, clip_norm=c,
                    noise_multiplier=z, seed=3)  # fmt: skip
    model.compile(keras.optimizers.SGD(1.0), "mse")
    steps = StepWeights()
    model.fit(x, np.zeros((len(x), 256), "float32"), users=users,
              batch_size=int(users_per_step), epochs=2, callbacks=[steps],
              verbose=0)  # fmt: skip
    moves = np.diff(np.array([np.zeros_like(steps.seen[0]), *steps.seen]), axis=0)
    assert len(moves) == 8  # round(16 / 4) steps an epoch.
    std = moves.std() * users_per_step  # 8 × 1,024 draws.
    assert std == pytest.approx(z * c, rel=0.05)  # Rejects zC·3 and zC/2.


def test_the_statement_equals_dp_accounting_on_the_user_schedule():
    x, y, users = user_data(counts=(2, 1, 4, 3) * 5)  # 20 users, 50 examples.
    z, delta = 1.3, 1e-3
    model = DPModel(mlp(), unit="user", examples_per_user=3, noise_multiplier=z,
                    delta=delta, seed=0)  # fmt: skip
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, users=users, batch_size=5, epochs=2, verbose=0)
    statement = model.privacy_statement()
    steps = 2 * round(20 / 5)
    assert (statement.unit, statement.steps, statement.population) == (
        "user", steps, 20,
    )  # fmt: skip
    assert statement.sampling_probability == pytest.approx(5 / 20)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(z)),
        steps,
    )
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-4,
    )
    expected = accountant.compose(event).get_epsilon(delta)
    assert statement.epsilon == pytest.approx(expected, rel=1e-3)
    # Example-level accounting of the same run would report a smaller ε
    # (q = B / N over 50 examples): the two are told apart.
    assert "user" in statement.summary() and "at most 3" in statement.summary()


def test_a_target_epsilon_is_calibrated_per_user_and_met():
    x, y, users = user_data(counts=(2, 1, 4, 3) * 5)
    model = DPModel(mlp(), unit="user", examples_per_user=2, target_epsilon=3.0,
                    delta=1e-3)  # fmt: skip
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, users=users, batch_size=5, epochs=2, verbose=0)
    statement = model.privacy_statement()
    assert statement.unit == "user" and statement.steps == 8
    assert 2.5 < statement.epsilon <= 3.0
    mechanism = privacy.Schedule.users(20, 5, examples_per_user=2).privacy_mechanism(
        model.noise_multiplier, clip_norm=1.0
    )
    assert model.privacy_mechanism() == mechanism


def test_bad_arguments_are_refused_before_any_step():
    x, y, users = user_data()
    with pytest.raises(ValueError, match="examples_per_user=k"):
        DPModel(mlp(), unit="user", noise_multiplier=1.0)
    with pytest.raises(ValueError, match="unit must be one of"):
        DPModel(mlp(), unit="person", noise_multiplier=1.0)
    with pytest.raises(ValueError, match="unit='user'"):
        DPModel(mlp(), examples_per_user=4, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="multiple of examples_per_user=4"):
        DPModel(mlp(), unit="user", examples_per_user=4, physical_batch_size=6,
                noise_multiplier=1.0)  # fmt: skip
    model = DPModel(mlp(), unit="user", examples_per_user=2, noise_multiplier=1.0,
                    delta=1e-3)  # fmt: skip
    model.compile("sgd", "mse")
    before = weights(model.network)
    with pytest.raises(ValueError, match="users=ids"):
        model.fit(x, y, batch_size=2, verbose=0)
    with pytest.raises(ValueError, match="one id per example"):
        model.fit(x, y, users=users[:-1], batch_size=2, verbose=0)
    with pytest.raises(ValueError, match="expected number of users per step"):
        model.fit(x, y, users=users, batch_size=7, verbose=0)  # 6 users.
    with pytest.raises(ValueError, match="1/6"):  # δ against the users.
        bad = DPModel(mlp(), unit="user", examples_per_user=2,
                      noise_multiplier=1.0, delta=0.5)  # fmt: skip
        bad.compile("sgd", "mse")
        bad.fit(x, y, users=users, batch_size=2, verbose=0)
    example_level = DPModel(mlp(), noise_multiplier=1.0, delta=1e-3)
    example_level.compile("sgd", "mse")
    with pytest.raises(ValueError, match="unit='user'"):
        example_level.fit(x, y, users=users, batch_size=2, verbose=0)
    # Ids are checked before any plan: a refused `users` fixes no schedule,
    # so the corrected fit runs.
    for bad, match in ((users % 2 == 0, "dtype bool"), (users + 0.5, "float")):
        with pytest.raises(ValueError, match=match):
            model.fit(x, y, users=bad, batch_size=2, verbose=0)
        assert model.schedule is None
    for got, want in zip(weights(model.network), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert protocol.read_private_steps(model) == 0 and model.schedule is None
    model.fit(x, y, users=users, batch_size=2, epochs=1, verbose=0)
    assert model.schedule.population == 6


def test_a_saved_user_level_model_keeps_its_unit_cap_and_count(tmp_path):
    x, y, users = user_data()
    model = DPModel(mlp(), unit="user", examples_per_user=2, noise_multiplier=1.0,
                    delta=1e-3)  # fmt: skip
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, users=users, batch_size=3, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert (loaded.unit, loaded.examples_per_user) == ("user", 2)
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    loaded.fit(x, y, users=users, batch_size=3, epochs=1, verbose=0)
    assert protocol.read_private_steps(loaded) == 4
    with pytest.raises(ValueError, match="would change the mechanism"):
        loaded.fit(x, y, users=users, batch_size=2, verbose=0)


def test_noised_loss_and_adaptive_clipping_count_users():
    # The noised loss releases the users' mean losses, each clipped to the
    # bound: with no noise it is Σ_u min(|mean loss_u|, b) / B_u.
    from kdpemb.privacy import AdaptiveClipping, LossRelease

    x, y, users = user_data()
    names, inverse = np.unique(users, return_inverse=True)
    bound = 0.5
    model = DPModel(mlp(), unit="user", examples_per_user=5, clip_norm=1e6,
                    noise_multiplier=0.0, seed=0,
                    noised_loss=LossRelease(bound=bound, noise_multiplier=1e-6),
                    adaptive_clipping=AdaptiveClipping(count_stddev=0.0))  # fmt: skip
    model.compile(keras.optimizers.SGD(0.0), "mse")
    predictions = keras.ops.convert_to_numpy(model.network(x))
    losses = ((predictions - y) ** 2).mean(axis=1)
    user_means = np.array([losses[inverse == u].mean() for u in range(len(names))])
    history = model.fit(x, y, users=users, batch_size=None, epochs=1, verbose=0)
    expected = np.minimum(np.abs(user_means), bound).sum() / len(names)
    assert history.history["noised_loss"][-1] == pytest.approx(expected, rel=1e-4)

"""DPModel(noised_loss=LossRelease(...)): each step's training loss, clipped,
summed and noised, counted by the accountant with the gradient as one
Gaussian; off by default, and then the step and its accounting are DP-SGD's."""

import dp_accounting as dpa
import keras
import numpy as np
import pytest
from keras import layers

from kdpemb import privacy
from kdpemb.models import DPModel
from kdpemb.models._shared import backends
from kdpemb.models.dp_sgd import step_releases
from kdpemb.models.dp_sgd.clipped_gradients import ClippedGradients, plan_gradients
from kdpemb.privacy import (
    AdaptiveClipping,
    LossRelease,
    gaussian_release,
    gaussian_sum,
    protocol,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleNoiseWarning"
)
DELTA = 1e-3


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((3,)), layers.Dense(4, activation="tanh"), layers.Dense(2)]
    )


def data(n=12, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (scale * rng.normal(size=(n, 2))).astype("float32")
    return x, y


def weights(model):
    return [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]


class StepLogs(keras.callbacks.Callback):
    """Every step's logs (and, optionally, the weights after it)."""

    def __init__(self, with_weights=False):
        super().__init__()
        self.logs, self.weights, self.with_weights = [], [], with_weights

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(np.asarray(v)) for k, v in logs.items()})
        if self.with_weights:
            flat = [w.ravel() for w in weights(self.model)]
            self.weights.append(np.concatenate(flat))


def example_losses(network, x, y):
    y_pred = keras.ops.convert_to_numpy(network(x))
    return np.mean((y - y_pred) ** 2, axis=1)


@pytest.mark.parametrize("physical_batch_size", [None, 5])
def test_the_noised_loss_is_the_clipped_loss_sum_over_the_expected_batch(
    physical_batch_size,
):
    # SGD(0): the weights stay, so every full-batch step releases the same
    # clipped sum; with z_l tiny the noise is below float32 round-off.
    x, y = data(scale=2.0)
    network = mlp()
    losses = example_losses(network, x, y)
    bound = float(np.median(losses))  # Half the losses are clipped to B.
    model = DPModel(network, noise_multiplier=0.0, seed=0,
                    physical_batch_size=physical_batch_size,
                    noised_loss=LossRelease(bound, noise_multiplier=1e-6))  # fmt: skip
    model.compile(keras.optimizers.SGD(0.0), "mse")
    logs = StepLogs()
    history = model.fit(x, y, batch_size=None, epochs=2, verbose=0, callbacks=[logs])
    expected = np.minimum(losses, bound).sum() / len(x)
    assert expected < losses.mean() * 0.95  # The bound is felt.
    for step in logs.logs:
        assert step["noised_loss"] == pytest.approx(expected, rel=1e-5)
    # The real (unclipped, unnoised) loss is not logged, under any name.
    assert set(history.history) == {"private_steps", "noised_loss"}


def test_the_loss_noise_has_std_z_l_b_over_b_and_is_not_the_gradient_s_draw():
    # Zero weights and targets, and a tiny learning rate: the losses and
    # gradients stay near 0, so each step logs N(0, (z_l B)²) / M and moves
    # the weights by -lr · N(0, (zC)²) / M.
    z, c, z_l, bound, n, m, lr = 1.0, 0.5, 2.0, 3.0, 64, 2, 1e-3
    network = keras.Sequential(
        [keras.Input((3,)), layers.Dense(2, kernel_initializer="zeros")]
    )
    model = DPModel(network, clip_norm=c, noise_multiplier=z, seed=7,
                    noised_loss=LossRelease(bound, z_l))  # fmt: skip
    model.compile(keras.optimizers.SGD(lr), "mse")
    logs = StepLogs(with_weights=True)
    x = np.random.default_rng(1).normal(size=(n, 3)).astype("float32")
    model.fit(x, np.zeros((n, 2), "float32"), batch_size=m, epochs=4, verbose=0,
              callbacks=[logs])  # fmt: skip
    released = np.array([step["noised_loss"] for step in logs.logs])
    assert len(released) == 4 * n // m
    assert released.std() * m == pytest.approx(z_l * bound, rel=0.2)  # Not 2×, ½.
    assert abs(released.mean()) * m < 0.5 * z_l * bound  # Centred on the sum 0.
    trail = np.array([np.zeros_like(logs.weights[0]), *logs.weights])
    gradient_draws = -np.diff(trail, axis=0)[:, 0] / lr * m / (z * c)
    assert gradient_draws.std() == pytest.approx(1.0, rel=0.2)
    loss_draws = released * m / (z_l * bound)
    assert abs(np.corrcoef(gradient_draws, loss_draws)[0, 1]) < 0.3
    assert abs(np.corrcoef(loss_draws[1:], loss_draws[:-1])[0, 1]) < 0.3


def test_one_example_moves_the_clipped_loss_sum_by_at_most_b_and_can_attain_it():
    bound = 0.5
    x, y = data(n=6, scale=5.0)  # Every loss above B.
    network = mlp()
    plan = plan_gradients(network, x[:3])
    engine = ClippedGradients(network, plan, keras.losses.get("mse"), [1.0])
    sums = step_releases.LossSums(engine, bound)
    params = [v.value for v in network.trainable_variables]
    zero = keras.ops.zeros((), "int32")
    carried = [keras.ops.zeros((), "float32"), zero, zero]

    @backends.current().compiled  # One trace for every mask.
    def summed(mask):
        return sums(params, list(carried), x, y, mask)[1][-3]

    def loss_sum(mask):
        return float(keras.ops.convert_to_numpy(summed(mask)))

    full = loss_sum(np.ones(6, bool))
    assert full == pytest.approx(6 * bound, rel=1e-6)
    for row in range(6):
        mask = np.ones(6, bool)
        mask[row] = False
        moved = abs(full - loss_sum(mask))
        assert moved <= bound * (1 + 1e-6)
        assert moved == pytest.approx(bound, rel=1e-5)


def pld_epsilon(z, q, steps):
    accountant = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    accountant.compose(dpa.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


def fitted(x, y, **settings):
    model = DPModel(mlp(), seed=0, delta=DELTA, **settings)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model, history


def test_the_accountant_counts_the_loss_with_the_gradient_as_one_gaussian():
    z, z_l = 2.0, 4.0  # Large enough for a quick PLD.
    x, y = data(n=32)
    model, _ = fitted(x, y, noise_multiplier=z, noised_loss=LossRelease(1.0, z_l))
    mechanism = model.privacy_mechanism()
    z_eff = (z**-2 + z_l**-2) ** -0.5
    assert mechanism.noise_multiplier == pytest.approx(z_eff, rel=1e-12)
    assert model.noise_multiplier == z  # The gradient's noise is as given.
    assert mechanism.clip_norm == model.clip_norm
    q, steps = 8 / 32, protocol.read_private_steps(model)
    statement = model.privacy_statement()
    assert statement.epsilon == pytest.approx(pld_epsilon(z_eff, q, steps), rel=1e-9)
    assert statement.epsilon > 1.1 * pld_epsilon(z, q, steps)  # The loss costs.


def test_off_by_default_the_step_and_its_accounting_are_dp_sgd_s_alone():
    # The same seed with and without the loss release: the same weights
    # (the loss draws from its own stream and changes nothing in the step);
    # without it, the mechanism is the gradient's alone.
    z = 0.8
    x, y = data(n=32)
    plain, plain_history = fitted(x, y, noise_multiplier=z)
    assert plain.noised_loss is None and plain.adaptive_clipping is None
    assert set(plain_history.history) == {"private_steps"}
    schedule = privacy.Schedule.examples(32, 8)
    assert plain.privacy_mechanism() == schedule.privacy_mechanism(z, 1.0)
    assert not hasattr(plain, "loss_seed") and not hasattr(plain, "count_seed")
    with_loss, history = fitted(x, y, noise_multiplier=z,
                                noised_loss=LossRelease(2.0, 3.0))  # fmt: skip
    assert set(history.history) == {"private_steps", "noised_loss"}
    for got, want in zip(weights(with_loss), weights(plain), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(
        keras.ops.convert_to_numpy(with_loss.loss_seed.state),
        keras.ops.convert_to_numpy(with_loss.noise_seed.state),
    )


def test_a_target_epsilon_calibrates_the_combined_mechanism():
    x, y = data(n=32)
    target, z_l = 2.0, 4.0
    model, _ = fitted(x, y, target_epsilon=target, noised_loss=LossRelease(1.0, z_l))
    z, z_eff = model.noise_multiplier, model.privacy_mechanism().noise_multiplier
    assert z_eff == pytest.approx((z**-2 + z_l**-2) ** -0.5, rel=1e-12)
    assert z > z_eff and model.calibrated_noise_multiplier == z
    q, planned = 8 / 32, model.planned_steps
    assert 0.99 * target <= pld_epsilon(z_eff, q, planned) <= target
    assert model.privacy_statement().epsilon <= target
    # A loss noise that alone spends the target is refused before any step,
    # and the refused fit keeps no plan.
    refused = DPModel(mlp(), target_epsilon=target, delta=DELTA,
                      noised_loss=LossRelease(1.0, 0.05))  # fmt: skip
    refused.compile(keras.optimizers.SGD(0.1), "mse")
    before = weights(refused)
    with pytest.raises(ValueError, match=r"LossRelease\(noise_multiplier"):
        refused.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert protocol.read_private_steps(refused) == 0
    assert refused.schedule is None and refused.calibrated_noise_multiplier is None
    np.testing.assert_array_equal(weights(refused)[0], before[0])


def test_a_step_past_the_plan_releases_no_loss_and_leaves_c():
    schedule = privacy.Schedule.examples(32, 8)
    model = DPModel(mlp(), noise_multiplier=1.0, schedule=schedule.get_config(),
                    noised_loss=LossRelease(1.0, 2.0),
                    adaptive_clipping=AdaptiveClipping(count_stddev=1.0))  # fmt: skip
    ops = keras.ops
    clipped = gaussian_sum.clip_and_sum([np.ones((4, 3), "float32")], 1.0)
    losses = gaussian_sum.clip_and_sum([np.full((4,), 0.7, "float32")], 1.0)
    for within in (False, True):
        logs = step_releases.release(
            model, clipped, losses, ops.convert_to_tensor(within)
        )
        c = float(ops.convert_to_numpy(model.current_clip_norm))
        logged = float(ops.convert_to_numpy(logs["noised_loss"]))
        if within:
            assert np.isfinite(logged) and logged != 0.0
            assert c != 1.0 == model.clip_norm
        else:  # NaN: not a loss of 0, which a plot would show as one.
            assert np.isnan(logged)
            assert c == 1.0


def test_loss_release_settings_are_checked_and_compose():
    release = LossRelease(bound=2.0, noise_multiplier=3.0)
    assert release.noise_std == 6.0
    assert release.release().sensitivity == 2.0
    assert LossRelease.from_config(release.get_config()) == release
    with pytest.raises(ValueError, match="bound"):
        LossRelease(bound=0.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="without noise"):
        LossRelease(bound=1.0, noise_multiplier=0.0)
    with pytest.raises(TypeError, match="LossRelease"):
        DPModel(mlp(), noise_multiplier=1.0, noised_loss=2.0)
    model = DPModel(mlp(), noise_multiplier=1.0, noised_loss=release.get_config())
    assert model.noised_loss == release
    with pytest.raises(AttributeError, match="fixed at construction"):
        model.noised_loss = None
    # The gradient's share of a calibrated z_eff, beside two other releases.
    others = [release.release(), AdaptiveClipping(count_stddev=4.0).count_release(64)]
    z = gaussian_release.remaining_noise_multiplier(1.5, others)
    assert z**-2 + 3.0**-2 + 8.0**-2 == pytest.approx(1.5**-2, rel=1e-12)
    composed = [gaussian_release.GaussianRelease(z, 1.0), *others]
    assert gaussian_release.effective_noise_multiplier(composed) >= 1.5
    with pytest.raises(ValueError, match="alone spend"):
        gaussian_release.remaining_noise_multiplier(3.0, others)  # 2.81 alone.

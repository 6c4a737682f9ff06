"""DPModel(adaptive_clipping=AdaptiveClipping(...)): C follows a quantile of
the examples' gradient norms, moved by a noisy count (FedEmb's primitive);
the gradient sum's sensitivity is the current C; the step is accounted as
one Gaussian; C is model state, saved and restored."""

import math
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest
from keras import layers, ops

from kdpemb.errors import CostlyReleaseWarning
from kdpemb.models import DPModel
from kdpemb.models.dp_sgd import step_releases
from kdpemb.privacy import AdaptiveClipping, LossRelease, ledger, protocol
from tests.models.test_last_layer import save_and_load

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleNoiseWarning"
)
DELTA = 1e-3


def linear_network():
    network = keras.Sequential([keras.Input((2,)), layers.Dense(1, use_bias=False)])
    network.set_weights([np.zeros((2, 1), "float32")])
    return network


def current_c(model):
    return float(keras.ops.convert_to_numpy(model.current_clip_norm))


def kernel(model):
    return keras.ops.convert_to_numpy(model.network.trainable_weights[0]).ravel()


def known_norms(norms):
    """Inputs e₁ and targets −n/2: at zero weights the mse gradient of
    example i is 2 (0 − yᵢ) e₁, of norm nᵢ."""
    norms = np.asarray(norms, "float32")
    x = np.tile(np.array([[1.0, 0.0]], "float32"), (len(norms), 1))
    return x, (-norms / 2)[:, None]


def adaptive(network, clip_norm=1.0, clipping=None, **settings):
    settings.setdefault("noise_multiplier", 0.0)
    model = DPModel(
        network, clip_norm=clip_norm, seed=0,
        adaptive_clipping=clipping or AdaptiveClipping(count_stddev=0.0),
        **settings,
    )  # fmt: skip
    return model


@pytest.mark.parametrize(
    "settings",
    [{}, {"gradient_method": "vectorized"}, {"physical_batch_size": 3}],
    ids=["ghost", "vectorized", "physical_batches"],
)
def test_the_step_clips_to_the_current_c_one_example_moves_the_sum_by_at_most_it(
    settings,
):
    # Removing example i is, for the sum, replacing it by an example of
    # zero gradient (x = 0): same N, same denominator. With no noise and
    # SGD(1), N · (w' − w) is the change of the clipped sum.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 2)).astype("float32")
    y = (5 * rng.normal(size=(7, 1))).astype("float32")
    c = 0.05  # The current C: far below the initial clip_norm and every norm.
    model = adaptive(linear_network(), clip_norm=10.0, **settings)
    model.compile(keras.optimizers.SGD(1.0), "mse")

    def step(x):  # One step from zero weights at C = c.
        model.network.set_weights([np.zeros((2, 1), "float32")])
        model.current_clip_norm.assign(c)
        model.fit(x, y, batch_size=None, epochs=1, verbose=0)
        return kernel(model) * len(x)

    full = step(x)
    for i in (0, 3):
        removed = x.copy()
        removed[i] = 0.0
        moved = np.linalg.norm(full - step(removed))
        assert moved <= c * (1 + 1e-5)
        assert moved == pytest.approx(c, rel=1e-4)  # Attained: ‖gᵢ‖ > C.


@pytest.mark.parametrize("physical_batch_size", [None, 4])
def test_one_step_moves_c_by_the_share_of_examples_within_it(physical_batch_size):
    # No noise: b̄ is the share of the N examples within C (the padding rows
    # of physical batches are not examples), and C ← C · exp(−η (b̄ − γ)).
    # Each example adds ±1/2 to the centred count: one more within C moves
    # b̄ by 1/N.
    norms = [0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0, 12.0, 20.0]
    x, y = known_norms(norms)
    eta, gamma, c = 0.5, 0.3, 5.0
    model = adaptive(linear_network(), clip_norm=c,
                     clipping=AdaptiveClipping(gamma, eta, count_stddev=0.0),
                     physical_batch_size=physical_batch_size)  # fmt: skip
    model.compile(keras.optimizers.SGD(0.0), "mse")
    history = model.fit(x, y, batch_size=None, epochs=1, verbose=0)
    share = np.mean(np.array(norms) <= c)  # 5 of 10.
    assert current_c(model) == pytest.approx(c * math.exp(-eta * (share - gamma)))
    assert history.history["clip_norm"][-1] == pytest.approx(current_c(model))


class RealisedSample(DPModel):
    """A DPModel whose steps also log their realised Poisson sample, for a
    test to compare with the releases: the gradient norms 2|y| of the
    sampled examples (padding rows: -1)."""

    def _dp_step(self, data):
        _, y, mask = data
        norms = ops.where(mask > 0, 2 * ops.abs(y[:, 0]), -1.0)
        return {**super()._dp_step(data), "realised_norms": norms}


def test_poisson_steps_divide_the_count_and_the_loss_by_the_expected_batch():
    # Zero noise on the gradient and the count (the loss's is below float32
    # round-off), zero weights that SGD(0) keeps: each step's releases are
    # functions of its realised sample alone, whose size is private. Both
    # divide by the expected batch M, never by the realised count.
    n, m, eta, gamma = 32, 8, 0.5, 0.5
    norms = np.geomspace(0.2, 20.0, n)
    x, y = known_norms(norms)
    bound = float(np.median(norms**2 / 4))
    model = RealisedSample(
        linear_network(), clip_norm=3.0, noise_multiplier=0.0, seed=3,
        adaptive_clipping=AdaptiveClipping(gamma, eta, count_stddev=0.0),
        noised_loss=LossRelease(bound, noise_multiplier=1e-6),
    )  # fmt: skip
    model.compile(keras.optimizers.SGD(0.0), "mse")
    steps = StepLogs()
    model.fit(x, y, batch_size=m, epochs=2, verbose=0, callbacks=[steps])
    assert len(steps.logs) == 2 * n // m
    samples = [step["realised_norms"] for step in steps.logs]
    samples = [sample[sample >= 0] for sample in samples]
    assert any(len(sample) != m for sample in samples)  # Denominators differ.
    c = 3.0  # The step's C: the initial one, then the one each step logs.
    for step, sample in zip(steps.logs, samples, strict=True):
        clipped_losses = np.minimum(sample**2 / 4, bound)
        assert step["noised_loss"] == pytest.approx(
            clipped_losses.sum() / m, rel=1e-5, abs=1e-5
        )
        centred = np.sum(sample <= c) - len(sample) / 2
        share = min(max(centred / m + 0.5, 0.0), 1.0)
        assert step["clip_norm"] == pytest.approx(
            c * math.exp(-eta * (share - gamma)), rel=1e-5
        )
        c = step["clip_norm"]
    assert c != 3.0  # C moved.


class StepLogs(keras.callbacks.Callback):
    """Every step's logs, as floats (arrays for vectors)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        arrays = {k: np.asarray(v) for k, v in logs.items()}
        self.logs.append({k: float(v) if v.ndim == 0 else v
                          for k, v in arrays.items()})  # fmt: skip


def test_without_noise_c_settles_at_the_target_quantile_of_known_norms():
    # γ = 0.35 of ten norms: within C, 3 are too few and 4 too many, so C
    # settles at the 4th norm, within the factor exp(η · 0.05) of a step.
    norms = [0.4, 0.7, 1.1, 1.6, 2.4, 3.5, 5.0, 7.0, 9.5, 13.0]
    x, y = known_norms(norms)
    eta = 1.0
    clipping = AdaptiveClipping(0.35, eta, count_stddev=0.0)
    model = adaptive(linear_network(), clip_norm=0.05, clipping=clipping)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(x, y, batch_size=None, epochs=20, verbose=0)
    band = math.exp(eta * 0.05)
    assert norms[3] / band <= current_c(model) <= norms[3] * band
    assert model.get_config()["clip_norm"] == 0.05  # The initial C.


def pld_epsilon(z, q, steps):
    accountant = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    accountant.compose(dpa.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((3,)), layers.Dense(4, activation="tanh"), layers.Dense(2)]
    )


def data(n=32):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 3)).astype("float32"),
            rng.normal(size=(n, 2)).astype("float32"))  # fmt: skip


def test_the_accountant_s_epsilon_is_dp_accounting_s_on_the_combined_gaussian():
    z, sigma_b, z_l, m = 2.0, 1.5, 5.0, 8
    x, y = data()
    model = DPModel(mlp(), noise_multiplier=z, delta=DELTA, seed=0,
                    adaptive_clipping=AdaptiveClipping(count_stddev=sigma_b),
                    noised_loss=LossRelease(1.0, z_l))  # fmt: skip
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=m, epochs=1, verbose=0)
    assert set(history.history) == {"private_steps", "clip_norm", "noised_loss"}
    # Sensitivities C, 1/2 and B, noise stds zC, σ_b and z_l B.
    z_eff = (z**-2 + (2 * sigma_b) ** -2 + z_l**-2) ** -0.5
    mechanism = model.privacy_mechanism()
    assert mechanism.noise_multiplier == pytest.approx(z_eff, rel=1e-12)
    assert mechanism.clip_norm is None  # C moves: the statement names none.
    steps = protocol.read_private_steps(model)
    expected = pld_epsilon(z_eff, m / 32, steps)
    statement = model.privacy_statement()
    assert statement.epsilon == pytest.approx(expected, rel=1e-9)
    # What was composed, with its noise, in the mechanism, the statement
    # and the parameters a ledger records.
    parts = [(r.name, r.noise_std, r.sensitivity) for r in mechanism.step_releases]
    assert parts[1:] == [("count within the clip norm", sigma_b, 0.5),
                         ("clipped training loss sum", z_l * 1.0, 1.0)]  # fmt: skip
    assert parts[0][0].startswith("clipped gradient sum") and parts[0][1] == z
    summary = statement.summary()
    assert "3 releases" in summary
    for release in (
        "gradient sum, per unit of the clip norm C: noise multiplier 2 ",
        "count within the clip norm: noise multiplier 3 (std 1.5 on sensitivity 0.5)",
        "loss sum: noise multiplier 5 (std 5 ",
    ):
        assert release in summary
    recorded = ledger.mechanism_parameters(mechanism)["step_releases"]
    assert [r["noise_std"] for r in recorded] == [z, sigma_b, z_l]
    # The default σ_b is 5% of the expected batch: 0.4 here.
    default = DPModel(mlp(), noise_multiplier=z, adaptive_clipping=AdaptiveClipping(),
                      schedule=model.schedule.get_config())  # fmt: skip
    assert default.privacy_mechanism().noise_multiplier == pytest.approx(
        (z**-2 + 0.8**-2) ** -0.5, rel=1e-12
    )


def test_a_target_epsilon_leaves_the_gradient_what_the_count_does_not_spend():
    x, y = data()
    target = 2.0
    model = DPModel(mlp(), target_epsilon=target, delta=DELTA,
                    adaptive_clipping=AdaptiveClipping(count_stddev=4.0))  # fmt: skip
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    z, z_eff = model.noise_multiplier, model.privacy_mechanism().noise_multiplier
    assert z_eff == pytest.approx((z**-2 + 8.0**-2) ** -0.5, rel=1e-12)
    assert z > z_eff
    planned = model.planned_steps
    assert 0.99 * target <= pld_epsilon(z_eff, 0.25, planned) <= target
    assert pld_epsilon(0.98 * z_eff, 0.25, planned) > target
    # A count too little noised for the target is refused before any step.
    small = DPModel(mlp(), target_epsilon=target, delta=DELTA,
                    adaptive_clipping=AdaptiveClipping(count_stddev=0.05))  # fmt: skip
    small.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match=r"count_stddev"):
        small.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert protocol.read_private_steps(small) == 0 and current_c(small) == 1.0
    assert small.schedule is None and small.calibrated_noise_multiplier is None


def test_c_is_saved_and_restored_and_a_resumed_fit_continues_from_it(tmp_path):
    # Full-batch steps without noise: a step is a function of the weights
    # and C alone, so the loaded model continues exactly as the original.
    x, y = known_norms([0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    settings = dict(clip_norm=20.0, noised_loss=LossRelease(1.0, 2.0),
                    clipping=AdaptiveClipping(0.5, 0.5, count_stddev=0.0))  # fmt: skip
    model = adaptive(linear_network(), **settings)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    model.fit(x, y, batch_size=None, epochs=3, verbose=0)
    c = current_c(model)
    assert c < 20.0
    loaded = save_and_load(model, tmp_path)
    assert current_c(loaded) == c
    assert loaded.adaptive_clipping == model.adaptive_clipping
    assert loaded.noised_loss == model.noised_loss
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    for resumed in (model, loaded):
        resumed.fit(x, y, batch_size=None, epochs=1, verbose=0)
    assert current_c(loaded) == pytest.approx(current_c(model), rel=1e-6)
    assert current_c(loaded) != pytest.approx(c)
    np.testing.assert_allclose(kernel(loaded), kernel(model), rtol=1e-5)


def test_the_count_and_the_loss_draw_from_their_own_streams():
    # Zero weights and targets: every gradient is 0 and within C, so each
    # step moves the weights by the gradient noise N(0, (z C_t)²) / N at
    # that step's C_t. Draw for draw, the gradient noise of one seed is the
    # same with adaptive clipping (and a noised loss) as without.
    z, c, n = 1.0, 0.5, 8
    x = np.random.default_rng(2).normal(size=(n, 2)).astype("float32")

    def draws(**settings):
        network = keras.Sequential(
            [keras.Input((2,)), layers.Dense(64, kernel_initializer="zeros")]
        )
        model = DPModel(network, clip_norm=c, noise_multiplier=z, seed=4, **settings)
        model.compile(keras.optimizers.SGD(1e-3), "mse")
        found, before, step_c = [], kernel(model), c
        for _ in range(3):
            history = model.fit(x, np.zeros((n, 64), "float32"), batch_size=None,
                                epochs=1, verbose=0)  # fmt: skip
            found.append((kernel(model) - before) / 1e-3 * n / (z * step_c))
            before = kernel(model)
            step_c = history.history.get("clip_norm", [c])[-1]
        return model, np.array(found)

    model, with_count = draws(
        adaptive_clipping=AdaptiveClipping(0.5, 0.5, count_stddev=1.0),
        noised_loss=LossRelease(1.0, 2.0),
    )
    _, plain = draws()
    np.testing.assert_allclose(with_count, plain, rtol=1e-3, atol=1e-4)
    assert abs(plain.std() - 1) < 0.2
    assert current_c(model) != c  # C moved: the count was released.
    states = [
        tuple(keras.ops.convert_to_numpy(g.state))
        for g in (model.noise_seed, model.count_seed, model.loss_seed)
    ]
    assert len(set(states)) == 3


def test_every_noise_stream_is_drawn_afresh_from_os_entropy_at_each_fit():
    x, y = data(n=8)
    model = DPModel(mlp(), noise_multiplier=1.0,
                    adaptive_clipping=AdaptiveClipping(count_stddev=1.0),
                    noised_loss=LossRelease(1.0, 2.0))  # fmt: skip
    model.compile(keras.optimizers.SGD(0.1), "mse")
    generators = (model.noise_seed, model.count_seed, model.loss_seed)

    def keys():  # The first word: a draw only advances the second.
        return [int(keras.ops.convert_to_numpy(g.state)[0]) for g in generators]

    found = []

    class AtTrainBegin(keras.callbacks.Callback):
        """The streams' keys as the fit's first step is about to draw."""

        def on_train_begin(self, logs=None):
            found.append(keys())

    built = keys()
    assert len(set(built)) == 3
    for _ in range(2):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[AtTrainBegin()])
    first, second = found
    after = keys()
    # Reseeded at the start of each fit (the first draws are neither the
    # construction's nor the last fit's), and again at its end.
    for keys_at in (first, second):
        assert len(set(keys_at)) == 3
        assert all(a != b for a, b in zip(keys_at, built, strict=True))
    assert all(a != b for a, b in zip(second, first, strict=True))
    assert all(a != b for a, b in zip(after, second, strict=True))


def test_unsupported_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match="per_layer_clipping"):
        DPModel(mlp(), noise_multiplier=1.0, per_layer_clipping=True,
                adaptive_clipping=AdaptiveClipping())  # fmt: skip
    with pytest.raises(TypeError, match="AdaptiveClipping"):
        DPModel(mlp(), noise_multiplier=1.0, adaptive_clipping=0.5)
    with pytest.raises(ValueError, match="target_quantile"):
        DPModel(mlp(), noise_multiplier=1.0,
                adaptive_clipping={"target_quantile": 1.5})  # fmt: skip
    model = DPModel(mlp(), noise_multiplier=1.0, adaptive_clipping=AdaptiveClipping())
    with pytest.raises(AttributeError, match="fixed at construction"):
        model.adaptive_clipping = None
    assert current_c(model) == model.clip_norm == 1.0
    # A count without noise moves the logged C in the clear: refused beside
    # a noised gradient (or a target ε), allowed only without any noise.
    unnoised = AdaptiveClipping(count_stddev=0.0)
    for settings in ({"noise_multiplier": 0.5},
                     {"target_epsilon": 1.0, "delta": DELTA}):  # fmt: skip
        with pytest.raises(ValueError, match=r"count_stddev=0\) would .*ε = ∞"):
            DPModel(mlp(), adaptive_clipping=unnoised, **settings)
    DPModel(mlp(), noise_multiplier=0.0, adaptive_clipping=unnoised)


def test_a_count_noised_less_than_the_gradient_warns_once_before_training():
    # The default σ_b = M / 20 at M = 8: 2σ_b = 0.8, below z = 1.
    x, y = data(n=32)
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(len(caught))

    model = DPModel(mlp(), noise_multiplier=1.0, adaptive_clipping=AdaptiveClipping())
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Seen()])
    costly = [w for w in caught if w.category is CostlyReleaseWarning]
    assert len(costly) == 1 and seen[0] == len(caught)  # Before the first step.
    message = str(costly[0].message)
    assert "z_b = 2σ_b = 0.8" in message and "z = 1" in message
    assert "count_stddev" in message
    # A count noised at least as much as the gradient (2σ_b = z): no warning.
    quiet = DPModel(mlp(), noise_multiplier=1.0, schedule=model.schedule.get_config(),
                    adaptive_clipping=AdaptiveClipping(count_stddev=0.5))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", CostlyReleaseWarning)
        step_releases.warn_costly_count(quiet)

"""Cost of privacy accounting: epsilon() and PrivacyBudget's per-epoch overhead.

1. `Accountant.epsilon` from a cold start for 10^3, 10^4 and 10^5 steps
   (RDP and PLD), and the warm per-epoch increment (1,000 more steps on a
   cached accountant), for the MNIST DP-SGD schedule (q = 256/60000,
   z = 1.1, δ = 1e-5).
2. PrivacyBudget's overhead on a real `fit`: a toy DP-SGD model whose
   epochs are 1,000 steps, with the private step counter set so that the
   run ends at step 100,000 (the largest schedule the goal covers). One
   fit per variant (PLD, PLD with a coarser grid, RDP) and a baseline fit
   without the callback before and after them. The time spent inside the
   callback's hooks is measured directly; the first epoch (the accountant's
   cold start, once per fit) is reported apart from the steady state.
   Goal: callback time < 1% of the epoch.
3. Noise calibration (`calibrate_noise_multiplier`, PLD) for the
   documented schedules and targets ε in {0.1, 1, 10, 100, 1000}: seconds
   per calibration (goal < 2 s). The baseline, measured in the same run,
   is one ε of the answer on the accountant's default grid, computed by
   dp-accounting's own PLD (what the previous search evaluated 4-5 times,
   plus an RDP search): so a ratio below 1 beats even a single step of the
   old search. That ε takes from seconds to minutes at ε >= 100 (and more
   than a minute for DP-LS at ε = 1000), so the baseline is measured only
   up to ε = 10 (ε = 1 with --quick).
"""

import statistics
import time

from kdpemb import privacy

MNIST = dict(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
DELTA = 1e-5


def _time(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _cold_epsilon(mechanism, method, steps):
    """A fresh accountant (its one-step distribution included) and one ε."""
    return privacy.Accountant(mechanism, method).epsilon(steps, DELTA)


def epsilon_timings(step_counts):
    mechanism = privacy.dp_sgd(**MNIST)
    figures, ratios = {}, {}
    for steps in step_counts:
        for method in privacy.ACCOUNTANTS:
            cold = _time(_cold_epsilon, mechanism, method, steps)
            warm_accountant = privacy.Accountant(mechanism, method)
            warm_accountant.epsilon(steps - 1_000, DELTA)
            warm = _time(warm_accountant.epsilon, steps, DELTA)
            figures[f"epsilon() {method} cold, {steps:,} steps [s]"] = cold
            figures[f"epsilon() {method} +1,000 steps warm, at {steps:,} [s]"] = warm
            ratios[f"{method} warm/cold at {steps:,} steps"] = warm / cold
        ratios[f"pld/rdp cold time at {steps:,} steps"] = (
            figures[f"epsilon() pld cold, {steps:,} steps [s]"]
            / figures[f"epsilon() rdp cold, {steps:,} steps [s]"]
        )
    return figures, ratios


VARIANTS = {
    "pld": dict(accountant="pld"),
    "pld (interval 1e-3)": dict(accountant="pld", value_discretization_interval=1e-3),
    "rdp": dict(accountant="rdp"),
}


def callback_overhead(epochs, steps_per_epoch, end_steps):
    """Epoch times of one fit per variant; the first epoch is the cold start."""
    import keras

    from kdpemb.callbacks import PrivacyBudget
    from kdpemb.testing import ToyDPRegressor, toy_regression_data

    class TimedBudget(PrivacyBudget):
        """Records the wall time spent inside the callback, per epoch."""

        def on_epoch_begin(self, epoch, logs=None):
            self.blocked.append(0.0)
            self._timed(super().on_epoch_begin, epoch, logs)

        def on_train_batch_begin(self, batch, logs=None):
            self._timed(super().on_train_batch_begin, batch, logs)

        def on_train_batch_end(self, batch, logs=None):
            self._timed(super().on_train_batch_end, batch, logs)

        def on_epoch_end(self, epoch, logs=None):
            self._timed(super().on_epoch_end, epoch, logs)

        def _timed(self, hook, *args):
            start = time.perf_counter()
            hook(*args)
            self.blocked[-1] += time.perf_counter() - start

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    # The MNIST DP-SGD schedule (q = 256/60000, z = 1.1): ε ≈ 7 at 100k steps.
    num_examples, num_features = MNIST["num_examples"], 16
    data = toy_regression_data(num_examples, num_features, steps_per_epoch)
    model = ToyDPRegressor(
        num_examples,
        num_features,
        MNIST["noise_multiplier"],
        MNIST["batch_size"] / num_examples,
        seed=0,
    )
    model.compile(optimizer="sgd")
    model.fit(data, epochs=1, verbose=0)  # Compile the train function.

    def run_fit(variant):
        model.private_steps.assign(end_steps - epochs * steps_per_epoch)
        timer = EpochTimer()
        timer.times = []
        callbacks = [timer]
        budget = None
        if variant is not None:
            budget = TimedBudget(DELTA, verbose=0, **VARIANTS[variant])
            budget.blocked = []
            callbacks.insert(0, budget)  # Before the timer: its work is timed.
        model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks)
        return timer.times, (budget.blocked if budget else None)

    baseline = run_fit(None)[0]
    results = {}
    for variant in VARIANTS:
        results[variant] = run_fit(variant)
    baseline += run_fit(None)[0]  # Before and after: the machine drifts.
    steady_baseline = statistics.median(baseline)
    figures = {"epoch without callback [s]": steady_baseline}
    ratios = {}
    for variant, (times, blocked) in results.items():
        figures[f"{variant}: callback time, first epoch (cold) [s]"] = blocked[0]
        figures[f"{variant}: callback time per later epoch [s]"] = statistics.median(
            blocked[1:]
        )
        ratios[f"{variant}: callback time / epoch"] = (
            statistics.median(blocked[1:]) / steady_baseline
        )
        ratios[f"{variant}: epoch with / without callback"] = (
            statistics.median(times[1:]) / steady_baseline
        )
    return figures, ratios


def _calibration_schedules():
    """The documented schedules: (mechanism, steps, δ)."""
    mnist = privacy.dp_sgd(1.0, batch_size=256, num_examples=60_000)
    return {
        "MNIST DP-SGD (q=256/60000, 10 epochs, δ=1e-5)": (
            mnist,
            mnist.steps_for_epochs(10),
            1e-5,
        ),
        "virtual clients (k=4, M=100, 100,000 users, 2,000 rounds, δ=1e-6)": (
            privacy.virtual_clients(1.0, 100, 100_000, users_per_client=4),
            2_000,
            1e-6,
        ),
        "DP-LS (Gram matrix + class sums, δ=1e-6)": (
            privacy.gaussian_releases(
                [(1.0, 1.0, "Gram matrix"), (1.0, 1.0, "class sums")],
                num_examples=60_000,
            ),
            1,
            1e-6,
        ),
        "full batch (100 steps, δ=1e-6)": (
            privacy.full_batch(1.0, num_examples=60_000),
            100,
            1e-6,
        ),
    }


def _default_grid_epsilon(mechanism, steps, delta):
    """ε from dp-accounting's PLD on the default grid, with no closed form."""
    import dp_accounting as dpa

    accountant = dpa.pld.PLDAccountant(mechanism.neighboring_relation)
    return accountant.compose(mechanism.event(steps)).get_epsilon(delta)


def calibration_timings(targets, baseline_up_to):
    figures, ratios = {}, {}
    for name, (mechanism, steps, delta) in _calibration_schedules().items():
        for target in targets:
            start = time.perf_counter()
            z = privacy.calibrate_noise_multiplier(
                mechanism, steps, delta, target_epsilon=target
            )
            seconds = time.perf_counter() - start
            figures[f"calibrate {name}, ε={target:g} [s]"] = seconds
            figures[f"calibrate {name}, ε={target:g}: noise multiplier"] = z
            if target <= baseline_up_to:
                calibrated = mechanism.with_noise_multiplier(z)
                baseline = _time(_default_grid_epsilon, calibrated, steps, delta)
                ratios[f"calibrate {name}, ε={target:g} / one default-grid PLD ε"] = (
                    seconds / baseline
                )
    return figures, ratios


def run(quick=False):
    step_counts = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    figures, ratios = epsilon_timings(step_counts)
    epochs, steps_per_epoch = (2, 200) if quick else (4, 1_000)
    more_figures, more_ratios = callback_overhead(epochs, steps_per_epoch, 100_000)
    prefix = f"callback, epochs of {steps_per_epoch} steps ending at step 100,000"
    figures.update({f"{prefix}: {k}": v for k, v in more_figures.items()})
    ratios.update(more_ratios)
    more_figures, more_ratios = calibration_timings(
        (0.1, 1.0, 10.0, 100.0, 1000.0), baseline_up_to=1.0 if quick else 10.0
    )
    figures.update(more_figures)
    ratios.update(more_ratios)
    return {"figures": figures, "ratios": ratios}

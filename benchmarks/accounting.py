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
    return privacy.Accountant(mechanism, method).epsilon(DELTA, steps)


def epsilon_timings(step_counts):
    mechanism = privacy.dp_sgd(**MNIST)
    figures, ratios = {}, {}
    for steps in step_counts:
        for method in privacy.METHODS:
            cold = _time(_cold_epsilon, mechanism, method, steps)
            warm_accountant = privacy.Accountant(mechanism, method)
            warm_accountant.epsilon(DELTA, steps - 1_000)
            warm = _time(warm_accountant.epsilon, DELTA, steps)
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


def run(quick=False):
    step_counts = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    figures, ratios = epsilon_timings(step_counts)
    epochs, steps_per_epoch = (2, 200) if quick else (4, 1_000)
    more_figures, more_ratios = callback_overhead(epochs, steps_per_epoch, 100_000)
    prefix = f"callback, epochs of {steps_per_epoch} steps ending at step 100,000"
    figures.update({f"{prefix}: {k}": v for k, v in more_figures.items()})
    ratios.update(more_ratios)
    return {"figures": figures, "ratios": ratios}

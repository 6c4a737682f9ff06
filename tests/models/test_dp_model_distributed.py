"""DPModel split across two devices: one clipped sum, noised once.

On TensorFlow the DPModel runs under `tf.distribute.MirroredStrategy`, on
JAX under `keras.distribution.DataParallel`, each over two CPU devices.
Devices must be configured before the backend initialises, so
`dp_model_distributed_worker.py` runs every fit in a fresh process (of
the backend this suite runs under) and prints JSON; the tests here check:

- each device's program clips only its half of every batch's rows, in
  several physical batches;
- with the gradient's noise off, two devices give one device's weights
  step by step: ghost norms of Conv2D and Dense, per-layer clipping, user
  level with a row draw, a layer without a ghost norm, a weight penalty
  (added once), and a noised loss and adaptive clipping with their noise
  on (summed over the devices, noised once: the same logs);
- with every gradient zero, each step moves each coordinate by
  N(0, (z C / B)^2): the noise is added once, fresh every step;
- one example (one user) moves the global clipped sum by exactly C;
- `private_steps` counts one per step on every replica, and ε is the
  single device's;
- the contract of `tests/contract.py` holds for a distributed DPModel;
- set-ups whose step is not one sum over every device are refused before
  any step (TensorFlow: XLA under MirroredStrategy among them).
"""

import itertools
from pathlib import Path

import keras
import numpy as np
import pytest

from tests.models import dp_model_distributed_worker as setup
from tests.models.worker_results import once_per_run, round_changes, run_device_worker

WORKER = Path(__file__).with_name("dp_model_distributed_worker.py")
BACKEND = keras.backend.backend()
TOLERANCE = 1e-6
EQUIVALENT = [name for name in setup.SCENARIOS if name != "noise"]
NOISE_STD = setup.NOISE_MULTIPLIER * setup.NOISE_CLIP / setup.BATCH_SIZE


def run_worker(directory):
    return run_device_worker(WORKER, BACKEND, setup.NUM_DEVICES, directory)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's results, computed once per run even with pytest-xdist."""
    return once_per_run(
        tmp_path_factory,
        f"dp_model_distributed_{BACKEND}",
        lambda: run_worker(tmp_path_factory.mktemp("dp_model_contract")),
    )


def scenario(results, key):
    """One scenario of the worker; its traceback if it raised."""
    report = results[key]
    if "error" in report:
        pytest.fail(f"{key} raised in the worker ({BACKEND}):\n{report['error']}")
    return report


def expected_steps(name):
    if setup.SCENARIOS[name].get("unit") == "user":
        return round(len(setup.USER_COUNTS) / setup.USERS_PER_STEP)
    return round(setup.NUM_EXAMPLES / setup.BATCH_SIZE)


def replicas():
    """Copies of a variable the distributed model holds: one per device on
    TensorFlow; one global (replicated) array on JAX."""
    return setup.NUM_DEVICES if BACKEND == "tensorflow" else 1


def samples(report, steps):
    """Step i's batch `(rows, real examples)`: every draw of index i alike."""
    served = []
    for index in range(steps):
        draws = report["served"][str(index)]
        assert all(draw == draws[0] for draw in draws), index
        served.append(draws[0])
    return served


def real_rows(report, steps):
    """The examples of each step (padded to more rows on two devices)."""
    return [real for _, real in samples(report, steps)]


def changes(report):
    """The weights' change in every step."""
    return round_changes(
        {"before": report["before"], "after_round": report["after_step"]}
    )


def test_the_worker_runs_this_backend_on_two_cpu_devices(results):
    assert results["backend"] == BACKEND
    assert len(results["devices"]) == setup.NUM_DEVICES
    if BACKEND == "tensorflow":
        assert all("CPU" in device for device in results["devices"])
        assert results["num_replicas_in_sync"] == setup.NUM_DEVICES
    else:
        assert all(device.startswith("cpu") for device in results["devices"])
        assert results["jax_devices"] == setup.NUM_DEVICES
        assert results["mesh_devices"] == setup.NUM_DEVICES


def test_each_device_clips_only_its_half_of_every_batch(results):
    single = scenario(results, f"single/{setup.PROBED}")
    report = scenario(results, f"distributed/{setup.PROBED}")
    physical = setup.SCENARIOS[setup.PROBED]["physical_batch_size"]
    steps = expected_steps(setup.PROBED)
    if BACKEND == "tensorflow":
        # Built in the strategy's scope: one copy of each variable per device.
        assert set(report["copies_per_variable"]) == {setup.NUM_DEVICES}
        assert set(single["copies_per_variable"]) == {0}
    else:
        assert set(report["devices_per_variable"]) == {setup.NUM_DEVICES}
        assert set(single["devices_per_variable"]) == {1}
    served = samples(report, steps)
    # One program per device and step, in step order; on one device, one.
    assert len(report["programs"]) == setup.NUM_DEVICES * steps
    assert not single["programs"]  # Not probed.
    for step, (rows, real) in enumerate(served):
        half = rows // setup.NUM_DEVICES
        # The real rows come first: each device clips its half of them.
        first = min(len(real), half)
        pair = report["programs"][2 * step : 2 * step + 2]
        assert sorted(pair) == sorted([[half, first], [half, len(real) - first]])
        assert half >= 2 * physical  # Several physical batches per device.
    # Every physical batch the engine clips holds `physical` rows, and the
    # devices together clip each step's rows once.
    assert {rows for rows, _ in report["chunks"]} == {physical}
    assert len(report["chunks"]) == sum(rows for rows, _ in served) // physical
    assert sum(real for _, real in report["chunks"]) == sum(
        len(real) for _, real in served
    )


@pytest.mark.parametrize("name", EQUIVALENT)
def test_two_devices_give_the_single_devices_weights_step_by_step(results, name):
    single = scenario(results, f"single/{name}")
    distributed = scenario(results, f"distributed/{name}")
    steps = expected_steps(name)
    # The same batches (a function of their index), the same start.
    assert real_rows(distributed, steps) == real_rows(single, steps)
    np.testing.assert_array_equal(distributed["before"], single["before"])
    if not setup.SCENARIOS[name].get("per_layer_clipping"):
        # C clips some of the first batch's contributions, not all.
        norms = single["first_norms"]
        assert min(norms) < single["clip_norm"] < max(norms)
    if setup.SCENARIOS[name].get("unit") == "user":
        # At most k rows of each sampled user, and users with more drawn
        # from: the row draw is the single device's too.
        _, _, users = setup.make_data("mlp")
        counts = np.bincount(users)
        served = [np.bincount(users[real]) for real in real_rows(single, steps)]
        k = setup.EXAMPLES_PER_USER
        assert all(used.max(initial=0) <= k for used in served)
        assert any(np.any((used > 0) & (counts[: used.size] > k)) for used in served)
    reference = changes(single)
    assert len(reference) == steps
    for change in reference:
        # Each step moves the weights far beyond the tolerance: a sum over
        # half the rows, or counted twice, would not pass.
        assert np.abs(change).max() > 1000 * TOLERANCE
    for ours, theirs in zip(
        distributed["after_step"], single["after_step"], strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOLERANCE)
    assert distributed["replica_weights_agree"]


def test_the_weight_penalty_moves_the_weights_far_beyond_the_tolerance(results):
    # Added on every device, the penalty would move each step by twice
    # this: the equivalence above would fail.
    assert scenario(results, "single/per_layer_l2")["penalty_step"] > 1e-3


def test_the_noised_loss_is_summed_over_the_devices_and_noised_once(results):
    single = scenario(results, "single/fallback_noised_loss")
    distributed = scenario(results, "distributed/fallback_noised_loss")
    noised = [logs["noised_loss"] for logs in single["logs"]]
    assert len(noised) == expected_steps("fallback_noised_loss")
    # The noise is on: each logged value is the clipped loss sum / B plus
    # a draw of std z_l B_l / B = 0.125.
    noise = np.subtract(noised, single["clean_losses"])
    assert np.all(np.abs(noise) > 1e-4)
    assert np.all(np.abs(noise) < 6 * setup.LOSS_NOISE * setup.LOSS_BOUND / 16)
    # The same draw, added once to the sum over both devices.
    assert [logs["noised_loss"] for logs in distributed["logs"]] == pytest.approx(
        noised, rel=1e-5, abs=1e-6
    )


def test_adaptive_clipping_counts_every_device_once_and_noises_once(results):
    single = scenario(results, "single/adaptive")
    distributed = scenario(results, "distributed/adaptive")
    norms = [single["clip_norm"]] + [logs["clip_norm"] for logs in single["logs"]]
    assert len(norms) == expected_steps("adaptive") + 1
    ratios = np.log(np.divide(norms[1:], norms[:-1]))
    assert np.all(np.abs(ratios) > 1e-3)  # C moved every step.
    # The noisy centred count each step released, from C's move: without
    # noise 2 × count is an integer; the count's noise is on.
    counts = (
        setup.TARGET_QUANTILE - ratios / setup.CLIP_LEARNING_RATE - 0.5
    ) * setup.BATCH_SIZE
    assert np.max(np.abs(2 * counts - np.round(2 * counts))) > 0.05
    assert [logs["clip_norm"] for logs in distributed["logs"]] == pytest.approx(
        norms[1:], rel=1e-5
    )


@pytest.mark.parametrize("where", ["single", "distributed"])
def test_noise_is_added_once_per_step_and_fresh_each_step(results, where):
    report = scenario(results, f"{where}/noise")
    steps = changes(report)
    assert len(steps) == expected_steps("noise")
    for change in steps:
        n = change.size
        assert n > 4000
        # The std of n Gaussian draws is within 1/sqrt(2n) (1.1 %) of σ;
        # noise from both devices would give √2 σ, none 0.
        assert np.std(change) == pytest.approx(NOISE_STD, rel=0.06)
        assert abs(np.mean(change)) < 5 * NOISE_STD / np.sqrt(n)
    # A fresh draw each step (a reused one: correlation 1; 6 standard errors).
    for a, b in itertools.pairwise(steps):
        assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(a.size)


def test_two_devices_add_the_single_devices_noise_draw(results):
    single = scenario(results, "single/noise")
    distributed = scenario(results, "distributed/noise")
    steps = expected_steps("noise")
    assert real_rows(distributed, steps) == real_rows(single, steps)
    for ours, theirs in zip(
        distributed["after_step"], single["after_step"], strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("unit", ["example", "user"])
def test_one_contribution_moves_the_global_clipped_sum_by_exactly_c(results, unit):
    report = scenario(results, f"distributed/sensitivity_{unit}")
    c = setup.SENSITIVITY_CLIP
    # Its gradient is far above C: clipped to norm C, and no more.
    assert report["distance"] <= c * (1 + 1e-5)
    assert report["distance"] >= 0.99 * c
    assert report["D_private_steps"] == [1] * replicas()
    assert report["D_minus_one_private_steps"] == [1] * replicas()


@pytest.mark.parametrize("name", sorted(setup.SCENARIOS))
def test_private_steps_count_one_per_step_and_epsilon_is_the_single_devices(
    results, name
):
    single = scenario(results, f"single/{name}")
    distributed = scenario(results, f"distributed/{name}")
    steps = expected_steps(name)
    assert single["replica_private_steps"] == [steps]
    assert distributed["replica_private_steps"] == [steps] * replicas()
    assert distributed["history"]["private_steps"] == [float(steps)]
    assert [logs["private_steps"] for logs in distributed["logs"]] == list(
        range(1, steps + 1)
    )
    assert distributed["epsilon"] == single["epsilon"]
    assert distributed["statement_epsilon"] == single["statement_epsilon"]
    if name == "noise":
        assert 0 < single["epsilon"] < np.inf


def test_xla_runs_on_jax_and_is_refused_under_mirrored_strategy(results):
    if BACKEND == "jax":
        # Every JAX step is an XLA program: the equivalence above ran so.
        assert scenario(results, "distributed/conv")["jit_compile"] is True
        assert "distributed/jit" not in results
        return
    # Under MirroredStrategy XLA cannot read the other replica's variables
    # (a plain Keras model fails its first step): refused before any step.
    refusal = scenario(results, "distributed/jit")["refusal"]
    assert "jit_compile=True" in refusal["error"]
    assert "jit_compile=False" in refusal["error"]
    assert refusal["steps_begun"] == 0
    assert refusal["weights_kept"]
    assert refusal["private_steps"] == [0] * setup.NUM_DEVICES


@pytest.mark.parametrize("name", setup.CONTRACT_CASES)
def test_a_distributed_dp_model_keeps_the_contract(results, name):
    report = scenario(results, "distributed/contract")[name]
    if report["outcome"] != "passed":
        pytest.fail(f"The contract of {name} failed ({BACKEND}):\n{report['outcome']}")
    # Every model it fitted (also those it loaded) ran on both devices.
    fitted = report["devices_of_fitted_models"]
    assert len(fitted) >= 4
    assert set(fitted) == {setup.NUM_DEVICES}


def test_set_ups_that_would_not_sum_over_every_device_are_refused(results):
    report = scenario(results, "refusals")
    if BACKEND == "jax":
        expected = {
            "model_parallel": "ModelParallel would shard the weights",
            "one_of_two_devices": "spans 1 of the 2 devices",
        }
    else:
        expected = {
            "central_storage": "CentralStorageStrategy would update",
            # A cryptic TypeError mid-fit before the check.
            "network_in_another_scope": "belongs to another tf.distribute strategy",
            # Each replica would update the one copy (count each step twice).
            "model_outside_the_scope": "was created outside the scope",
            "optimizer_accumulation": "use physical_batch_size",
        }
    assert set(report) == set(expected)
    for name, message in expected.items():
        refusal = scenario(report, name)["refusal"]
        assert refusal is not None, name  # It trained.
        assert message in refusal["error"]
        assert refusal["steps_begun"] == 0
        assert refusal["weights_kept"]
        assert set(refusal["private_steps"]) == {0}

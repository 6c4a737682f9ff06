"""FedEmbModel rounds split across two devices: noise once per round.

On TensorFlow the model runs under `tf.distribute.MirroredStrategy`, on
JAX under `keras.distribution.DataParallel`, each over two CPU devices.
Devices must be configured before the backend initialises, so
`distributed_worker.py` runs the rounds in a fresh process (of the
backend this suite runs under) and prints JSON; the tests here check it:

- the round's client axis really is split over the two devices;
- with no noise and no clipping the distributed rounds give the same
  backbone as the same rounds on one device (clients summed across
  devices once, divided by M once);
- with the clients' updates zero, each round moves every coordinate by
  N(0, (z C / M)^2): the noise is added once per round, not once per
  device, and is fresh in every round;
- `private_steps` counts one per round, also on rounds whose number is
  unknown up front (TensorFlow refuses those without `steps_per_epoch`);
- with adaptive clipping, the count of clients within C is summed over
  the devices and noised once: C ends as on one device.
"""

from pathlib import Path

import keras
import numpy as np
import pytest

from tests.models import distributed_worker as setup
from tests.models.worker_results import once_per_run, round_changes, run_device_worker

WORKER = Path(__file__).with_name("distributed_worker.py")
BACKEND = keras.backend.backend()
HALF = setup.MAX_CLIENTS // setup.NUM_DEVICES
NOISE_STD = setup.NOISE_MULTIPLIER * setup.NOISE_CLIP / setup.CLIENTS_PER_ROUND


def run_worker():
    return run_device_worker(WORKER, BACKEND, setup.NUM_DEVICES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's results, computed once per run even with pytest-xdist."""
    return once_per_run(tmp_path_factory, f"fedemb_distributed_{BACKEND}", run_worker)


def scenario(results, key):
    """One scenario of the worker; its traceback if it raised."""
    report = results[key]
    if "error" in report:
        pytest.fail(f"{key} raised in the worker ({BACKEND}):\n{report['error']}")
    return report


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


@pytest.mark.parametrize("name", sorted(setup.SCENARIOS))
def test_the_clients_of_a_round_are_split_across_the_devices(results, name):
    report = scenario(results, f"distributed/{name}")
    # Every round samples clients into both halves of the client axis, so
    # each device trains some of them.
    assert len(report["served"]) == setup.ROUNDS
    for served in report["served"]:
        assert any(served["mask"][:HALF]) and any(served["mask"][HALF:]), served
    # Each device's program trains only its half of the rows: a replica's
    # (TensorFlow) or a shard_map body's (JAX), never the whole round.
    rows = report["rows_per_program"]
    assert rows and set(rows) == {HALF}
    if BACKEND == "tensorflow":
        # Built in the strategy's scope: one copy of each variable per
        # device; the step is traced once per replica.
        assert report["copies_per_variable"] == [setup.NUM_DEVICES] * 2
        assert len(rows) % setup.NUM_DEVICES == 0
    else:
        # Replicated variables; all clients of a device train at once.
        assert report["devices_per_variable"] == [setup.NUM_DEVICES] * 2
        assert report["client_parallelism"] == setup.MAX_CLIENTS


@pytest.mark.parametrize("name", ["equivalence", "server_clipvalue"])
def test_distributed_rounds_equal_the_same_rounds_on_one_device(results, name):
    # server_clipvalue: the server optimizer clips what it is given, so it
    # must be given the round's noised mean once, not each replica's share.
    single = scenario(results, f"single/{name}")
    distributed = scenario(results, f"distributed/{name}")
    # The same rounds, and no extra round built (e.g. to learn shapes).
    assert distributed["served"] == single["served"]
    np.testing.assert_array_equal(distributed["before"], single["before"])
    reference = round_changes(single)
    assert len(reference) == setup.ROUNDS
    for change in reference:
        # Each round moves the backbone well beyond the tolerance below:
        # a sum counted twice or divided by M twice would not pass.
        assert np.abs(change).max() > 1e-3
        assert np.std(change) > 5e-4
    for ours, theirs in zip(
        distributed["after_round"], single["after_round"], strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6)


def test_adaptive_clipping_counts_the_clients_of_every_device_once(results):
    single = scenario(results, "single/adaptive")
    distributed = scenario(results, "distributed/adaptive")
    assert distributed["served"] == single["served"]
    (c_single,) = single["clip_norms"]
    # Every replica holds the same C, the single device's.
    assert c_single != pytest.approx(0.02, rel=1e-3)  # C moved.
    for c in distributed["clip_norms"]:
        assert c == pytest.approx(c_single, rel=1e-5)
    assert distributed["history"]["clip_norm"] == pytest.approx(
        single["history"]["clip_norm"], rel=1e-5
    )
    np.testing.assert_allclose(distributed["after"], single["after"], rtol=0, atol=2e-6)


@pytest.mark.parametrize("where", ["single", "distributed"])
def test_noise_is_added_once_per_round_and_fresh_each_round(results, where):
    report = scenario(results, f"{where}/noise")
    changes = round_changes(report)
    assert len(changes) == setup.ROUNDS
    for change in changes:
        n = change.size
        assert n > 4000
        # The std of n Gaussian draws is within 1/sqrt(2n) (1.1 %) of σ;
        # noise from both devices would give √2 σ (or 2 σ), noise from
        # half the devices' updates σ / 2, none 0.
        assert np.std(change) == pytest.approx(NOISE_STD, rel=0.06)
        assert abs(np.mean(change)) < 5 * NOISE_STD / np.sqrt(n)
    # A fresh draw each round: the rounds' noise is uncorrelated (a reused
    # draw would give correlation 1; the tolerance is 6 standard errors).
    correlation = np.corrcoef(changes[0], changes[1])[0, 1]
    assert abs(correlation) < 6 / np.sqrt(changes[0].size)


def test_tree_noise_is_drawn_once_and_its_state_kept_as_on_one_device(results):
    # The server steps are the tree's noise alone (the updates vanish): the
    # distributed rounds add the single device's noise, round by round, so
    # the noise is added once and the open nodes stay one state.
    single = scenario(results, "single/tree")
    distributed = scenario(results, "distributed/tree")
    assert distributed["served"] == single["served"]
    changes = round_changes(single)
    assert len(changes) == setup.ROUNDS
    for change in changes:
        assert np.std(change) > 0.5 * NOISE_STD  # Noise was added.
    for ours, theirs in zip(
        distributed["after_round"], single["after_round"], strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("where", ["single", "distributed"])
@pytest.mark.parametrize("name", sorted(setup.SCENARIOS))
def test_private_steps_counts_one_per_round(results, where, name):
    report = scenario(results, f"{where}/{name}")
    assert report["private_steps"] == setup.ROUNDS
    assert report["history"]["private_steps"] == [float(setup.ROUNDS)]


def test_rounds_of_unknown_number_are_refused_or_counted_exactly(results):
    report = scenario(results, "distributed/unknown_length")
    if BACKEND == "tensorflow":
        # Keras would call the step once more at the end on one replica
        # only, and the replicas' private_steps would disagree ([3, 2]).
        assert report["refused"] is not None
        assert "steps_per_epoch" in report["refused"]
        assert "to_tf_dataset()" in report["refused"]
        assert report["steps_after_refusal"] == [0] * setup.NUM_DEVICES
        expected = [setup.ROUNDS] * setup.NUM_DEVICES
    else:
        expected = [setup.ROUNDS]  # One global variable.
    assert report["replica_private_steps"] == expected
    assert report["budget_steps"] == setup.ROUNDS
    assert report["history"]["private_steps"] == [float(setup.ROUNDS)]

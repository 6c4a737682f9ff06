"""LastLayerDPClassifier and feature extraction on two devices.

On TensorFlow the models run under `tf.distribute.MirroredStrategy`, on
JAX under `keras.distribution.DataParallel`, each over two CPU devices;
`last_layer_distributed_worker.py` runs every scenario in one fresh
process per backend (the devices must be configured before the backend
initialises), once without distribution and once distributed, and the
tests here check it:

- `kdpemb.features.extract` gives the same features on two devices, each
  device running the backbone on its half of every batch;
- the DP-SGD head (example and user level) takes the same steps on two
  devices as on one with the noise off: each device clips its half of
  the padded batch, and the sum spans both;
- with the noise on, each step adds N(0, (zC/B)²) once, the single
  device's draw, fresh each step;
- removing one example (one user) moves the clipped sum of a step split
  over both devices by at most C;
- the closed forms (dp-ls, dp-newton, dp-fc) compute on the host under
  the engine as without it, and every replica holds the result;
- an engine DP-SGD does not support, and a job of several hosts, are
  refused before any step.
"""

import itertools
import math
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest

import kdpemb
from kdpemb.distribute.hosts import Hosts
from kdpemb.models.last_layer import LastLayerDPClassifier
from tests.models import last_layer_distributed_worker as setup
from tests.models.worker_results import once_per_run, run_device_worker

WORKER = Path(__file__).with_name("last_layer_distributed_worker.py")
BACKEND = keras.backend.backend()
DEVICES = setup.NUM_DEVICES


def run_worker():
    return run_device_worker(WORKER, BACKEND, DEVICES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's results, computed once per run even with pytest-xdist."""
    return once_per_run(
        tmp_path_factory, f"last_layer_distributed_{BACKEND}", run_worker
    )


def scenario(results, key):
    """One scenario of the worker; its traceback if it raised."""
    report = results[key]
    if "error" in report:
        pytest.fail(f"{key} raised in the worker ({BACKEND}):\n{report['error']}")
    return report


def steps_of(report):
    """Each step's change of the head's weights."""
    states = [np.asarray(report["before"])] + [
        np.asarray(w) for w in report["after_step"]
    ]
    return [after - before for before, after in itertools.pairwise(states)]


def assert_split_over_the_devices(report, rows_per_slot=1):
    """Every batch is padded to whole shares (of whole users), and each
    device's program clips only its share: on JAX the `shard_map` body's
    static rows are half a batch; on TensorFlow both replicas trace it."""
    padded = report["padded_rows"]
    assert padded and all(rows % (DEVICES * rows_per_slot) == 0 for rows in padded)
    programs = report["programs"]
    if BACKEND == "tensorflow":
        assert {p["replica"] for p in programs} == set(range(DEVICES))
    else:
        assert {p["rows"] for p in programs} == {rows // DEVICES for rows in padded}


def test_the_worker_runs_this_backend_on_two_cpu_devices(results):
    assert results["backend"] == BACKEND
    assert len(results["devices"]) == DEVICES
    if BACKEND == "tensorflow":
        assert all("CPU" in device for device in results["devices"])
        assert results["num_replicas_in_sync"] == DEVICES
    else:
        assert all(device.startswith("cpu") for device in results["devices"])
        assert results["mesh_devices"] == DEVICES


def test_features_on_two_devices_equal_one_device_a_share_per_device(results):
    single = scenario(results, "single/features")
    distributed = scenario(results, "distributed/features")
    for key in ("features", "pair_features"):
        ours, theirs = np.asarray(distributed[key]), np.asarray(single[key])
        assert ours.shape == (setup.NUM_IMAGES, setup.FEATURE_DIM)
        assert np.abs(theirs).max() > 1e-2  # Not all zeros.
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    assert distributed["pair_labels"] == list(range(setup.NUM_IMAGES))
    # Batches of 4, 4 and 1 (padded to 2): each device runs half of each.
    calls = distributed["calls"]
    if BACKEND == "tensorflow":
        # One trace per replica and batch shape, for each of the two calls.
        expected = [{"rows": r, "replica": i, "replicas": DEVICES} for r in (2, 1)
                    for i in range(DEVICES)]  # fmt: skip
        assert calls == expected * 2
        assert all(call["replicas"] == 1 for call in single["calls"])
    else:
        expected = [{"rows": r, "devices": DEVICES, "shard_rows": r // DEVICES}
                    for r in (4, 4, 2)]  # fmt: skip
        assert calls == expected * 2
        assert all(call["devices"] == 1 for call in single["calls"])


@pytest.mark.parametrize(
    ("name", "steps", "rows_per_slot"),
    [
        ("equivalence", setup.STEPS, 1),
        ("clipping_optimizer", setup.STEPS, 1),
        ("user_equivalence", setup.USER_STEPS, setup.EXAMPLES_PER_USER),
    ],
)
def test_dp_sgd_head_on_two_devices_equals_one_device_step_by_step(
    results, name, steps, rows_per_slot
):
    single = scenario(results, f"single/{name}")
    distributed = scenario(results, f"distributed/{name}")
    # The same samples, from the same head.
    assert distributed["served"] == single["served"]
    assert len(single["served"]) == steps
    assert distributed["before"] == single["before"]
    reference = steps_of(single)
    assert len(reference) == steps
    for change in reference:
        # Each step moves the head well beyond the tolerance below: a sum
        # counted on both devices, or on one only, would not pass.
        assert np.abs(change).max() > 1e-2
    for ours, theirs in zip(steps_of(distributed), reference, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    # Every replica holds the same head and counts every step once.
    replicas = 1 if BACKEND == "jax" else DEVICES
    assert distributed["private_steps"] == [[steps]] * replicas
    assert distributed["history"]["private_steps"] == [float(steps)]
    kernels = np.asarray(distributed["kernel_replicas"])
    assert len(kernels) == replicas
    np.testing.assert_array_equal(kernels, kernels[[0] * replicas])
    assert_split_over_the_devices(distributed, rows_per_slot)


def test_dp_sgd_noise_is_drawn_once_per_step_and_fresh_each_step(results):
    single = scenario(results, "single/noise")
    distributed = scenario(results, "distributed/noise")
    assert distributed["served"] == single["served"]
    sigma = setup.NOISE_MULTIPLIER * setup.NOISE_CLIP / setup.NOISE_BATCH
    changes = steps_of(distributed)
    assert len(changes) == setup.NOISE_STEPS
    for ours, theirs in zip(changes, steps_of(single), strict=True):
        # The single device's draw, added once: noise from both replicas
        # would differ from it by about σ per coordinate, none by σ.
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * sigma)
    for change in changes:
        n = change.size
        assert n > 4000
        # The std of n Gaussian draws is within 1/sqrt(2n) (1.1 %) of σ;
        # noise from both devices would give √2 σ, from none about 0.
        assert np.std(change) == pytest.approx(sigma, rel=0.06)
        assert abs(np.mean(change)) < 5 * sigma / np.sqrt(n)
    correlation = np.corrcoef(changes[0], changes[1])[0, 1]
    assert abs(correlation) < 6 / np.sqrt(changes[0].size)
    assert_split_over_the_devices(distributed)


@pytest.mark.parametrize("unit", ["example", "user"])
def test_removing_one_unit_moves_the_global_clipped_sum_by_at_most_c(results, unit):
    report = scenario(results, "distributed/removal")
    with_it = np.asarray(report[f"{unit}/all"])
    without = np.asarray(report[f"{unit}/without"])
    moved = np.linalg.norm(with_it - without)
    clip = setup.REMOVAL_CLIP
    # Every contribution is clipped (its norm is above 1 > C), so removing
    # one moves the sum by exactly C: at most C, and not 0 or 2C (a sum
    # that missed a device's rows, or counted them twice).
    assert moved <= clip * (1 + 1e-5)
    assert moved >= clip * (1 - 1e-3)
    assert np.linalg.norm(with_it) > 10 * clip  # Many contributions.
    programs = report[f"{unit}/all/programs"]
    if BACKEND == "jax":  # The full batch, padded to whole shares.
        k = 1 if unit == "example" else setup.EXAMPLES_PER_USER
        slots = DEVICES * math.ceil(math.ceil(setup.NUM_EXAMPLES / k) / DEVICES)
        assert {p["rows"] for p in programs} == {slots * k // DEVICES}
    else:
        assert {p["replica"] for p in programs} == set(range(DEVICES))


@pytest.mark.parametrize("method", sorted(setup.CLOSED_FORMS))
def test_closed_forms_under_the_engine_equal_one_device(results, method):
    single = scenario(results, "single/closed_forms")[method]
    distributed = scenario(results, "distributed/closed_forms")[method]
    (kernel,) = single["kernel_replicas"]
    assert np.abs(kernel).max() > 1e-3  # The step moved the head.
    replicas = 1 if BACKEND == "jax" else DEVICES
    # Host statistics, noised once: every replica holds the single result.
    assert distributed["kernel_replicas"] == [kernel] * replicas
    steps = setup.CLOSED_FORMS[method]
    assert distributed["private_steps"] == [[steps]] * replicas


@pytest.mark.parametrize("method", ["dp-sgd", "dp-ls"])
def test_an_unsupported_engine_is_refused_before_any_step(results, method):
    report = scenario(results, "distributed/unsupported_engine")[method]
    message = report["refused"]
    assert message is not None
    if BACKEND == "tensorflow":
        assert "CentralStorageStrategy" in message
        assert "MirroredStrategy" in message  # The fix.
    else:
        assert "ModelParallel" in message
        assert "DataParallel()" in message  # The fix.
    assert not report["built"]
    assert report["private_steps"] == [[0]]


def test_extract_on_several_hosts_is_refused_before_the_backbone_runs(results):
    report = scenario(results, "distributed/hosts")
    assert "2 hosts" in report["refused"]
    assert "on one host" in report["refused"]
    assert report["calls"] == []


@pytest.mark.parametrize("method", ["dp-sgd", "dp-newton"])
def test_a_job_of_several_hosts_is_refused_before_any_step(monkeypatch, method):
    hosts = Hosts(0, 2, lambda words: np.stack([words] * 2), engine="test")
    monkeypatch.setattr(kdpemb.distribute, "current_hosts", lambda model=None: hosts)
    settings = {"feature_clip_norm": 1.0} if method != "dp-sgd" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The fixed seed warns.
        model = LastLayerDPClassifier(
            2, method, noise_multiplier=1.0, delta=1e-3, seed=0, **settings
        )
    features = np.ones((8, 3), "float32")
    with pytest.raises(ValueError, match="spans 2 hosts") as refused:
        model.fit(features, np.arange(8) % 2, verbose=0)
    assert "fit there" in str(refused.value)
    assert not model.built
    assert int(keras.ops.convert_to_numpy(model.private_steps)) == 0

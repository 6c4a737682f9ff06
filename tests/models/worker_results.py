"""What the tests of worker processes share: a worker on several CPU
devices (started, and configured before its backend initialises), its
results computed once per test run, and the backbone's change in every
round. Imports no backend: a worker imports it first."""

import contextlib
import fcntl
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_device_worker(worker, backend, devices, *args):
    """Runs the script `worker` (with `args`) on `backend` over `devices`
    CPU devices (JAX: host devices from `XLA_FLAGS`; TensorFlow: the worker
    splits its CPU, `configure_cpu_devices`), and returns the JSON object
    of its last line of output."""
    env = dict(os.environ, KERAS_BACKEND=backend, CUDA_VISIBLE_DEVICES="-1")
    if backend == "jax":
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={devices}"
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(worker), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
    )  # No timeout: one process, bounded work, no peer to wait for.
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def configure_cpu_devices(backend, devices):
    """In a worker, before its backend initialises: `devices` CPU devices
    (TensorFlow: logical devices of the one CPU; JAX: those `XLA_FLAGS`
    gave it), and their names."""
    if backend == "tensorflow":
        import tensorflow as tf

        (cpu,) = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * devices
        )
        return [d.name for d in tf.config.list_logical_devices("CPU")]
    if backend == "jax":
        import jax

        return [str(d) for d in jax.devices()]
    raise SystemExit(f"KERAS_BACKEND must be tensorflow or jax, got {backend!r}")


def once_per_run(tmp_path_factory, name, compute):
    """`compute()` (JSON-serialisable), run once per test run: under
    pytest-xdist the first worker computes it and the others read its file."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    shared = tmp_path_factory.getbasetemp().parent / name
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            return json.loads(Path(f"{shared}.json").read_text())
        data = compute()
        Path(f"{shared}.json").write_text(json.dumps(data))
        return data


def round_changes(report):
    """The backbone's change in every round (`report["before"]`, then
    `report["after_round"]`), one flat array each."""
    states = [np.asarray(report["before"])] + [
        np.asarray(w) for w in report["after_round"]
    ]
    return [after - before for before, after in itertools.pairwise(states)]

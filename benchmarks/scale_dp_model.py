"""DP-SGD (`DPModel`) steps/s on one device and on two, on one machine.

A part of `python -m benchmarks scale` (`dp_model`). One fixed DP-SGD
setting — example level, Poisson sampling of an expected logical batch B,
split into physical batches, `small_cnn` with a 10-class output, noise
on — is trained by a fresh process for each job, on the current Keras
backend:

- **1 device**: no strategy, no distribution (the plain `DPModel`);
- **2 devices**: TensorFlow splits the CPU into two logical devices
  (`tf.config.set_logical_device_configuration`) and builds the model in
  a `tf.distribute.MirroredStrategy` over both; JAX gets two CPU devices
  (`--xla_force_host_platform_device_count=2` in `XLA_FLAGS`) and
  `keras.distribution.DataParallel(devices=jax.devices())`. Each device
  clips its share of every logical batch; the clipped sums are added and
  the noise drawn once (`docs/scaling.md`).

Each process is pinned to this process's cores (`os.sched_setaffinity`)
with as many threads (`OMP_NUM_THREADS`, `TF_NUM_INTRAOP_THREADS` /
`TF_NUM_INTEROP_THREADS` and `tf.config.threading`), as
`benchmarks.scale` pins its one-process job: the two devices share the
same cores as the one device. An epoch is `warmup_steps + steps` steps;
the first `warmup_steps` (compilation) are not timed, and every step is
waited for (its logs read). Steps/s is 1 / the median time of a timed
step: on JAX a Poisson batch padded to a size not met before compiles
the step again (`PoissonBatches`' "multiple" padding: a few sizes), an
outlier the median leaves out; "every timed step" counts them too.
Examples/s is B / the median step time (B the expected logical batch).
The one-device job runs first and again last (the load of a shared
machine drifts); the ratio is to the mean of the two.

**GPU.** Where the backend sees two or more GPUs, the same jobs run on
one GPU (`CUDA_VISIBLE_DEVICES` its first) and on all of them
(`MirroredStrategy()`, `DataParallel()`); with one GPU the output says
"one GPU", with none "no GPU".

Usage:

    python -m benchmarks scale                  # with the other parts
    python -m benchmarks.scale_dp_model [--quick]   # this part, as JSON

No figure is asserted: compare the ratios of one run.
"""

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Nothing here imports Keras at module level: a worker pins its cores and
# threads and configures its devices before the backend starts.

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class DPScaleConfig:
    """The DP-SGD step (B, the physical batch, the network) and the sizes."""

    batch_size: int = 256  # B, the expected logical batch (Poisson).
    physical_batch_size: int = 64
    image_size: int = 32
    width: int = 8
    groups: int = 4
    classes: int = 10
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    warmup_steps: int = 3
    steps: int = 20
    devices: int = 2  # Of the multi-device job on the CPU.
    timeout_s: int = 900  # Per job.


QUICK = DPScaleConfig(
    batch_size=16,
    physical_batch_size=8,
    image_size=8,
    width=4,
    groups=2,
    warmup_steps=1,
    steps=2,
)


def describe(config):
    """The setting in words.

    Example:

    >>> describe(QUICK)[:35]
    'DPModel example level, Poisson B=16'
    """
    size = config.image_size
    return (
        f"DPModel example level, Poisson B={config.batch_size} (physical "
        f"{config.physical_batch_size}), small_cnn {size}x{size}x3 width "
        f"{config.width} -> {config.classes} classes, C={config.clip_norm}, "
        f"z={config.noise_multiplier}; {config.warmup_steps} warm-up steps, "
        f"{config.steps} timed"
    )


def _jobs(devices):
    """`[(label, devices)]`: one device first and again last.

    Example:

    >>> _jobs(2)
    [('1 device', 1), ('2 devices', 2), ('1 device (again, last)', 1)]
    """
    return [("1 device", 1), (f"{devices} devices", devices),
            ("1 device (again, last)", 1)]  # fmt: skip


# ------------------------------------------------------------ a job --


def _xla_flags(flags, devices):
    """`flags` without a host device count, plus one for `devices` > 1.

    Example:

    >>> _xla_flags("--a=1 --xla_force_host_platform_device_count=8", 2)
    '--a=1 --xla_force_host_platform_device_count=2'
    >>> _xla_flags("--a=1 --xla_force_host_platform_device_count=8", 1)
    '--a=1'
    """
    kept = [
        flag
        for flag in (flags or "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    if devices > 1:
        kept.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(kept)


def _environment(backend, platform, devices, threads):
    env = dict(
        os.environ,
        KERAS_BACKEND=backend,
        OMP_NUM_THREADS=str(threads),
        TF_NUM_INTRAOP_THREADS=str(threads),
        TF_NUM_INTEROP_THREADS=str(threads),
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
        ),
    )
    env.pop("TF_CONFIG", None)
    if platform == "cpu":
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="-1")
        env["XLA_FLAGS"] = _xla_flags(env.get("XLA_FLAGS"), devices)
    else:
        env.pop("JAX_PLATFORMS", None)
        if devices == 1:  # The first of the visible GPUs.
            visible = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            env["CUDA_VISIBLE_DEVICES"] = visible.strip() or "0"
    return env


def _run_job(config, devices, backend, platform="cpu"):
    """One job in a fresh process; its report."""
    from benchmarks.scale import available_cores, core_layout

    (cores,), threads = core_layout(available_cores(), 1)
    with tempfile.TemporaryDirectory(prefix="kdpemb-scale-dp-") as directory:
        spec = {
            "devices": devices,
            "platform": platform,
            "cores": cores,
            "threads": threads,
            "out": os.path.join(directory, "report.json"),
            "config": dataclasses.asdict(config),
        }
        command = [sys.executable, "-m", "benchmarks.scale_dp_model", "--worker"]
        done = subprocess.run(
            [*command, json.dumps(spec)],
            env=_environment(backend, platform, devices, threads),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=config.timeout_s,
        )
        if done.returncode != 0:
            output = (done.stdout + done.stderr)[-4000:]
            raise RuntimeError(
                f"{backend} DPModel job on {devices} {platform} device(s) exited "
                f"with {done.returncode}:\n{output}"
            )
        report = json.loads(Path(spec["out"]).read_text())
    report.update(cores=cores, threads=threads)
    return report


def _worker(spec):
    """One job (`python -m benchmarks.scale_dp_model --worker SPEC`)."""
    spec = json.loads(spec)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec["cores"])
    config = DPScaleConfig(**spec["config"])
    devices, threads = spec["devices"], spec["threads"]
    backend = os.environ["KERAS_BACKEND"]
    strategy = None
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        if devices > 1 and spec["platform"] == "cpu":
            (cpu,) = tf.config.list_physical_devices("CPU")
            logical = [tf.config.LogicalDeviceConfiguration()] * devices
            tf.config.set_logical_device_configuration(cpu, logical)
            names = [d.name for d in tf.config.list_logical_devices("CPU")]
            strategy = tf.distribute.MirroredStrategy(names)
        elif devices > 1:
            strategy = tf.distribute.MirroredStrategy()
    import keras

    if backend == "jax" and devices > 1:
        import jax

        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices())
        )
    report = _time_steps(config, strategy)
    if report["devices"] != devices and spec["platform"] == "cpu":
        raise RuntimeError(
            f"The model splits its batches over {report['devices']} devices, "
            f"not the {devices} of this job."
        )
    with open(spec["out"], "w") as file:
        json.dump(report, file)


def _time_steps(config, strategy):
    """Fits one epoch of `warmup_steps + steps` steps; the times of the
    last `steps`."""
    import contextlib
    import warnings

    import keras
    import numpy as np

    from kdpemb.models import DPModel, small_cnn
    from kdpemb.models._shared import data_parallel

    steps = config.warmup_steps + config.steps
    rows = config.batch_size * steps  # An epoch of round(N / B) = `steps` steps.
    rng = np.random.default_rng(0)
    shape = (config.image_size, config.image_size, 3)
    x = rng.integers(0, 256, (rows, *shape)).astype("float32")
    y = rng.integers(0, config.classes, rows).astype("int32")
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    # A fixed seed warns (predictable noise): a benchmark, not a release.
    with scope, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        network = small_cnn(shape, config.classes, config.width, config.groups)
        model = DPModel(
            network,
            clip_norm=config.clip_norm,
            noise_multiplier=config.noise_multiplier,
            delta=0.1 / rows,
            physical_batch_size=config.physical_batch_size,
            seed=0,
        )
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    clock = _step_clock()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = dict(batch_size=config.batch_size, epochs=1, verbose=0)
        model.fit(x, y, callbacks=[clock], **fit)
    ends, warm = clock.ends, config.warmup_steps
    pairs = zip(ends[warm - 1 : -1], ends[warm:], strict=True)
    intervals = [end - begin for begin, end in pairs]
    median = statistics.median(intervals)
    return {
        "steps": len(intervals),
        "steps_per_second": 1 / median,
        "examples_per_second": config.batch_size / median,
        "steps_per_second_all": len(intervals) / (ends[-1] - ends[warm - 1]),
        "step_seconds_median": median,
        "step_seconds": intervals,
        "first_step_seconds": ends[0] - start,
        "private_steps": clock.steps[-1],
        "devices": data_parallel.device_count(model),
        "device_kinds": _device_kinds(),
    }


def _device_kinds():
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return sorted({d.platform for d in jax.devices()})
    import tensorflow as tf

    return sorted({d.device_type for d in tf.config.list_logical_devices()})


def _step_clock():
    import keras

    class StepEnds(keras.callbacks.Callback):
        """The time each step ends; reading its logs waits for the step."""

        def __init__(self):
            super().__init__()
            self.ends, self.steps = [], []

        def on_train_batch_end(self, batch, logs=None):
            steps = float(keras.ops.convert_to_numpy(logs["private_steps"]))
            self.ends.append(time.perf_counter())
            self.steps.append(steps)

    return StepEnds()


# ------------------------------------------------------------- GPUs --


def gpu_count(backend):
    """The GPUs a fresh process of `backend` sees (0 without an NVIDIA or
    AMD device node: no process is started)."""
    nodes = [*Path("/dev").glob("nvidia[0-9]*"), *Path("/dev").glob("kfd")]
    if not nodes:
        return 0
    probe = {
        "jax": "import jax; print(len([d for d in jax.devices() "
        "if d.platform == 'gpu']))",
        "tensorflow": "import tensorflow as tf; "
        "print(len(tf.config.list_physical_devices('GPU')))",
    }[backend]
    env = dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="3", XLA_PYTHON_CLIENT_PREALLOCATE="false"
    )
    env.pop("JAX_PLATFORMS", None)
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    numbers = re.findall(r"^\d+$", done.stdout, re.MULTILINE)
    return int(numbers[-1]) if done.returncode == 0 and numbers else 0


# ---------------------------------------------------------- the part --


def _measure(config, backend, platform, devices, name):
    """The jobs' figures and ratios, keys prefixed with `name`."""
    figures, reports = {}, {}
    for label, count in _jobs(devices):
        report = _run_job(config, count, backend, platform)
        reports[label] = report
        key = f"{name} {label}"
        figures[f"{key}: steps/s"] = report["steps_per_second"]
        figures[f"{key}: examples/s"] = report["examples_per_second"]
        figures[f"{key}: steps/s, every timed step"] = report["steps_per_second_all"]
        figures[f"{key}: first step incl. compile (s)"] = report["first_step_seconds"]
    first, last = reports["1 device"], reports["1 device (again, last)"]
    baseline = statistics.fmean(r["steps_per_second"] for r in (first, last))
    many = f"{devices} devices"
    ratios = {
        f"{name} 1 device: last / first steps/s (load drift)": (
            last["steps_per_second"] / first["steps_per_second"]
        ),
        f"{name} steps/s, {many} / 1 device": reports[many]["steps_per_second"]
        / baseline,
    }
    return figures, ratios, reports


def run(quick=False, config=None, backend=None, gpus=None):
    """DPModel steps/s on 1 and 2 CPU devices (and 1 and all GPUs, where
    there are 2+); ratios to one device."""
    config = config or (QUICK if quick else DPScaleConfig())
    backend = backend or os.environ.get("KERAS_BACKEND", "tensorflow")
    from benchmarks.scale import available_cores

    cores = available_cores()
    engine = {
        "jax": "DataParallel over --xla_force_host_platform_device_count CPU devices",
        "tensorflow": "MirroredStrategy over logical CPU devices",
    }.get(backend, backend)
    figures = {
        "DPModel setting": describe(config),
        "DPModel CPU engine": f"{backend}: {engine}",
        "DPModel CPU pinning": f"every job on cores {cores}, {len(cores)} threads",
    }
    measured, ratios, reports = _measure(
        config, backend, "cpu", config.devices, "DPModel CPU"
    )
    figures.update(measured)
    gpus = gpu_count(backend) if gpus is None else gpus
    gpu_key = "DPModel GPU steps/s, all GPUs / 1 GPU"
    if gpus < 2:
        says = "no GPU" if gpus == 0 else "one GPU"
        figures["DPModel GPU"] = says
        ratios[gpu_key] = says
    else:
        figures["DPModel GPU"] = f"{gpus} GPUs"
        measured, gpu_ratios, gpu_reports = _measure(
            config, backend, "gpu", gpus, "DPModel GPU"
        )
        figures.update(measured)
        ratios.update(gpu_ratios)
        reports.update({f"GPU {k}": v for k, v in gpu_reports.items()})
    return {
        "figures": figures,
        "ratios": ratios,
        "reports": reports,
        "config": dataclasses.asdict(config),
    }


def main(argv=None):
    """`python -m benchmarks.scale_dp_model [--quick]`, as JSON."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--worker"] and len(args) == 2:
        _worker(args[1])
        return 0
    if set(args) - {"--quick"}:
        print(main.__doc__)
        return 2
    print(json.dumps(run("--quick" in args), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scaling out: one round over 1, 2 and 4 processes; reader memory; GPU;
DP-SGD on 1 and 2 devices.

Four parts, each against a baseline measured in the same run:

1. **Round throughput over local processes** (`throughput()`, CPU). One
   fixed DP-FedEmb round — the same M_max client rows (every row a full
   client: `sampling="fixed"` of all M users), local steps S, batch B and
   `small_cnn` backbone for every process count — trained by a job of 1,
   2 and 4 processes on this machine, the rows split over the processes,
   on the current Keras backend:

   - JAX: each process is one host of `jax.distributed`
     (`keras.distribution.initialize` on a localhost port), one CPU device
     each, with `DataParallel(auto_shard_dataset=False)`; the model trains
     every row of its device at once (`client_parallelism="all"`, what
     FedEmbModel picks under a distribution; the one process too);
   - TensorFlow: each process is a `MultiWorkerMirroredStrategy` worker
     on localhost ports (the one process: no strategy), clients one after
     another (`client_parallelism=1`, TensorFlow's default).

   The processes are started by this module (`python -m benchmarks.scale
   --worker SPEC`, one per host) and each is pinned to its share of the
   cores (`os.sched_setaffinity`: `cores // processes` cores each, or one
   core per process, shared, when there are more processes than cores)
   with as many intra- and inter-op threads (`OMP_NUM_THREADS`,
   `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS` and
   `tf.config.threading`; XLA sizes its CPU pool from the affinity). The
   first `warmup_rounds` rounds (compilation) are not timed; then the
   chief times `rounds` rounds, each waited for (its logs read), and
   reports rounds/s and the ratio to the one-process job, which runs
   first and again last (the load of a shared machine drifts; the ratios
   are to the mean of the two). On JAX one more process trains the
   clients one after another (`client_parallelism=1`, its CPU default
   without a distribution). More processes than cores oversubscribe the
   machine (4 processes on a 2-core machine: two per core), and the
   output says so.
2. **Reader memory** (`reader()`): `benchmarks.reader_memory.
   reader_memory` at 1e5, 1e6 and 1e7 images of 10,000 users and at the
   10M-user index ("not available" where that module is missing).
3. **GPU** (`gpu()`): where the backend sees a GPU, `benchmarks.fedemb.
   speed()`'s ratio of a round's examples/s to centralized training at
   the same total batch (goal >= 0.5); "no GPU" otherwise.
4. **DP-SGD on several devices** (`dp_model()`): `DPModel` steps/s and
   examples/s on 1 device and on 2 (TensorFlow: logical CPU devices and
   `MirroredStrategy`; JAX: `--xla_force_host_platform_device_count=2`
   and `DataParallel`), each job a process of its own; on 1 GPU and on
   all where there are 2+ (`benchmarks.scale_dp_model`).

Usage:

    python -m benchmarks scale [--quick] [--json]    # all four parts
    python -m benchmarks.scale [--quick] [PART]      # PART: all, throughput,
                                                     # reader, gpu, dp_model;
                                                     # as JSON

No figure is asserted: timings on a shared machine vary; compare the
ratios of one run.
"""

import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Nothing here imports Keras at module level: a worker pins its cores and
# threads (and TensorFlow's TF_CONFIG) before the backend starts.

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """The round (M_max rows x S x B, the backbone) and the sizes."""

    max_clients: int = 8  # M_max rows of a round, split over the processes.
    local_steps: int = 4
    batch_size: int = 32
    image_size: int = 32
    width: int = 8
    groups: int = 4
    embedding_dim: int = 32
    warmup_rounds: int = 2
    rounds: int = 20
    processes: tuple = (1, 2, 4)
    # (images, users) of the reader-memory runs.
    reader_sizes: tuple = (
        (100_000, 10_000),
        (1_000_000, 10_000),
        (10_000_000, 10_000),
        (10_000_000, 10_000_000),
    )
    reader_rounds: int = 3
    timeout_s: int = 600  # Per job of processes.


QUICK = ScaleConfig(
    max_clients=4,
    local_steps=2,
    batch_size=4,
    image_size=16,
    width=4,
    groups=2,
    embedding_dim=8,
    warmup_rounds=1,
    rounds=3,
    reader_sizes=((20_000, 1_000), (20_000, 20_000)),
    reader_rounds=2,
)


# ------------------------------------------------------------ the job --


def core_layout(cores, processes):
    """`(cores of each process, threads per process)` for `processes`
    local processes on `cores`.

    With at least as many cores as processes, each process gets
    `len(cores) // processes` cores of its own; with more processes than
    cores, process i shares core `i % len(cores)` and runs one thread.

    Example:

    >>> core_layout([0, 1], 2)
    ([[0], [1]], 1)
    >>> core_layout([0, 1], 4)  # Oversubscribed: two processes a core.
    ([[0], [1], [0], [1]], 1)
    """
    cores = sorted(int(c) for c in cores)
    if not cores or processes < 1:
        raise ValueError(f"Need cores and processes >= 1, got {cores}, {processes}.")
    if processes <= len(cores):
        per = len(cores) // processes
        return [cores[i * per : (i + 1) * per] for i in range(processes)], per
    return [[cores[i % len(cores)]] for i in range(processes)], 1


def available_cores():
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def free_port(count):
    """A port p with p .. p + count - 1 free (TensorFlow takes one a worker)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            port = probe.getsockname()[1]
        if port + count >= 65536:
            continue
        free = True
        for offset in range(1, count):
            with socket.socket() as other:
                try:
                    other.bind(("localhost", port + offset))
                except OSError:
                    free = False
                    break
        if free:
            return port
    raise RuntimeError("No free localhost ports.")


def _run_job(config, processes, backend, parallelism):
    """Runs one job of `processes` local workers; returns the chief's report."""
    cores, threads = core_layout(available_cores(), processes)
    port = free_port(processes)
    with tempfile.TemporaryDirectory(prefix="kdpemb-scale-") as directory:
        workers = []
        for index in range(processes):
            spec = {
                "index": index,
                "processes": processes,
                "port": port,
                "cores": cores[index],
                "threads": threads,
                "parallelism": parallelism,
                "out": directory,
                "config": dataclasses.asdict(config),
            }
            env = dict(
                os.environ,
                KERAS_BACKEND=backend,
                JAX_PLATFORMS="cpu",
                CUDA_VISIBLE_DEVICES="-1",
                OMP_NUM_THREADS=str(threads),
                TF_NUM_INTRAOP_THREADS=str(threads),
                TF_NUM_INTEROP_THREADS=str(threads),
                TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONPATH=os.pathsep.join(
                    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
                ),
            )
            env.pop("TF_CONFIG", None)
            log = open(os.path.join(directory, f"worker{index}.log"), "w")  # noqa: SIM115
            command = [sys.executable, "-m", "benchmarks.scale", "--worker"]
            workers.append(
                (
                    subprocess.Popen(
                        [*command, json.dumps(spec)],
                        env=env,
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + config.timeout_s
        try:
            for process, _ in workers:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for process, log in workers:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                log.close()
        for index, (process, _) in enumerate(workers):
            if process.returncode != 0:
                text = Path(directory, f"worker{index}.log").read_text(errors="replace")
                raise RuntimeError(
                    f"{backend} worker {index} of {processes} exited with "
                    f"{process.returncode}:\n{text[-4000:]}"
                )
        return json.loads(Path(directory, "host0.json").read_text())


def _worker(spec):
    """One host of a job (`python -m benchmarks.scale --worker SPEC`)."""
    spec = json.loads(spec)
    index, processes, threads = spec["index"], spec["processes"], spec["threads"]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec["cores"])
    config = ScaleConfig(**{**spec["config"], "processes": (), "reader_sizes": ()})
    backend = os.environ["KERAS_BACKEND"]
    strategy = None
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        if processes > 1:
            workers = [f"localhost:{spec['port'] + i}" for i in range(processes)]
            os.environ["TF_CONFIG"] = json.dumps(
                {
                    "cluster": {"worker": workers},
                    "task": {"type": "worker", "index": index},
                }
            )
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    if backend == "jax" and processes > 1:
        keras.distribution.initialize(f"localhost:{spec['port']}", processes, index)
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(auto_shard_dataset=False)
        )
    report = _time_rounds(config, strategy, spec["parallelism"])
    from kdpemb import distribute

    if strategy is not None:
        with strategy.scope():
            hosts = distribute.current_hosts()
    else:
        hosts = distribute.current_hosts()
    report.update(
        host=hosts.index,
        hosts=hosts.count,
        cores=spec["cores"],
        threads=threads,
        devices=_devices(backend),
    )
    with open(os.path.join(spec["out"], f"host{index}.json"), "w") as file:
        json.dump(report, file)


def _devices(backend):
    if backend == "jax":
        import jax

        return [jax.local_device_count(), jax.device_count()]
    return None


def _time_rounds(config, strategy, parallelism):
    """Fits `warmup_rounds + rounds` rounds; the times of the last `rounds`."""
    import contextlib
    import warnings

    import keras
    import numpy as np

    from kdpemb.data import VirtualClients
    from kdpemb.datasets import synthetic_identities
    from kdpemb.models import FedEmbModel, small_cnn

    m, s, b = config.max_clients, config.local_steps, config.batch_size
    # M users of 4 identities, each with enough images to fill S x B: with
    # sampling="fixed" of all M (P = M), every row of every round is full.
    data = synthetic_identities(
        4 * m, s * b // 4 + 1, image_size=config.image_size, seed=0,
        identities_per_user=4,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # q = 1: a benchmark, not a release.
        clients = VirtualClients(
            np.asarray(data.images), data.labels, data.user_ids,
            clients_per_round=m, sampling="fixed", local_steps=s, batch_size=b,
            rounds_per_epoch=config.warmup_rounds + config.rounds,
        )  # fmt: skip
    shape = (config.image_size, config.image_size, 3)
    keras.utils.set_random_seed(0)  # The same initial weights on every host.
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = FedEmbModel(
            small_cnn(shape, config.embedding_dim, config.width, config.groups),
            clip_norm=1.0,
            noise_multiplier=1.0,
            client_parallelism=parallelism,
        )
        model.compile()
    single_tf = keras.backend.backend() == "tensorflow" and strategy is None
    x = clients.to_tf_dataset() if single_tf else clients
    clock = _round_clock()
    start = time.perf_counter()
    model.fit(x, epochs=1, verbose=0, callbacks=[clock])
    ends = clock.ends
    warm = config.warmup_rounds
    intervals = [b - a for a, b in zip(ends[warm - 1 : -1], ends[warm:], strict=True)]
    return {
        "rounds": len(intervals),
        "rounds_per_second": len(intervals) / (ends[-1] - ends[warm - 1]),
        "round_seconds_median": statistics.median(intervals),
        "first_round_seconds": ends[0] - start,
        "private_steps": clock.steps[-1],
        "rows_per_host": clients.rows_per_host,
        "examples_per_round": int(m * s * b),
    }


def _round_clock():
    import keras

    class RoundClock(keras.callbacks.Callback):
        """The time each round ends; reading its logs waits for the round."""

        def __init__(self):
            super().__init__()
            self.ends, self.steps = [], []

        def on_train_batch_end(self, batch, logs=None):
            steps = float(keras.ops.convert_to_numpy(logs["private_steps"]))
            self.ends.append(time.perf_counter())
            self.steps.append(steps)

    return RoundClock()


# The client parallelism of every job: JAX trains every row of a device at
# once (what FedEmbModel picks under a distribution, and the only choice
# that does not loop over a sharded axis); TensorFlow one client after
# another (its default). On JAX one more job of one process runs the
# clients one after another, JAX's default on a CPU without distribution.
PARALLELISM = {"jax": "all", "tensorflow": 1}


def _jobs(config, backend):
    """`[(label, processes, client_parallelism)]`, the one-process baseline
    first and again last (on a shared machine the load may change during
    the run; the two say by how much, and ratios are to their mean)."""
    parallelism = PARALLELISM.get(backend, 1)
    jobs = [
        (f"{n} process{'es' if n > 1 else ''}", n, parallelism)
        for n in config.processes
    ]
    if 1 in config.processes:
        jobs.append(("1 process (again, last)", 1, parallelism))
        if parallelism != 1:
            jobs.append(("1 process, client_parallelism=1", 1, 1))
    return jobs


def throughput(quick=False, config=None, backend=None):
    """Rounds/s of one job of each process count; ratios to one process."""
    config = config or (QUICK if quick else ScaleConfig())
    backend = backend or os.environ.get("KERAS_BACKEND", "tensorflow")
    cores = available_cores()
    m, s, b = config.max_clients, config.local_steps, config.batch_size
    engine = {
        "jax": "jax.distributed + DataParallel(auto_shard_dataset=False)",
        "tensorflow": "MultiWorkerMirroredStrategy, one replica a worker",
    }.get(backend, backend)
    figures = {
        "CPU round": (
            f"{m} rows x {s} local steps x batch {b} ({m * s * b} examples), "
            f"small_cnn {config.image_size}x{config.image_size}x3 width "
            f"{config.width}, noise on; {backend}: {engine}, "
            f"client_parallelism={PARALLELISM.get(backend, 1)!r}"
        ),
        "CPU cores": len(cores),
    }
    reports = {}
    for label, processes, parallelism in _jobs(config, backend):
        layout, threads = core_layout(cores, processes)
        report = _run_job(config, processes, backend, parallelism)
        reports[label] = report
        name = f"CPU {label}"
        figures[f"{name}: rounds/s"] = report["rounds_per_second"]
        figures[f"{name}: round (median s)"] = report["round_seconds_median"]
        figures[f"{name}: first round incl. compile (s)"] = report[
            "first_round_seconds"
        ]
        pinning = f"{threads} thread(s) each, cores {layout}"
        if processes > len(cores):
            pinning += (
                f"; OVERSUBSCRIBED: {processes} processes on {len(cores)} cores, "
                f"{-(-processes // len(cores))} per core"
            )
        figures[f"{name}: pinning"] = pinning
    ratios = {}
    if "1 process" in reports:
        first, last = reports["1 process"], reports["1 process (again, last)"]
        baseline = statistics.fmean(r["rounds_per_second"] for r in (first, last))
        ratios["CPU 1 process: last / first rounds/s (load drift)"] = (
            last["rounds_per_second"] / first["rounds_per_second"]
        )
        for label, processes, parallelism in _jobs(config, backend):
            if processes > 1 or parallelism != PARALLELISM.get(backend, 1):
                ratios[f"CPU rounds/s, {label} / 1 process"] = (
                    reports[label]["rounds_per_second"] / baseline
                )
    return {"figures": figures, "ratios": ratios, "reports": reports}


# ------------------------------------------------------ reader memory --

# The reader's figures to show when `reader_memory` returns them.
_READER_KEYS = (
    "write seconds",
    "index bytes on disk",
    "RssAnon growth, opening [MiB]",
    "RssAnon growth, opening + rounds [MiB]",
    "peak RSS above baseline, rounds [MiB]",
    "round seconds (median)",
)


def reader_figures(name, result):
    """`{f"{name}: {key}": value}` of the numbers of one `reader_memory`
    result: the keys of `_READER_KEYS` it has, or else every number.

    Example:

    >>> reader_figures("1e5", {"num_images": 10, "round seconds (median)": 0.1})
    {'1e5: round seconds (median)': 0.1}
    """
    numbers = {
        key: value
        for key, value in result.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and key not in ("num_images", "num_users")
    }
    chosen = {k: v for k, v in numbers.items() if k in _READER_KEYS} or numbers
    figures = {}
    for key, value in chosen.items():
        if key.endswith("bytes on disk"):
            key, value = key.replace("bytes on disk", "on disk [MiB]"), value / 2**20
        figures[f"{name}: {key}"] = value
    return figures


def reader(quick=False, config=None):
    """Reader memory at each size, or "not available"."""
    config = config or (QUICK if quick else ScaleConfig())
    try:
        from benchmarks.reader_memory import reader_memory
    except ImportError as error:
        return {"figures": {"reader memory": f"not available ({error})"}, "ratios": {}}
    figures = {}
    for num_images, num_users in config.reader_sizes:
        result = reader_memory(
            num_images, num_users, image_shape=(4, 4, 1), rounds=config.reader_rounds
        )
        name = f"reader {num_images:.0e} images, {num_users:.0e} users"
        figures.update(reader_figures(name.replace("e+0", "e"), result))
    return {"figures": figures, "ratios": {}}


# ---------------------------------------------------------------- GPU --


def gpu(quick=False):
    """`benchmarks.fedemb.speed()`'s GPU ratio, or "no GPU"."""
    from benchmarks.timing import gpu_available

    key = "GPU: round / centralized examples/s (goal >= 0.5)"
    if not gpu_available():
        return {"figures": {"GPU": "no GPU"}, "ratios": {key: "no GPU"}}
    from benchmarks import fedemb

    result = fedemb.speed(quick)
    figures = {k: v for k, v in result["figures"].items() if k.startswith("GPU")}
    return {"figures": figures, "ratios": {key: result["ratios"][key]}}


# ------------------------------------------------- DP-SGD on devices --


def dp_model(quick=False):
    """`DPModel` on 1 and 2 devices (`benchmarks.scale_dp_model`)."""
    from benchmarks import scale_dp_model

    return scale_dp_model.run(quick)


def run(quick=False):
    """All four parts; see the module docstring."""
    config = QUICK if quick else ScaleConfig()
    # DP-SGD before the GPU part: its jobs start before this process has
    # initialised a GPU.
    parts = [throughput(config=config), reader(config=config), dp_model(quick)]
    parts.append(gpu(quick))
    return {
        "figures": {k: v for part in parts for k, v in part["figures"].items()},
        "ratios": {k: v for part in parts for k, v in part["ratios"].items()},
        "config": dataclasses.asdict(config),
        "dp_model_config": parts[2]["config"],
    }


def main(argv=None):
    """`python -m benchmarks.scale [--quick] [PART]`, as JSON.

    PART: all (default), throughput, reader, gpu, dp_model.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--worker"] and len(args) == 2:
        _worker(args[1])
        return 0
    quick = "--quick" in args
    args = [a for a in args if a != "--quick"]
    parts = {
        "all": lambda: run(quick),
        "throughput": lambda: throughput(quick),
        "reader": lambda: reader(quick),
        "gpu": lambda: gpu(quick),
        "dp_model": lambda: dp_model(quick),
    }
    if len(args) > 1 or (args and args[0] not in parts):
        print(main.__doc__)
        return 2
    result = parts[args[0] if args else "all"]()
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

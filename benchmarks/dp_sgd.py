"""DP-SGD (`kdpemb.models.DPModel`) against non-private Keras training.

For each model and physical batch size B, measured in the same run:

- seconds per training step of the network's ordinary `fit` (SGD(0.1),
  sparse categorical cross-entropy on logits, batches of exactly B);
- seconds per step of `DPModel` on the same network, optimizer and loss
  with `sampling="fixed"` (exactly B rows a step: like for like), and one
  row with Poisson sampling at B = 256 (expected size B; on JAX the batch
  is padded to a multiple of about two standard deviations of its size,
  on TensorFlow it is not padded but varies in size);
- the ratio DP / non-private (goal: at most 2, on CPU and GPU);
- peak memory of each: every (model, B, variant) runs in its own process
  (`--one`), so the peak is its own. On CPU: the growth of the process's
  maximum resident set size (`ru_maxrss`) from just before `fit` (model
  built, data in memory) to its end. On a GPU: the device's peak bytes in
  use (`memory_stats()` on JAX, `get_memory_info` on TensorFlow).

A step's time is the median interval between consecutive batch ends of
one `fit` (`timing.StepClock`), after `warmup` steps (the first step
traces and compiles). The data are random: only shapes matter here.

Models, float32, 32×32×3 inputs, 10 classes:

- "cnn": the 8-convolution CIFAR-10 CNN that the Opacus technical report
  (arXiv:2109.12298, section 3) timed against other frameworks, taken
  from the benchmark suite it ran, `CIFAR10Model` in
  github.com/TheSalon/fast-dpsgd, file `pytorch.py` (pytorch/opacus'
  own `benchmarks/` folder times single layers only). Mirrored here:
  3×3 convolutions, stride 1, "same" padding, ReLU after each but the
  last, widths 32, 32, (2×2 average pool), 64, 64, (pool), 128, 128,
  (pool), 256, then a 3×3 convolution to the 10 classes (no activation)
  averaged over the remaining positions. No normalisation layer.
- "vit": a small ViT: 4×4 patches (Conv2D, stride 4) to 64 tokens of
  width 128, a learned position embedding (a custom layer: DPModel gives
  it a vectorised per-example gradient), 4 pre-norm transformer blocks
  (LayerNormalization, MultiHeadAttention with 4 heads, MLP of 256 with
  GELU), a final LayerNormalization, global average pooling, Dense(10).

`PEERS`: Opacus 1.6.0's DP / non-private step-time ratios on the same
CNN (its per-sample-gradient hooks, ghost clipping and functorch), as
reported in the issue that asked for this benchmark; printed beside ours.

    python -m benchmarks dp_sgd                    # everything, as a table
    python -m benchmarks.dp_sgd --batch-sizes 64,256 --models cnn
    python -m benchmarks.dp_sgd --quick --json     # smoke test, in-process
    python -m benchmarks.dp_sgd --one cnn 64 dp-fixed   # one measurement
"""

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import keras
import numpy as np
from keras import ops

from benchmarks.timing import StepClock, gpu_available

VARIANTS = ("non-private", "dp-fixed", "dp-poisson")
NUM_CLASSES = 10

# Opacus 1.6.0, the CNN above: DP step time / non-private step time.
PEERS = {
    ("CPU", 64): {"hooks": 2.39, "ghost clipping": 3.22, "functorch": 4.06},
    ("CPU", 256): {"hooks": 3.19, "ghost clipping": 3.87, "functorch": 4.34},
    ("GPU", 256): {"hooks": 3.59, "ghost clipping": 3.84},
    ("GPU", 1024): {"hooks": 3.02, "ghost clipping": 3.65},
}
PEER_MACHINES = {"CPU": "2-core CPU, 2 threads", "GPU": "H100"}
GOAL = 2.0


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the runs."""

    models: tuple = ("cnn", "vit")
    batch_sizes: tuple = (64, 256, 1024)
    poisson_batch_size: int = 256  # The Poisson row (when B is measured).
    steps: int = 6  # Timed steps (intervals) after the warm-up.
    warmup: int = 2
    image_size: int = 32
    cnn_widths: tuple = (32, 64, 128, 256)
    patch: int = 4
    vit_width: int = 128
    vit_depth: int = 4
    vit_heads: int = 4
    vit_mlp: int = 256
    learning_rate: float = 0.1
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    subprocesses: bool = True  # One process per measurement (clean peaks).


QUICK = Config(
    batch_sizes=(8,),
    poisson_batch_size=8,
    steps=2,
    warmup=1,
    image_size=16,
    cnn_widths=(4, 8, 8, 16),
    vit_width=16,
    vit_depth=1,
    vit_heads=2,
    vit_mlp=32,
    subprocesses=False,
)


# -- models ----------------------------------------------------------------


def cnn(config):
    """The 8-convolution CNN of Opacus' framework comparison (see module)."""
    conv = keras.layers.Conv2D
    first, second, third, fourth = config.cnn_widths
    layers = [keras.Input((config.image_size, config.image_size, 3))]
    for width in (first, second, third):
        layers += [
            conv(width, 3, padding="same", activation="relu"),
            conv(width, 3, padding="same", activation="relu"),
            keras.layers.AveragePooling2D(2),
        ]
    layers += [
        conv(fourth, 3, padding="same", activation="relu"),
        conv(NUM_CLASSES, 3, padding="same"),
        keras.layers.GlobalAveragePooling2D(),
    ]
    return keras.Sequential(layers, name="cnn")


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned `[tokens, width]` weight to its input."""

    def build(self, input_shape):
        self.position = self.add_weight(
            shape=tuple(input_shape[1:]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="position",
        )

    def call(self, inputs):
        return inputs + ops.cast(self.position, inputs.dtype)


def vit(config):
    """A small pre-norm ViT (see module)."""
    size, patch, width = config.image_size, config.patch, config.vit_width
    tokens = (size // patch) ** 2
    inputs = keras.Input((size, size, 3))
    x = keras.layers.Conv2D(width, patch, strides=patch)(inputs)
    x = keras.layers.Reshape((tokens, width))(x)
    x = PositionEmbedding()(x)
    for _ in range(config.vit_depth):
        h = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        h = keras.layers.MultiHeadAttention(
            config.vit_heads, key_dim=width // config.vit_heads
        )(h, h)
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        h = keras.layers.Dense(config.vit_mlp, activation="gelu")(h)
        x = x + keras.layers.Dense(width)(h)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(x), name="vit")


MODELS = {"cnn": cnn, "vit": vit}


# -- one measurement -------------------------------------------------------


def _max_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux.


def _device_peak_bytes():
    """The accelerator's peak bytes in use, or None on CPU."""
    if not gpu_available():
        return None
    if keras.backend.backend() == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    import tensorflow as tf

    return tf.config.experimental.get_memory_info("GPU:0")["peak"]


def measure(config, model_name, batch_size, variant):
    """Seconds per step and peak memory of one fit; see the module."""
    from kdpemb.models import DPModel

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
    keras.utils.set_random_seed(0)
    batches = config.warmup + config.steps + 1  # steps + warmup intervals.
    rows = batch_size * batches
    rng = np.random.default_rng(0)
    size = config.image_size
    x = rng.standard_normal((rows, size, size, 3), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, rows).astype("int32")
    model = network = MODELS[model_name](config)
    if variant != "non-private":
        model = DPModel(
            network,
            clip_norm=config.clip_norm,
            noise_multiplier=config.noise_multiplier,
            delta=min(1e-5, 0.1 / rows),
            sampling="fixed" if variant == "dp-fixed" else "poisson",
        )
    model.compile(
        keras.optimizers.SGD(config.learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = _max_rss_bytes()
    clock = StepClock()
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, callbacks=[clock])
    fit_seconds = time.perf_counter() - start
    peak_rss = _max_rss_bytes() - before
    timed = clock.intervals[config.warmup :]
    result = {
        "model": model_name,
        "batch_size": batch_size,
        "variant": variant,
        "seconds_per_step": statistics.median(timed),
        "steps_timed": len(timed),
        "fit_seconds": fit_seconds,
        "parameters": int(sum(np.prod(v.shape) for v in network.trainable_variables)),
        "rss_growth_bytes": peak_rss,
        "device_peak_bytes": _device_peak_bytes(),
    }
    if variant != "non-private":
        result["plan"] = model.gradient_plan.describe()
    return result


def _in_subprocess(config, model_name, batch_size, variant, timeout=3600):
    """`measure` in a fresh Python process (its own peak memory)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), env.get("PYTHONPATH")) if p
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [
        sys.executable, "-m", "benchmarks.dp_sgd", "--one", model_name,
        str(batch_size), variant, "--config", json.dumps(dataclasses.asdict(config)),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{model_name} B={batch_size} {variant} failed:\n{done.stderr[-3000:]}"
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


# -- the whole benchmark ---------------------------------------------------


def _measurements(config):
    for model_name in config.models:
        for b in config.batch_sizes:
            variants = ["non-private", "dp-fixed"]
            if b == config.poisson_batch_size:
                variants.append("dp-poisson")
            for variant in variants:
                yield model_name, b, variant


def _peak_mib(record):
    value = record["device_peak_bytes"]
    if value is None:
        value = record["rss_growth_bytes"]
    return value / 2**20


def measure_all(config, progress=None):
    """Every measurement of `config`, in its own process if configured."""
    records = []
    for model_name, b, variant in _measurements(config):
        if config.subprocesses:
            record = _in_subprocess(config, model_name, b, variant)
        else:
            record = measure(config, model_name, b, variant)
        records.append(record)
        if progress:
            progress(record)
    return records


def summarize(config, records):
    """Figures, ratios, rows and peers from `measure_all`'s records."""
    device = "GPU" if gpu_available() else "CPU"
    memory = "device peak" if device == "GPU" else (
        "max RSS growth" if config.subprocesses else "max RSS growth, in-process"
    )  # fmt: skip
    by_key = {(r["model"], r["batch_size"], r["variant"]): r for r in records}
    figures, ratios, rows, plans = {}, {}, [], {}
    for (model_name, b, variant), record in by_key.items():
        if variant == "non-private":
            continue
        plans.setdefault(model_name, record["plan"])
        base = by_key[(model_name, b, "non-private")]
        label = f"{device}: {model_name} B={b}"
        name = "DP fixed" if variant == "dp-fixed" else "DP Poisson"
        figures[f"{label} non-private (s/step)"] = base["seconds_per_step"]
        figures[f"{label} {name} (s/step)"] = record["seconds_per_step"]
        figures[f"{label} non-private peak ({memory}, MiB)"] = _peak_mib(base)
        figures[f"{label} {name} peak ({memory}, MiB)"] = _peak_mib(record)
        ratio = record["seconds_per_step"] / base["seconds_per_step"]
        ratios[f"{label} {name} / non-private time (goal <= {GOAL:g})"] = ratio
        memory_ratio = None
        if _peak_mib(base) > 0:
            memory_ratio = _peak_mib(record) / _peak_mib(base)
            ratios[f"{label} {name} / non-private peak memory"] = memory_ratio
        rows.append({
            "model": model_name, "batch_size": b, "sampling": variant[3:],
            "non_private_s": base["seconds_per_step"],
            "dp_s": record["seconds_per_step"], "ratio": ratio,
            "non_private_peak_mib": _peak_mib(base), "dp_peak_mib": _peak_mib(record),
            "memory_ratio": memory_ratio,
            "peers": PEERS.get((device, b), {}) if model_name == "cnn" else {},
        })  # fmt: skip
    for model_name, plan in plans.items():
        figures[f"{model_name} gradient plan"] = plan
    peers = {
        f"Opacus 1.6.0 {method}, {PEER_MACHINES[d]}, cnn B={b}": value
        for (d, b), methods in PEERS.items()
        for method, value in methods.items()
    }
    return {
        "figures": figures,
        "ratios": ratios,
        "rows": rows,
        "plans": plans,
        "peers": peers,
        "device": device,
        "memory": memory,
        "backend": keras.backend.backend(),
        "config": dataclasses.asdict(config),
    }


def run(quick=False, config=None, progress=None):
    """All measurements of `config` (QUICK: in-process, tiny); see the module."""
    config = config or (QUICK if quick else Config())
    return summarize(config, measure_all(config, progress))


# -- command line ----------------------------------------------------------


def table(result):
    """The rows as fixed-width text, Opacus' ratios beside ours."""
    lines = [
        f"backend {result['backend']}, {result['device']}; peak memory: "
        f"{result['memory']}; goal: DP / non-private <= {GOAL:g}",
        f"{'model':<5} {'B':>5} {'sampling':<8} {'non-priv s':>10} {'DP s':>9} "
        f"{'ratio':>6} {'np MiB':>8} {'DP MiB':>8} {'mem x':>6}  Opacus 1.6.0",
    ]
    for row in result["rows"]:
        memory = row["memory_ratio"]
        peers = ", ".join(f"{k} {v:.2f}x" for k, v in row["peers"].items())
        lines.append(
            f"{row['model']:<5} {row['batch_size']:>5} {row['sampling']:<8} "
            f"{row['non_private_s']:>10.4f} {row['dp_s']:>9.4f} {row['ratio']:>6.2f} "
            f"{row['non_private_peak_mib']:>8.1f} {row['dp_peak_mib']:>8.1f} "
            f"{'-' if memory is None else f'{memory:.2f}':>6}  {peers}"
        )
    for model_name, plan in result["plans"].items():
        lines.append(f"{model_name}: {plan}")
    lines.append(
        "Opacus 1.6.0, same CNN: "
        + "; ".join(
            f"{PEER_MACHINES[d]} B={b}: "
            + ", ".join(f"{m} {v:.2f}x" for m, v in methods.items())
            for (d, b), methods in PEERS.items()
        )
    )
    return "\n".join(lines)


def _ints(text):
    return tuple(int(v) for v in text.split(","))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dp_sgd")
    parser.add_argument("--quick", action="store_true", help="tiny, in-process")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batch-sizes", type=_ints, help="e.g. 64,256,1024")
    parser.add_argument("--models", help="e.g. cnn,vit")
    parser.add_argument("--steps", type=int, help="timed steps per measurement")
    parser.add_argument(
        "--one", nargs=3, metavar=("MODEL", "B", "VARIANT"),
        help=f"one measurement as JSON (VARIANT: {', '.join(VARIANTS)})",
    )  # fmt: skip
    parser.add_argument("--config", help=argparse.SUPPRESS)  # From the parent.
    args = parser.parse_args(argv)
    if args.config:
        fields = json.loads(args.config)
        config = Config(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in fields.items()})  # fmt: skip
    else:
        config = QUICK if args.quick else Config()
    overrides = {}
    if args.batch_sizes:
        overrides["batch_sizes"] = args.batch_sizes
    if args.models:
        overrides["models"] = tuple(args.models.split(","))
    if args.steps:
        overrides["steps"] = args.steps
    config = dataclasses.replace(config, **overrides)
    if args.one:
        model_name, b, variant = args.one
        print(json.dumps(measure(config, model_name, int(b), variant)))
        return 0

    def progress(record):
        if not args.json:
            print(
                f"  {record['model']} B={record['batch_size']} {record['variant']}: "
                f"{record['seconds_per_step']:.4f} s/step",
                file=sys.stderr, flush=True,
            )  # fmt: skip

    result = run(config=config, progress=progress)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

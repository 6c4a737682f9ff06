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
- peak memory of each: every (model, B, variant) fits a few steps in its
  own process (`--one`), so the peak is its own. On CPU: the growth of
  the process's maximum resident set size (`ru_maxrss`) from just before
  `fit` (model built, data in memory) to its end, compilation included.
  On a GPU: the device's peak bytes in use (`memory_stats()` on JAX,
  `get_memory_info` on TensorFlow).

Times (`--times`): one process per (model, B) holds every variant; after
a warm-up fit each (tracing, compilation), they take turns, `repeats`
fits of `steps + 1` steps each. A fit's step time is the median interval
between consecutive batch ends (`timing.StepClock`); a variant's time is
the median over its fits, and the ratio the median of each repeat's
DP / non-private. Taking turns matters on a shared machine: there, the
same step took 0.2 s or 0.4 s for minutes at a time as neighbours came
and went, and only steps timed side by side compare. The data are
random: only shapes matter here.

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

On a shared 2-core AMD EPYC VM (TensorFlow 2.21, Keras 3.15, CPU), the
whole run took about 10 minutes and measured DP / non-private 1.7-1.8
(CNN, B = 64 to 1,024) and 1.2-1.5 (ViT), with peak memory 3.9-4.3× (CNN)
and 1.2-1.5× (ViT).

    python -m benchmarks dp_sgd                    # everything, as a table
    python -m benchmarks.dp_sgd --batch-sizes 64,256 --models cnn
    python -m benchmarks.dp_sgd --quick --json     # smoke test, in-process
    python -m benchmarks.dp_sgd --times cnn 64     # one (model, B), as JSON
    python -m benchmarks.dp_sgd --one cnn 64 dp-fixed   # one peak memory
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
    steps: int = 4  # Timed steps (intervals) per fit.
    repeats: int = 3  # Timed fits per variant, taking turns.
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
    repeats=1,
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


# -- measurements ----------------------------------------------------------


def _data(config, batch_size, batches):
    rng = np.random.default_rng(0)
    size, rows = config.image_size, batch_size * batches
    x = rng.standard_normal((rows, size, size, 3), dtype=np.float32)
    return x, rng.integers(0, NUM_CLASSES, rows).astype("int32")


def _model(config, model_name, variant, rows):
    """The network, or DPModel on it, compiled; and the network."""
    from kdpemb.models import DPModel

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
    keras.utils.set_random_seed(0)
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
    return model, network


class _StopAfter(keras.callbacks.Callback):
    """Ends a fit after `batches` steps (a warm-up on the timed data: a
    DPModel's later fits must keep its number of examples)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 >= self.batches:
            self.model.stop_training = True


def measure_times(config, model_name, batch_size, variants):
    """Seconds per step of each variant, `config.repeats` times.

    All variants live in one process and take turns, a fit of
    `config.steps + 1` steps each per repeat (after a warm-up fit of
    `config.warmup + 1` steps), so that each repeat compares them under
    the same load of a shared machine. Returns `{variant: [median step
    seconds of each repeat]}`.
    """
    x, y = _data(config, batch_size, config.steps + 1)
    models = {v: _model(config, model_name, v, len(x))[0] for v in variants}
    for model in models.values():
        stop = _StopAfter(config.warmup + 1)
        model.fit(x, y, batch_size=batch_size, verbose=0, callbacks=[stop])
    times = {v: [] for v in variants}
    for _ in range(config.repeats):
        for variant, model in models.items():
            clock = StepClock()
            model.fit(x, y, batch_size=batch_size, verbose=0, callbacks=[clock])
            times[variant].append(clock.step_seconds())
    return times


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


def measure_memory(config, model_name, batch_size, variant):
    """Peak memory of a fit of `config.warmup + 2` steps; see the module.

    Run it in a fresh process (`--one`): the peak of a process is never
    reset, so an earlier fit in the same process would hide this one's.
    """
    x, y = _data(config, batch_size, config.warmup + 2)
    model, network = _model(config, model_name, variant, len(x))
    before = _max_rss_bytes()
    model.fit(x, y, batch_size=batch_size, verbose=0)
    result = {
        "model": model_name,
        "batch_size": batch_size,
        "variant": variant,
        "parameters": int(sum(np.prod(v.shape) for v in network.trainable_variables)),
        "rss_growth_bytes": _max_rss_bytes() - before,
        "device_peak_bytes": _device_peak_bytes(),
    }
    if variant != "non-private":
        result["plan"] = model.gradient_plan.describe()
    return result


def _in_subprocess(config, arguments, timeout=3600):
    """`python -m benchmarks.dp_sgd ARGUMENTS` in a fresh process; its JSON."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), env.get("PYTHONPATH")) if p
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [
        sys.executable, "-m", "benchmarks.dp_sgd", *arguments,
        "--config", json.dumps(dataclasses.asdict(config)),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)} failed:\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


# -- the whole benchmark ---------------------------------------------------


def _variants(config, batch_size):
    variants = ["non-private", "dp-fixed"]
    if batch_size == config.poisson_batch_size:
        variants.append("dp-poisson")
    return variants


def measure_all(config, progress=None):
    """`(times, memory)`: `{(model, B): measure_times}` and `{(model, B,
    variant): measure_memory}`, each in its own process if configured."""
    times, memory = {}, {}
    for model_name in config.models:
        for b in config.batch_sizes:
            variants = _variants(config, b)
            if config.subprocesses:
                times[model_name, b] = _in_subprocess(
                    config, ["--times", model_name, str(b)]
                )
            else:
                times[model_name, b] = measure_times(config, model_name, b, variants)
            if progress:
                progress(model_name, b, times[model_name, b])
            for variant in variants:
                if config.subprocesses:
                    record = _in_subprocess(
                        config, ["--one", model_name, str(b), variant]
                    )
                else:
                    record = measure_memory(config, model_name, b, variant)
                memory[model_name, b, variant] = record
    return times, memory


def _peak_mib(record):
    value = record["device_peak_bytes"]
    if value is None:
        value = record["rss_growth_bytes"]
    return value / 2**20


def summarize(config, times, memory):
    """Figures, ratios, rows and peers from `measure_all`'s results."""
    device = "GPU" if gpu_available() else "CPU"
    if device == "GPU":
        kind = "device peak"
    else:
        kind = "max RSS growth" + ("" if config.subprocesses else ", in-process")
    figures, ratios, rows, plans = {}, {}, [], {}
    for (model_name, b), runs in times.items():
        base = runs["non-private"]
        base_memory = _peak_mib(memory[model_name, b, "non-private"])
        label = f"{device}: {model_name} B={b}"
        figures[f"{label} non-private (s/step)"] = statistics.median(base)
        figures[f"{label} non-private peak ({kind}, MiB)"] = base_memory
        for variant in runs:
            if variant == "non-private":
                continue
            record = memory[model_name, b, variant]
            plans.setdefault(model_name, record["plan"])
            name = "DP fixed" if variant == "dp-fixed" else "DP Poisson"
            seconds = statistics.median(runs[variant])
            # Each repeat's DP / non-private, measured under the same load.
            ratio = statistics.median(
                d / n for d, n in zip(runs[variant], base, strict=True)
            )
            peak = _peak_mib(record)
            figures[f"{label} {name} (s/step)"] = seconds
            figures[f"{label} {name} peak ({kind}, MiB)"] = peak
            ratios[f"{label} {name} / non-private time (goal <= {GOAL:g})"] = ratio
            memory_ratio = peak / base_memory if base_memory > 0 else None
            if memory_ratio is not None:
                ratios[f"{label} {name} / non-private peak memory"] = memory_ratio
            rows.append({
                "model": model_name, "batch_size": b, "sampling": variant[3:],
                "non_private_s": statistics.median(base), "dp_s": seconds,
                "ratio": ratio, "non_private_peak_mib": base_memory,
                "dp_peak_mib": peak, "memory_ratio": memory_ratio,
                "non_private_runs": base, "dp_runs": runs[variant],
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
        "memory": kind,
        "backend": keras.backend.backend(),
        "config": dataclasses.asdict(config),
    }


def run(quick=False, config=None, progress=None):
    """All measurements of `config` (QUICK: in-process, tiny); see the module."""
    config = config or (QUICK if quick else Config())
    return summarize(config, *measure_all(config, progress))


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
    parser.add_argument("--repeats", type=int, help="timed fits per variant")
    parser.add_argument(
        "--one", nargs=3, metavar=("MODEL", "B", "VARIANT"),
        help=f"peak memory of one fit, as JSON (VARIANT: {', '.join(VARIANTS)})",
    )  # fmt: skip
    parser.add_argument(
        "--times", nargs=2, metavar=("MODEL", "B"),
        help="seconds per step of every variant at B, as JSON",
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
    if args.repeats:
        overrides["repeats"] = args.repeats
    config = dataclasses.replace(config, **overrides)
    if args.one:
        model_name, b, variant = args.one
        print(json.dumps(measure_memory(config, model_name, int(b), variant)))
        return 0
    if args.times:
        model_name, b = args.times[0], int(args.times[1])
        variants = _variants(config, b)
        print(json.dumps(measure_times(config, model_name, b, variants)))
        return 0

    def progress(model_name, b, times):
        seconds = ", ".join(f"{v} {statistics.median(t):.4f}" for v, t in times.items())
        print(f"  {model_name} B={b}: {seconds} s/step", file=sys.stderr, flush=True)

    result = run(config=config, progress=progress)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

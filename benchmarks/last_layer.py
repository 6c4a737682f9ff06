"""Last-layer DP fine-tuning: accuracy on Fashion-MNIST features, and speed.

(The study in the papers' regime, 100 classes and 256-d features, is
`benchmarks.last_layer_regime`: `python -m benchmarks.last_layer utility`.)

Utility, on real offline data (`load_fashion_mnist()`, the Debian files):
the 60,000 training images are split once (permutation seed 0) into a
**public** set of 10,000 and a **private** set of 50,000; the test set
(10,000) measures accuracy. A `small_cnn((28, 28, 1), embedding_dim=64,
width=16, groups=4)` is pretrained on the public images only, without DP
(`CentralizedBaseline`, Adam(1e-3), batch 128, 8 epochs), and saved under
`build/last_layer/`; `kdpemb.features.extract` then computes the 64-d
features of the three splits once and caches them there. Features are
centred by the mean of the *public* features, and the feature clip norm
C_x is the median norm of the centred public features. δ = 1e-5 (below
1 / 50,000). Every private run is repeated with seeds 0, 1 and 2 (DP noise,
Poisson sampling and the random head initialisation; the backbone and the
split are fixed): mean ± std.

1. `pretraining`: the public model's test accuracy, C_x, times.
2. `initialization`: few full-batch DP-SGD steps at ε = 1 from a
   zero-initialised head against a random (N(0, 1/d)) one, per
   optimizer and learning rate.
3. `methods`: DP-SGD (best of a stated grid, per ε, by mean test
   accuracy), DP-SGD limited to the data passes of a closed form (one
   epoch, or 3 full-batch steps), DP-LS, DP-Newton and DP-FC (their
   defaults, and the best of a small l2 / budget_split grid) at ε in
   {0.5, 1, 4, 8}.
4. `non_private`: the same methods with no noise (noise_multiplier=0;
   DP-SGD also with clip_norm=1e9), and the public model's own head.

`wide()` (not part of `run`) repeats the DP-LS against DP-SGD comparison
at ε in {0.5, 1} on 576-d features (the last conv block, 2×2-average-pooled
and flattened), one seed.

Speed (`speed()`), measured in one run after a warm-up, alternating the
two, median of repeats:

- a DP-SGD step of `LastLayerDPClassifier.fit` (Poisson batches of
  expected size B, gathered on the device from indices) against a step
  of a plain `Dense` head's `fit` (shuffled batches of B) with the same
  optimizer, on the same random features (goal: at most 1.3×), two
  ways: a whole fit's seconds over its steps, and the steady-state step
  (`timing.StepClock`, without the fit's set-up and the epochs' starts);
- DP-LS on 100,000 × 512 random features with 100 classes: seconds of one
  `fit` (goal: under 10 s on CPU).
- Both on the GPU when the backend sees one; "no GPU" otherwise.

    python -m benchmarks last_layer             # everything (~15 min, 2 CPU cores)
    python -m benchmarks last_layer --quick     # smoke test (tiny sizes)
    python -m benchmarks.last_layer speed       # one part as JSON; also
    python -m benchmarks.last_layer methods 1   # fashion-mnist, pretraining,
                                                # initialization, methods [EPS],
                                                # non-private, wide
    python -m benchmarks.last_layer utility     # the papers' regime (~2 h)
"""

import collections
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import statistics
import sys
import time
import warnings

import keras
import numpy as np

from benchmarks.timing import StepClock, gpu_available, time_fit, timed
from kdpemb import privacy
from kdpemb.datasets import load_fashion_mnist
from kdpemb.features import extract
from kdpemb.models import CentralizedBaseline, LastLayerDPClassifier, small_cnn


@dataclasses.dataclass(frozen=True)
class UtilityConfig:
    """Data, backbone, and the grids of the utility runs."""

    public_examples: int = 10_000
    private_examples: int = 50_000
    test_examples: int = 10_000
    split_seed: int = 0
    width: int = 16
    groups: int = 4
    embedding_dim: int = 64
    pretrain_epochs: int = 8
    pretrain_batch: int = 128
    pretrain_lr: float = 1e-3
    feature_quantile: float = 0.5  # C_x: this quantile of public feature norms.
    delta: float = 1e-5
    epsilons: tuple = (0.5, 1.0, 4.0, 8.0)
    # Zero against random initialisation: full-batch DP-SGD at one ε.
    init_epsilon: float = 1.0
    init_steps: tuple = (1, 5)
    init_optimizers: tuple = (
        ("SGD", 1.0), ("SGD", 10.0), ("SGD", 100.0),
        ("Lamb", 0.01), ("Lamb", 0.1), ("Lamb", 1.0),
    )  # fmt: skip
    # The DP-SGD grid: Poisson batches of expected size `sgd_batch`.
    sgd_clip_norm: float = 1.0
    sgd_batch: int = 5_000
    sgd_steps: tuple = (100, 300)
    sgd_optimizers: tuple = (("SGD", 10.0), ("Adam", 0.03), ("Adam", 0.1))
    # DP-SGD with the data passes of a closed form: one epoch of Poisson
    # batches of `sgd_batch`, or a few full-batch steps.
    one_pass_optimizers: tuple = (("Adam", 0.1), ("Adam", 0.3), ("Lamb", 0.1))
    one_pass_full_batch_steps: int = 3
    # The closed-form methods: l2 (None: the class's default) and DP-LS's split.
    closed_form_l2: tuple = (None, 0.003, 0.01, 0.03)
    ls_budget_splits: tuple = (0.5, 0.8)
    newton_steps: int = 3
    newton_lr: float = 0.5
    fc_steps: int = 3
    fc_lr: float = 1.0
    # The noise-free DP-SGD reference: the longest schedule, this optimizer.
    reference_optimizer: tuple = ("Adam", 0.03)
    seeds: tuple = (0, 1, 2)
    cache: str = "build/last_layer"


QUICK_UTILITY = UtilityConfig(
    public_examples=1_000,
    private_examples=2_000,
    test_examples=1_000,
    width=4,
    groups=2,
    embedding_dim=8,
    pretrain_epochs=1,
    epsilons=(1.0,),
    init_steps=(1,),
    init_optimizers=(("SGD", 10.0),),
    sgd_batch=500,
    sgd_steps=(4,),
    sgd_optimizers=(("Adam", 0.1),),
    one_pass_optimizers=(("Adam", 0.1),),
    one_pass_full_batch_steps=1,
    closed_form_l2=(None,),
    ls_budget_splits=(0.5,),
    newton_steps=1,
    fc_steps=1,
    seeds=(0,),
)


def _quiet():
    """Fixed seeds make the benchmark repeatable; they void the guarantee,
    which does not matter here, so their warnings are silenced. (Calibration
    mutes dp-accounting's RDP chatter itself; the absl verbosity is left
    alone, since it is process-wide and would outlive the benchmark.)"""
    warnings.simplefilter("ignore")


@dataclasses.dataclass
class Features:
    """Centred features of the three splits, and what produced them."""

    public: np.ndarray
    private: np.ndarray
    private_labels: np.ndarray
    test: np.ndarray
    test_labels: np.ndarray
    clip_norm: float
    figures: dict


def _splits(config):
    (x, y), (x_test, y_test) = load_fashion_mnist()
    order = np.random.default_rng(config.split_seed).permutation(len(x))
    public = order[: config.public_examples]
    private = order[
        config.public_examples : config.public_examples + config.private_examples
    ]
    test = slice(0, config.test_examples)
    return (
        (x[public], y[public]),
        (x[private], y[private]),
        (x_test[test], y_test[test]),
    )


def _pretrained(config, public, test):
    """The public model, pretrained once and kept under `config.cache`."""
    fields = {
        name: getattr(config, name)
        for name in (
            "public_examples", "split_seed", "width", "groups", "embedding_dim",
            "pretrain_epochs", "pretrain_batch", "pretrain_lr",
        )
    }  # fmt: skip
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    directory = pathlib.Path(config.cache)
    path = directory / f"public-model-{key}.keras"
    notes = directory / f"public-model-{key}.json"
    if not path.exists():
        keras.utils.set_random_seed(0)
        model = CentralizedBaseline(
            small_cnn(
                public[0].shape[1:], config.embedding_dim, config.width, config.groups
            ),
            num_classes=10,
        )
        model.compile(
            optimizer=keras.optimizers.Adam(config.pretrain_lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        _, seconds = timed(
            model.fit,
            *public,
            batch_size=config.pretrain_batch,
            epochs=config.pretrain_epochs,
            verbose=0,
        )
        accuracy = model.evaluate(*test, batch_size=1024, verbose=0)[1]
        directory.mkdir(parents=True, exist_ok=True)
        model.save(path)
        notes.write_text(
            json.dumps({"seconds": seconds, "test accuracy": float(accuracy)})
        )
    # Always the saved model, so that the features' cache key is stable.
    return keras.saving.load_model(path), json.loads(notes.read_text())


@functools.lru_cache(maxsize=2)
def features(config):
    """Pretrains (cached), extracts (cached), centres and picks C_x."""
    public, private, test = _splits(config)
    model, notes = _pretrained(config, public, test)
    cache = pathlib.Path(config.cache) / "features"
    start = time.perf_counter()
    public_x = extract(
        model.backbone, public[0], cache=cache, backbone_name="cnn", verbose=0
    )
    private_x = extract(
        model.backbone, private[0], cache=cache, backbone_name="cnn", verbose=0
    )
    test_x = extract(
        model.backbone, test[0], cache=cache, backbone_name="cnn", verbose=0
    )
    seconds = time.perf_counter() - start
    mean = public_x.mean(axis=0)  # Public: centring costs no privacy.
    public_x, private_x, test_x = public_x - mean, private_x - mean, test_x - mean
    norms = np.linalg.norm(public_x, axis=1)
    clip_norm = float(np.quantile(norms, config.feature_quantile))
    return Features(
        public_x, private_x, private[1].astype("int32"), test_x,
        test[1].astype("int32"), clip_norm,
        {
            "public model: test accuracy (non-private, public data only)": notes[
                "test accuracy"
            ],
            "public model: pretraining seconds": notes["seconds"],
            "features: seconds (extract, or load from the cache)": seconds,
            "features: dimension": public_x.shape[1],
            "feature clip norm C_x (public median norm)": clip_norm,
            "public feature norm: 90% quantile": float(np.quantile(norms, 0.9)),
            "private examples": len(private_x),
        },
    )  # fmt: skip


def pretraining(config):
    """Figures of the public model and its features."""
    return dict(features(config).figures)


# ----------------------------------------------------------- private fits --


def _optimizer(spec):
    name, learning_rate = spec
    return getattr(keras.optimizers, name)(learning_rate)


def _label(spec):
    return f"{spec[0]}({spec[1]:g})"


@functools.cache
def _dp_sgd_noise(epsilon, delta, num_examples, batch_size, steps):
    """What `target_epsilon` calibrates, computed once per schedule."""
    mechanism = privacy.Schedule.examples(num_examples, batch_size).privacy_mechanism(
        1.0
    )
    return privacy.calibrate_noise_multiplier(
        mechanism, target_epsilon=epsilon, delta=delta, steps=steps
    )


def _accuracy(model, data):
    logits = keras.ops.convert_to_numpy(model(data.test))
    return float((logits.argmax(axis=1) == data.test_labels).mean())


def fit_one(data, config, method, *, seed, epsilon, steps=1, batch_size=None,
            optimizer=None, **settings):  # fmt: skip
    """One private (or, with epsilon=None, noise-free) fit: accuracy and ε."""
    n = len(data.private)
    keras.utils.set_random_seed(seed)  # The random head initialisation.
    if epsilon is None:
        noise = {"noise_multiplier": 0.0}
    elif method == "dp-sgd":
        noise = {
            "noise_multiplier": _dp_sgd_noise(
                epsilon, config.delta, n, batch_size, steps
            )
        }
    else:
        noise = {"target_epsilon": epsilon, "delta": config.delta}
    model = LastLayerDPClassifier(
        10, method, feature_clip_norm=data.clip_norm, seed=seed, **noise, **settings
    )
    if optimizer is not None:
        model.compile(optimizer=_optimizer(optimizer))
    per_epoch = 1 if batch_size is None else max(1, round(n / batch_size))
    if steps % per_epoch:
        raise ValueError(f"steps={steps} is not a whole number of epochs")
    model.fit(
        data.private,
        data.private_labels,
        batch_size=batch_size,
        epochs=steps // per_epoch,
        verbose=0,
    )
    spent = (
        model.privacy_statement(config.delta).epsilon if epsilon is not None else 0.0
    )
    return _accuracy(model, data), spent


def _over_seeds(data, config, method, **kwargs):
    runs = [fit_one(data, config, method, seed=s, **kwargs) for s in config.seeds]
    values = [accuracy for accuracy, _ in runs]
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "epsilon": max(spent for _, spent in runs),
    }


def _record(figures, name, result):
    figures[f"{name}: accuracy mean"] = result["mean"]
    figures[f"{name}: accuracy std"] = result["std"]


def initialization(config, data=None):
    """Zero against random head initialisation, few full-batch DP-SGD steps."""
    _quiet()
    data = data or features(config)
    figures, ratios = {}, {}
    eps = config.init_epsilon
    for steps in config.init_steps:
        best = {}
        for spec in config.init_optimizers:
            for init in ("zeros", "random"):
                result = _over_seeds(
                    data, config, "dp-sgd", epsilon=eps, steps=steps,
                    optimizer=spec, head_init=init, clip_norm=config.sgd_clip_norm,
                )  # fmt: skip
                name = (
                    f"init eps={eps:g}, {steps} full-batch step(s), "
                    f"{_label(spec)}, {init}"
                )
                _record(figures, name, result)
                if result["mean"] > best.get(init, (-1.0,))[0]:
                    best[init] = (result["mean"], result["std"], _label(spec))
        for init, (mean, std, label) in best.items():
            key = f"init eps={eps:g}, {steps} step(s), best {init}"
            figures[f"{key}: accuracy mean"] = mean
            figures[f"{key}: accuracy std"] = std
            figures[f"{key}: optimizer"] = label
        ratios[f"zero / random init accuracy, {steps} step(s), best of grid"] = (
            best["zeros"][0] / best["random"][0]
        )
    return {"figures": figures, "ratios": ratios}


def _best(results):
    """The (label, result) with the highest mean accuracy."""
    return max(results.items(), key=lambda item: item[1]["mean"])


def dp_sgd_grid(data, config, epsilon):
    results = {}
    for steps in config.sgd_steps:
        for spec in config.sgd_optimizers:
            label = f"{steps} steps of B={config.sgd_batch}, {_label(spec)}"
            results[label] = _over_seeds(
                data, config, "dp-sgd", epsilon=epsilon, steps=steps,
                batch_size=config.sgd_batch, optimizer=spec,
                clip_norm=config.sgd_clip_norm,
            )  # fmt: skip
    return results


def one_pass_dp_sgd_grid(data, config, epsilon):
    """DP-SGD that reads the data as often as the closed forms do."""
    results = {}
    epoch = max(1, round(len(data.private) / config.sgd_batch))
    for spec in config.one_pass_optimizers:
        results[f"1 epoch ({epoch} steps of B={config.sgd_batch}), {_label(spec)}"] = (
            _over_seeds(
                data, config, "dp-sgd", epsilon=epsilon, steps=epoch,
                batch_size=config.sgd_batch, optimizer=spec,
                clip_norm=config.sgd_clip_norm,
            )
        )  # fmt: skip
    steps = config.one_pass_full_batch_steps
    results[f"{steps} full-batch steps, Lamb(0.1)"] = _over_seeds(
        data, config, "dp-sgd", epsilon=epsilon, steps=steps,
        optimizer=("Lamb", 0.1), clip_norm=config.sgd_clip_norm,
    )  # fmt: skip
    return results


def closed_form_grid(data, config, method, epsilon):
    results = {}
    splits = config.ls_budget_splits if method == "dp-ls" else (0.5,)
    steps, lr = {
        "dp-ls": (1, 1.0),
        "dp-newton": (config.newton_steps, config.newton_lr),
        "dp-fc": (config.fc_steps, config.fc_lr),
    }[method]
    for l2 in config.closed_form_l2:
        for split in splits:
            label = f"l2={'default' if l2 is None else f'{l2:g}'}"
            if method == "dp-ls":
                label += f", budget_split={split:g}"
            else:
                label = f"{steps} steps, SGD({lr:g}), {label}"
            results[label] = _over_seeds(
                data, config, method, epsilon=epsilon, steps=steps,
                optimizer=None if method == "dp-ls" else ("SGD", lr),
                l2=l2, budget_split=split,
            )  # fmt: skip
    return results


NAMES = {
    "dp-sgd": "DP-SGD",
    "dp-sgd-one-pass": "DP-SGD one pass",
    "dp-ls": "DP-LS",
    "dp-newton": "DP-Newton",
    "dp-fc": "DP-FC",
}


def methods(config, data=None, epsilons=None):
    """Every method at every ε: DP-SGD's grid, the closed forms' defaults and grid."""
    _quiet()
    data = data or features(config)
    figures, ratios = {}, {}
    for eps in epsilons or config.epsilons:
        grids = {
            "dp-sgd": dp_sgd_grid(data, config, eps),
            "dp-sgd-one-pass": one_pass_dp_sgd_grid(data, config, eps),
        }
        for method in ("dp-ls", "dp-newton", "dp-fc"):
            grids[method] = closed_form_grid(data, config, method, eps)
        for method, results in grids.items():
            for label, result in results.items():
                _record(figures, f"eps={eps:g} {NAMES[method]} ({label})", result)
            label, result = _best(results)
            key = f"eps={eps:g} {NAMES[method]} best"
            _record(figures, key, result)
            figures[f"{key}: settings"] = label
            figures[f"eps={eps:g} {NAMES[method]}: epsilon spent (max)"] = max(
                r["epsilon"] for r in results.values()
            )
            if not method.startswith("dp-sgd"):
                default = next(r for lab, r in results.items() if "l2=default" in lab)
                _record(figures, f"eps={eps:g} {NAMES[method]} default", default)
        for baseline in ("DP-SGD", "DP-SGD one pass"):
            best_sgd = figures[f"eps={eps:g} {baseline} best: accuracy mean"]
            for method in ("dp-ls", "dp-newton", "dp-fc"):
                name = NAMES[method]
                ratios[f"eps={eps:g} {name} best / {baseline} best accuracy"] = (
                    figures[f"eps={eps:g} {name} best: accuracy mean"] / best_sgd
                )
    return {"figures": figures, "ratios": ratios}


def non_private(config, data=None):
    """The methods without noise (one seed), and the public model's own head."""
    _quiet()
    data = data or features(config)
    seed = config.seeds[0]
    figures = {
        "public model head (public data only)": data.figures[
            "public model: test accuracy (non-private, public data only)"
        ]
    }
    for clip_norm in (config.sgd_clip_norm, 1e9):
        figures[f"DP-SGD z=0, clip_norm={clip_norm:g}, C_x kept"], _ = fit_one(
            data, config, "dp-sgd", seed=seed, epsilon=None,
            steps=max(config.sgd_steps), batch_size=config.sgd_batch,
            optimizer=config.reference_optimizer, clip_norm=clip_norm,
        )  # fmt: skip
    figures["DP-LS z=0"], _ = fit_one(data, config, "dp-ls", seed=seed, epsilon=None)
    figures["DP-Newton z=0"], _ = fit_one(
        data, config, "dp-newton", seed=seed, epsilon=None,
        steps=config.newton_steps, optimizer=("SGD", config.newton_lr),
    )  # fmt: skip
    figures["DP-FC z=0"], _ = fit_one(
        data, config, "dp-fc", seed=seed, epsilon=None, steps=config.fc_steps,
        optimizer=("SGD", config.fc_lr),
    )  # fmt: skip
    return {"figures": {f"non-private {k}": v for k, v in figures.items()}}


def fashion_mnist(quick=False, config=None):
    """Parts 1-4 on Fashion-MNIST; see the module docstring."""
    config = config or (QUICK_UTILITY if quick else UtilityConfig())
    _quiet()
    data = features(config)
    parts = [
        {"figures": pretraining(config), "ratios": {}},
        non_private(config, data),
        initialization(config, data),
        methods(config, data),
    ]
    return {
        "figures": {k: v for part in parts for k, v in part["figures"].items()},
        "ratios": {k: v for part in parts for k, v in part.get("ratios", {}).items()},
        "config": dataclasses.asdict(config),
    }


def wide(quick=False, config=None, epsilons=(0.5, 1.0)):
    """DP-LS against DP-SGD on 576-d features of the same backbone, one seed."""
    config = config or (QUICK_UTILITY if quick else UtilityConfig())
    config = dataclasses.replace(config, seeds=config.seeds[:1])
    _quiet()
    public, private, test = _splits(config)
    model, _ = _pretrained(config, public, test)
    backbone = model.backbone
    last_block = [layer for layer in backbone.layers if "activation" in layer.name][-1]
    pooled = keras.layers.AveragePooling2D(2)(last_block.output)
    wide_backbone = keras.Model(
        backbone.inputs, keras.layers.Flatten()(pooled), name="wide"
    )
    cache = pathlib.Path(config.cache) / "features"
    arrays = [
        extract(wide_backbone, images, cache=cache, backbone_name="wide", verbose=0)
        for images in (public[0], private[0], test[0])
    ]
    mean = arrays[0].mean(axis=0)
    public_x, private_x, test_x = (a - mean for a in arrays)
    norms = np.linalg.norm(public_x, axis=1)
    data = Features(
        public_x, private_x, private[1].astype("int32"), test_x,
        test[1].astype("int32"), float(np.quantile(norms, config.feature_quantile)),
        {},
    )  # fmt: skip
    figures = {
        "wide features: dimension": public_x.shape[1],
        "wide features: C_x": data.clip_norm,
    }
    figures["wide non-private DP-LS z=0"], _ = fit_one(
        data, config, "dp-ls", seed=0, epsilon=None
    )
    for eps in epsilons:
        for method, results in (
            ("dp-sgd", dp_sgd_grid(data, config, eps)),
            ("dp-ls", closed_form_grid(data, config, "dp-ls", eps)),
        ):
            for label, result in results.items():
                figures[f"wide eps={eps:g} {NAMES[method]} ({label})"] = result["mean"]
            label, result = _best(results)
            figures[f"wide eps={eps:g} {NAMES[method]} best"] = result["mean"]
            figures[f"wide eps={eps:g} {NAMES[method]} best: settings"] = label
    return {"figures": figures, "ratios": {}, "config": dataclasses.asdict(config)}


# ------------------------------------------------------------------ speed --


@dataclasses.dataclass(frozen=True)
class SpeedConfig:
    """Sizes of the speed runs."""

    num_examples: int = 51_200
    dim: int = 512
    num_classes: int = 100
    batch_size: int = 1_024
    epochs: int = 6  # Per timed fit, so that fit's own set-up is amortised.
    repeats: int = 5
    learning_rate: float = 0.1
    ls_examples: int = 100_000
    ls_dim: int = 512
    ls_classes: int = 100
    ls_repeats: int = 3


QUICK_SPEED = SpeedConfig(
    num_examples=2_048,
    dim=32,
    num_classes=10,
    batch_size=256,
    epochs=1,
    repeats=1,
    ls_examples=2_000,
    ls_dim=32,
    ls_classes=10,
    ls_repeats=1,
)


def _random_features(rows, dim, classes, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((rows, dim), dtype=np.float32),
        rng.integers(0, classes, rows).astype("int32"),
    )


def step_times(config):
    """Seconds per step of a DP-SGD head and of a plain Dense head.

    Two measures, each alternating the two heads, median of repeats:
    `fit` (a whole fit's seconds over its steps: copying the data in, the
    input pipeline and the epochs' starts included) and `steady` (the
    median interval between two steps of an epoch, `StepClock`).
    """
    features, labels = _random_features(
        config.num_examples, config.dim, config.num_classes
    )
    private = LastLayerDPClassifier(
        config.num_classes, "dp-sgd", clip_norm=1.0, noise_multiplier=1.0, seed=0
    )
    private.compile(optimizer=keras.optimizers.SGD(config.learning_rate))
    plain = keras.Sequential(
        [keras.Input((config.dim,)), keras.layers.Dense(config.num_classes)]
    )
    plain.compile(
        optimizer=keras.optimizers.SGD(config.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    b, epochs = config.batch_size, config.epochs
    # Warm-up: tracing, compilation, and the private schedule.
    time_fit(private, features, labels, batch_size=b)
    time_fit(plain, features, labels, batch_size=b)
    steps = epochs * round(config.num_examples / b)
    heads = {"DP-SGD": private, "non-private Dense": plain}
    times = collections.defaultdict(list)
    for _ in range(config.repeats):
        for head, model in heads.items():
            seconds = time_fit(model, features, labels, batch_size=b, epochs=epochs)
            times[head, "fit"].append(seconds / steps)
    for _ in range(config.repeats):
        for head, model in heads.items():
            clock = StepClock()
            time_fit(
                model, features, labels, batch_size=b, epochs=epochs, callbacks=[clock]
            )
            times[head, "steady"].append(clock.step_seconds())
    medians = {key: statistics.median(values) for key, values in times.items()}
    padded = private.privacy_mechanism()  # Only to read the sampling back.
    return medians, padded.sampling_probability


def dp_ls_seconds(config):
    features, labels = _random_features(
        config.ls_examples, config.ls_dim, config.ls_classes, seed=1
    )
    times = []
    for _ in range(config.ls_repeats):
        model = LastLayerDPClassifier(
            config.ls_classes, "dp-ls", feature_clip_norm=math.sqrt(config.ls_dim),
            noise_multiplier=1.0, seed=0,
        )  # fmt: skip
        times.append(time_fit(model, features, labels))
    return statistics.median(times)


def speed(quick=False, config=None):
    """A DP-SGD step against a non-private step; DP-LS on a large problem."""
    config = config or (QUICK_SPEED if quick else SpeedConfig())
    _quiet()
    device = "GPU" if gpu_available() else "CPU"
    d, k, b = config.dim, config.num_classes, config.batch_size
    steps, q = step_times(config)
    ls = dp_ls_seconds(config)
    shape = f"d={d}, K={k}, B={b}"
    ls_shape = f"{config.ls_examples:,} x {config.ls_dim}, {config.ls_classes} classes"
    figures = {
        f"{device}: {head} step ({measure}), {shape} (ms)": 1000 * seconds
        for (head, measure), seconds in steps.items()
    }
    figures["DP-SGD sampling probability q"] = q
    figures[f"{device}: DP-LS fit, {ls_shape} (s)"] = ls
    ratios = {
        f"{device}: DP-SGD step / non-private step, {measure} (goal <= 1.3)": (
            steps["DP-SGD", measure] / steps["non-private Dense", measure]
        )
        for measure in ("fit", "steady")
    }
    ratios[f"{device}: DP-LS seconds / 10 s (goal < 1)"] = ls / 10.0
    if device == "CPU":
        figures["GPU"] = "no GPU"
    return {"figures": figures, "ratios": ratios, "config": dataclasses.asdict(config)}


def run(quick=False):
    """Speed, then utility; see the module docstring."""
    speed_result = speed(quick)
    utility_result = fashion_mnist(quick)
    return {
        "figures": {**utility_result["figures"], **speed_result["figures"]},
        "ratios": {**utility_result["ratios"], **speed_result["ratios"]},
        "config": {
            "utility": utility_result["config"],
            "speed": speed_result["config"],
        },
    }


def main(argv=None):
    """`python -m benchmarks.last_layer PART [--quick]`, one part as JSON.

    PART: all, fashion-mnist, speed, pretraining, initialization, methods
    [EPS], non-private, wide; or `utility [--quick] [--output DIR] [--sizes
    N,...] [--no-ablations]`, the study in the papers' regime
    (`benchmarks.last_layer_regime`), which writes its table and curves.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["utility"]:
        from benchmarks import last_layer_regime

        _quiet()
        summary = last_layer_regime.main(args[1:])
        print(last_layer_regime.markdown(summary))
        return 0
    quick = "--quick" in args
    args = [a for a in args if a != "--quick"]
    config = QUICK_UTILITY if quick else UtilityConfig()
    parts = {
        "all": lambda: run(quick),
        "fashion-mnist": lambda: fashion_mnist(quick),
        "speed": lambda: speed(quick),
        "pretraining": lambda: pretraining(config),
        "initialization": lambda: initialization(config),
        "non-private": lambda: non_private(config),
        "wide": lambda: wide(quick),
    }
    if args and args[0] == "methods" and len(args) <= 2:
        epsilons = (float(args[1]),) if len(args) == 2 else None
        result = methods(config, epsilons=epsilons)
    elif len(args) == 1 and args[0] in parts:
        result = parts[args[0]]()
    else:
        print(main.__doc__)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

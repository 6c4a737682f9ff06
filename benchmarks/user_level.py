"""User-level DP-SGD against example-level DP-SGD with group privacy.

Both protect all of one user's examples at the same (ε_u, δ_u):

- "user-level": `DPModel(unit="user", examples_per_user=k,
  target_epsilon=ε_u, delta=δ_u)`, `fit(x, y, users=ids, batch_size=B_u)`:
  each step samples users (Poisson, q = B_u / U) and clips each sampled
  user's mean gradient over at most k of their examples.
- "example-level + group privacy": the data capped at k examples per user
  (each user's first k after a shuffle seeded by the run's seed), so one
  user is a group of at most k examples; an example-level `DPModel` with
  `target_epsilon=ε_u / k, delta=δ_e`, δ_e from `group_privacy_target`.
  Its batch B_e = N_e / (steps per epoch of the user-level run): the same
  steps, and about the same examples per step, as the user-level run.

Each method's learning rate (SGD, momentum 0.9) is the best validation
accuracy of `learning_rates` on seed 0; then seeds 0, 1 and 2 (noise,
sampling, initialisation, the cap's shuffle) give the test accuracy, mean
± std. Non-private runs of each (noise 0, clip norm 1e6, seed 0, the
private run's learning rate) give context. Seconds per step: the median
interval between batch ends (`timing.StepClock`) of the seeds' fits.

Data, both a 1-hidden-layer MLP (`hidden` ReLU units) on pixels in [0, 1]:

- "identities": `synthetic_identities(identities, images_per_identity)`,
  grayscale; each identity's images split into train / validation / test,
  the task is the identity label on held-out images of the same
  identities. Users: `simulate_users(labels, identity_users,
  classes_per_user=1)` on the training images, each user holding images
  of one identity and each identity spread over several users. (With one
  user per identity, user-level DP would bound what is learnt of each
  class itself, and both methods would be at chance.)
- "fashion": Fashion-MNIST (`load_fashion_mnist(download=False)`), a
  seeded subsample of `fashion_train` training images with
  `simulate_users(labels, fashion_users, classes_per_user=2)` (skewed
  labels: each user holds 2 classes), a disjoint `fashion_validation`
  training images for validation, the first `fashion_test` test images.

    python -m benchmarks user_level            # the table (about 1 min)
    python -m benchmarks user_level --quick    # tiny sizes, smoke test
    python -m benchmarks.user_level            # the markdown table only
"""

import dataclasses
import math
import statistics
import sys
import warnings

import keras
import numpy as np

from benchmarks.timing import StepClock

METHODS = ("user-level", "example-level + group privacy")


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and settings of the comparison."""

    epsilon: float = 4.0  # ε_u, per user.
    delta: float = 1e-5  # δ_u, below 1 / U.
    examples_per_user: int = 8  # k.
    clip_norm: float = 1.0
    users_per_step: int = 0  # B_u; 0: U / steps_per_epoch.
    steps_per_epoch: int = 10
    epochs: int = 10
    learning_rates: tuple = (0.0125, 0.05, 0.2)
    seeds: tuple = (0, 1, 2)
    hidden: int = 128
    datasets: tuple = ("identities", "fashion")
    identities: int = 20
    images_per_identity: int = 135  # 120 train, 5 validation, 10 test.
    identity_validation: int = 5
    identity_test: int = 10
    identity_users: int = 200
    image_size: int = 16
    fashion_train: int = 6000
    fashion_users: int = 600
    fashion_validation: int = 1000
    fashion_test: int = 2000


QUICK = Config(
    datasets=("identities",),  # Generated: no data file needed (CI).
    epochs=1,
    steps_per_epoch=2,
    learning_rates=(0.2,),
    seeds=(0,),
    hidden=8,
    identities=4,
    images_per_identity=20,
    identity_validation=2,
    identity_test=2,
    identity_users=16,
    image_size=8,
    fashion_train=160,
    fashion_users=16,
    fashion_validation=32,
    fashion_test=32,
)


def group_privacy_target(epsilon, delta, group_size):
    """Per-example `(ε_e, δ_e)` that give `(epsilon, delta)` per group.

    The classic group-privacy conversion: an (ε, δ)-DP mechanism is
    (kε, k e^{(k-1)ε} δ)-DP for groups of k. So ε_e = ε / k and δ_e =
    δ / (k e^{(k-1)ε/k}).

    >>> epsilon, delta = group_privacy_target(4.0, 1e-5, 8)
    >>> epsilon, round(delta * 8 * math.exp(7 * epsilon) / 1e-5, 12)
    (0.5, 1.0)
    """
    k = int(group_size)
    if k < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size!r}.")
    epsilon_e = epsilon / k
    return epsilon_e, delta / (k * math.exp((k - 1) * epsilon_e))


def cap_per_user(users, k, seed):
    """Indices of each user's first `k` examples after a seeded shuffle."""
    order = np.random.default_rng(seed).permutation(len(users))
    keep = []
    taken = {}
    for index in order:
        user = users[index]
        if taken.get(user, 0) < k:
            taken[user] = taken.get(user, 0) + 1
            keep.append(index)
    return np.sort(np.asarray(keep, np.int64))


# -- data ------------------------------------------------------------------


def identities_data(config):
    """Train (with users) / validation / test splits of synthetic identities."""
    from kdpemb.datasets import simulate_users, synthetic_identities

    data = synthetic_identities(
        config.identities,
        config.images_per_identity,
        image_size=config.image_size,
        channels=1,
        seed=0,
    )
    images = np.asarray(data.images[:], np.float32) / 255.0
    labels = np.asarray(data.labels, np.int64)
    n, held = config.images_per_identity, config.identity_validation
    position = np.arange(len(labels)) % n  # Identity-major order.
    test = position >= n - config.identity_test
    validation = ~test & (position >= n - config.identity_test - held)
    train = ~test & ~validation
    users = simulate_users(labels[train], config.identity_users, classes_per_user=1)
    return {
        "train": (images[train], labels[train], users),
        "validation": (images[validation], labels[validation]),
        "test": (images[test], labels[test]),
        "classes": config.identities,
    }


def fashion_data(config):
    """Train (with skewed users) / validation / test splits of Fashion-MNIST."""
    from kdpemb.datasets import load_fashion_mnist, simulate_users

    (x, y), (x_test, y_test) = load_fashion_mnist(download=False)
    order = np.random.default_rng(0).permutation(len(x))
    train = order[: config.fashion_train]
    validation = order[
        config.fashion_train : config.fashion_train + config.fashion_validation
    ]
    scale = np.float32(1 / 255.0)
    y = y.astype(np.int64)
    users = simulate_users(y[train], config.fashion_users, classes_per_user=2)
    return {
        "train": (x[train] * scale, y[train], users),
        "validation": (x[validation] * scale, y[validation]),
        "test": (x_test[: config.fashion_test] * scale, y_test[: config.fashion_test]),
        "classes": 10,
    }


DATASETS = {"identities": identities_data, "fashion": fashion_data}


# -- runs ------------------------------------------------------------------


def network(input_shape, classes, hidden, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Flatten(),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )


def plan(data, config):
    """Both methods' batch sizes, privacy targets and capped data sizes."""
    x, _, users = data["train"]
    k = config.examples_per_user
    names, counts = np.unique(users, return_counts=True)
    steps = config.steps_per_epoch
    users_per_step = config.users_per_step or max(1, round(len(names) / steps))
    capped = int(np.minimum(counts, k).sum())
    group = int(min(k, counts.max()))  # The most examples of one user kept.
    epsilon_e, delta_e = group_privacy_target(config.epsilon, config.delta, group)
    return {
        "users": len(names),
        "examples": len(x),
        "user counts (min, median, max)": (
            int(counts.min()),
            float(np.median(counts)),
            int(counts.max()),
        ),
        "users per step": users_per_step,
        "steps": round(len(names) / users_per_step) * config.epochs,
        "capped examples": capped,
        "examples per step": max(1, round(capped / round(len(names) / users_per_step))),
        "group size": group,
        "example epsilon": epsilon_e,
        "example delta": delta_e,
    }


def train(data, config, setup, method, learning_rate, seed, private=True):
    """One fit; returns (validation accuracy, test accuracy, s/step, z)."""
    from kdpemb.models import DPModel

    x, y, users = data["train"]
    noise = {} if private else {"noise_multiplier": 0.0}
    clip = config.clip_norm if private else 1e6
    net = network(x.shape[1:], data["classes"], config.hidden, seed)
    if method == "user-level":
        fit_args = {"users": users, "batch_size": setup["users per step"]}
        model = DPModel(
            net, unit="user", examples_per_user=config.examples_per_user,
            clip_norm=clip, delta=config.delta, seed=seed,
            **(noise or {"target_epsilon": config.epsilon}),
        )  # fmt: skip
    else:
        keep = cap_per_user(users, config.examples_per_user, seed)
        x, y = x[keep], y[keep]
        fit_args = {"batch_size": setup["examples per step"]}
        model = DPModel(
            net, clip_norm=clip, delta=setup["example delta"], seed=seed,
            **(noise or {"target_epsilon": setup["example epsilon"]}),
        )  # fmt: skip
    model.compile(
        keras.optimizers.SGD(learning_rate, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    clock = StepClock()
    model.fit(x, y, epochs=config.epochs, verbose=0, callbacks=[clock], **fit_args)
    if private:  # The statement is the target, per user.
        statement = model.privacy_statement()
        want = setup["example epsilon"] if method != "user-level" else config.epsilon
        assert statement.epsilon <= want * (1 + 1e-6), (statement, want)

    def accuracy(split):
        images, labels = data[split]
        logits = net.predict(images, batch_size=512, verbose=0)
        return float(np.mean(np.argmax(logits, axis=1) == labels))

    return {
        "validation": accuracy("validation"),
        "test": accuracy("test"),
        "step seconds": clock.step_seconds(),
        "noise multiplier": float(model.noise_multiplier),
    }


def compare(name, config):
    """The rows of one dataset: tuning, seeds, non-private, times."""
    data = DATASETS[name](config)
    setup = plan(data, config)
    rows = {"setup": setup}
    for method in METHODS:
        tuning = {
            lr: train(data, config, setup, method, lr, config.seeds[0])
            for lr in config.learning_rates
        }
        best = max(config.learning_rates, key=lambda lr: tuning[lr]["validation"])
        runs = [tuning[best]] + [
            train(data, config, setup, method, best, seed) for seed in config.seeds[1:]
        ]
        tests = [run["test"] for run in runs]
        non_private = train(data, config, setup, method, best, 0, private=False)
        rows[method] = {
            "learning rate": best,
            "validation by learning rate": {
                lr: run["validation"] for lr, run in tuning.items()
            },
            "test mean": statistics.mean(tests),
            "test std": statistics.stdev(tests) if len(tests) > 1 else 0.0,
            "non-private test": non_private["test"],
            "step seconds": statistics.median(run["step seconds"] for run in runs),
            "noise multiplier": runs[0]["noise multiplier"],
        }
    return rows


def table(results, config):
    """A markdown table of `results` (dataset -> rows of `compare`)."""
    lines = [
        "| data | method | lr | test accuracy (3 seeds) | non-private | z | s / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        for method in METHODS:
            row = rows[method]
            lines.append(
                f"| {name} | {method} | {row['learning rate']:g} | "
                f"{row['test mean']:.3f} ± {row['test std']:.3f} | "
                f"{row['non-private test']:.3f} | {row['noise multiplier']:.3g} | "
                f"{row['step seconds'] * 1e3:.1f} ms |"
            )
    return "\n".join(lines)


def run(quick=False, config=None):
    """Figures (accuracies, times, settings) and ratios of every dataset."""
    config = config or (QUICK if quick else Config())
    figures, ratios, results = {}, {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ReproducibleNoiseWarning: a benchmark.
        for name in config.datasets:
            results[name] = rows = compare(name, config)
            setup = rows["setup"]
            for key in ("users", "users per step", "steps", "capped examples",
                        "examples per step", "group size", "example epsilon",
                        "example delta"):  # fmt: skip
                figures[f"{name}: {key}"] = setup[key]
            for method in METHODS:
                row = rows[method]
                for key in ("learning rate", "test mean", "test std",
                            "non-private test", "noise multiplier",
                            "step seconds"):  # fmt: skip
                    figures[f"{name}: {method} {key}"] = row[key]
            user, example = (rows[method] for method in METHODS)
            ratios[f"{name}: user-level / group-privacy test accuracy"] = user[
                "test mean"
            ] / max(example["test mean"], 1e-12)
            ratios[f"{name}: user-level / group-privacy s per step"] = (
                user["step seconds"] / example["step seconds"]
            )
    return {
        "figures": figures,
        "ratios": ratios,
        "table": table(results, config),
        "details": results,
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    result = run(quick="--quick" in argv)
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

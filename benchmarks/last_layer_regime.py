"""Last-layer DP in the regime the papers study: many classes, wide features.

`python -m benchmarks.last_layer utility` (this module's `run`). The
closed-form methods (DP-LS, DP-Newton, DP-FC) were proposed for
transfer learning with many classes, wide features and small ε, where
DP-SGD's noise on K·d parameters over few examples per class hurts most.
This study builds that regime from kdpemb's own data, without downloads:

- **Backbone.** `resnet_gn((32, 32, 3), embedding_dim=256, width=32)` is
  pretrained without DP on 2,000 *public* synthetic identities × 10 images
  (`synthetic_identities(domain="public")`, cosine head, Adam 3e-3 with
  cosine decay, batch 128, 10 epochs) and frozen; its weights are cached
  under `build/last_layer_regime/`. The 256-d embeddings are the features
  (`kdpemb.features.extract`, cached there too).
- **Private task.** K = 100 private identities (the private stream, which
  the backbone never saw), n ∈ {10, 100, 500} training images each (N =
  1,000, 10,000, 50,000: the first n of each identity's 500), and 50 test
  images each (5,000) that no run trains on.
- **Public tuning task.** The same shape on 100 *other* identities of
  the same distribution (identities 1,000,000 on), with their own 50
  validation images each: the stand-in for a labelled public set like the
  private one. Every hyperparameter (steps, learning rate, optimizer,
  ridge λ, budget split) is chosen per (method, N, ε) by accuracy on this
  public validation split with one tuning seed; the chosen configuration
  is then run on the private task with seeds 0, 1 and 2. Nothing is
  chosen on the private test set, and tuning spends no private budget.
- **Features.** Centred by the mean of the public tuning features and
  divided by their median norm (both public), so every method clips
  features to norm C_x = 1; DP-SGD clips per-example gradients to
  C = √2, the norm of an example's gradient at the zero head
  (‖p − y‖ ≈ 1, ‖(x, 1)‖ = √2).
- **Privacy.** δ = 1 / N², example-level, add-or-remove-one; ε ∈ {0.1,
  0.25, 0.5, 1, 2, 4, 8}, each run's noise calibrated for its whole
  planned run (PLD), and ε = ∞ (no noise; DP-SGD without clipping).
- **ε = ∞ is each method's own optimum**: DP-LS is ridge regression with λ
  tuned on the public task; DP-Newton and DP-FC (damped steps, no bias)
  minimise the ridge-regularised softmax loss with the l2 that
  scikit-learn's `LogisticRegression` (no intercept) finds best on the
  public task, long enough to land on it: the table shows scikit-learn's
  optimum on the same private data beside them. DP-SGD (with a bias) is
  its best noise-free run on the public task: 300 full-batch Adam steps,
  with l2 = 0 or the logistic l2.

Ablations, at N = 10,000 and ε ∈ {0.5, 2, 8}, 3 seeds (run when N =
10,000 is among the sizes):

- `init`: DP-SGD from a random head (N(0, 1/d)) with the setting of the
  single full-batch step and with the setting tuned for a zero head,
  against the zero-head runs of the same settings;
- `optimizers`: full-batch DP-SGD with SGD, Adam and LAMB, each with its
  own tuned learning rate and steps;
- `steps`: one full-batch step against many small Poisson steps (batch
  256, Adam, epochs and learning rate tuned).

Records go to `OUTPUT/records.jsonl` as they are measured (a rerun skips
the ones already there), then `OUTPUT/summary.json`, `OUTPUT/table.md` and
one privacy-utility PNG per N (`kdpemb.plots`).

    python -m benchmarks.last_layer utility                 # ~2 h, 2 CPU cores
    python -m benchmarks.last_layer utility --quick         # smoke test
    python -m benchmarks.last_layer utility --sizes 1000 --output build/x
"""

import dataclasses
import hashlib
import json
import math
import pathlib
import statistics
import time
import warnings

import numpy as np

METHODS = ("dp-sgd", "dp-ls", "dp-newton", "dp-fc")
LABELS = {"dp-sgd": "DP-SGD", "dp-ls": "DP-LS", "dp-newton": "DP-Newton",
          "dp-fc": "DP-FC"}  # fmt: skip
INF = math.inf
STUDY_VERSION = 1  # Bump when a change to the code changes what a record measures.
SINGLE_STEP = {"optimizer": ("SGD", 1.0), "steps": 1}  # From zero: the centroids.


@dataclasses.dataclass(frozen=True)
class RegimeConfig:
    """Data, backbone, grids and seeds of the study (see the module docstring)."""

    # Public pretraining of the backbone.
    pretrain_identities: int = 2_000
    pretrain_images: int = 10
    image_size: int = 32
    width: int = 32
    groups: int = 8
    embedding_dim: int = 256
    pretrain_epochs: int = 10
    pretrain_batch: int = 128
    pretrain_lr: float = 3e-3
    data_seed: int = 0
    # The private task and its public tuning twin.
    num_classes: int = 100
    train_per_class: tuple = (10, 100, 500)
    test_per_class: int = 50
    tuning_first_identity: int = 1_000_000
    epsilons: tuple = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, INF)
    seeds: tuple = (0, 1, 2)
    tuning_seed: int = 100
    # Grids at finite ε. Optimizers are (name, learning rate).
    sgd_grid: tuple = (
        (("SGD", 1.0), 1), (("Adam", 0.01), 10), (("Adam", 0.1), 10),
        (("Adam", 0.01), 100), (("Adam", 0.1), 100), (("Lamb", 0.01), 10),
        (("Lamb", 0.1), 10), (("Lamb", 0.01), 100), (("Lamb", 0.1), 100),
    )  # fmt: skip
    ls_l2: tuple = (None, 1e-3, 1e-2, 1e-1, 1.0)
    ls_budget_splits: tuple = (0.5, 0.8)
    newton_steps: tuple = (1, 3, 10)
    # From `large_n` examples a Newton step takes about 10 s (2 CPU cores):
    # fewer steps and only the first variant.
    newton_steps_large: tuple = (1, 3)
    large_n: int = 50_000
    # (learning rate, l2): SGD(lr) applies the Newton direction.
    newton_variants: tuple = ((0.5, None), (0.5, 1e-2))
    fc_steps: tuple = (1, 3, 10, 30)
    # (learning rate, l2), as for DP-Newton: with many classes the full step
    # oscillates once the head is trained (its fixed preconditioner is the
    # curvature of the zero head, 1/K (1 - 1/K) Σ, far below a trained one's).
    fc_variants: tuple = ((1.0, None), (0.3, None), (0.3, 1e-2))
    # ε = ∞: the l2 grid of the logistic optimum, and the converged runs.
    logistic_l2: tuple = (1e-5, 1e-4, 1e-3, 1e-2)
    ls_l2_nonprivate: tuple = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
    newton_steps_nonprivate: int = 100  # Damped: SGD(0.5).
    newton_steps_nonprivate_large: int = 30  # From 10,000 examples: 3-10 s a step.
    fc_steps_nonprivate: int = 600  # Damped: SGD(0.3).
    sgd_grid_nonprivate: tuple = (
        (("Adam", 0.01), 300), (("Adam", 0.1), 300),
    )  # fmt: skip
    # Ablations.
    ablation_n: int = 10_000
    ablation_epsilons: tuple = (0.5, 2.0, 8.0)
    optimizer_grid: tuple = (
        ("SGD", (3.0, 30.0, 300.0)), ("Adam", (0.003, 0.03, 0.3)),
        ("Lamb", (0.003, 0.03, 0.3)),
    )  # fmt: skip
    optimizer_steps: tuple = (10, 100)
    small_batch: int = 256
    small_epochs: tuple = (1, 3)
    small_lrs: tuple = (0.001, 0.01)
    cache: str = "build/last_layer_regime"


QUICK = RegimeConfig(
    pretrain_identities=40,
    pretrain_images=4,
    image_size=16,
    width=4,
    groups=2,
    embedding_dim=32,
    pretrain_epochs=1,
    num_classes=10,
    train_per_class=(10,),
    test_per_class=5,
    epsilons=(1.0, INF),
    seeds=(0, 1),
    sgd_grid=((("SGD", 1.0), 1), (("Adam", 0.1), 3)),
    ls_l2=(None, 1e-2),
    ls_budget_splits=(0.5,),
    newton_steps=(1, 2),
    newton_steps_large=(1,),
    large_n=1_000,
    newton_variants=((1.0, None), (0.5, None)),
    fc_steps=(1, 3),
    fc_variants=((1.0, None), (0.3, None)),
    logistic_l2=(1e-3, 1e-2),
    ls_l2_nonprivate=(1e-3, 1e-2),
    newton_steps_nonprivate=5,
    newton_steps_nonprivate_large=5,
    fc_steps_nonprivate=10,
    sgd_grid_nonprivate=((("Adam", 0.1), 20),),
    ablation_n=100,
    ablation_epsilons=(1.0,),
    optimizer_grid=(("SGD", (30.0,)), ("Adam", (0.1,)), ("Lamb", (0.1,))),
    optimizer_steps=(2,),
    small_batch=32,
    small_epochs=(1,),
    small_lrs=(0.01,),
    cache="build/last_layer_regime_quick",
)


def _key(values):
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------ data --


class RegimeData:
    """The frozen public backbone's features of the private and tuning tasks.

    `train(task, n)` gives the first `n` training rows of each class,
    `evaluation(task)` the held-out rows; task "private" or "tuning".
    Features are centred and scaled by public statistics only.
    """

    def __init__(self, config, log=print):
        self.config = config
        self.log = log
        self.cache = pathlib.Path(config.cache)
        self.cache.mkdir(parents=True, exist_ok=True)
        backbone, name = self._backbone()
        self.features = {
            task: self._task_features(backbone, name, task)
            for task in ("private", "tuning")
        }
        tuning = self.features["tuning"]["train"][0]
        tuning = tuning.reshape(-1, tuning.shape[-1])
        self.mean = tuning.mean(axis=0)
        self.scale = float(np.median(np.linalg.norm(tuning - self.mean, axis=1)))
        for splits in self.features.values():
            for split, (x, y) in splits.items():
                splits[split] = (
                    ((x - self.mean) / self.scale).astype(np.float32),
                    y,
                )

    def _backbone(self):
        import keras

        from kdpemb.datasets import synthetic_identities
        from kdpemb.models import pretrain, resnet_gn

        cfg = self.config
        fields = [
            "pretrain_identities", "pretrain_images", "image_size", "width",
            "groups", "embedding_dim", "pretrain_epochs", "pretrain_batch",
            "pretrain_lr", "data_seed",
        ]  # fmt: skip
        key = _key({f: getattr(cfg, f) for f in fields})
        keras.utils.set_random_seed(cfg.data_seed)
        size = cfg.image_size
        backbone = resnet_gn(
            (size, size, 3),
            embedding_dim=cfg.embedding_dim,
            width=cfg.width,
            groups=cfg.groups,
        )
        path = self.cache / f"backbone-{key}.npz"
        if path.exists():
            with np.load(path) as weights:
                backbone.set_weights([weights[f"w{i}"] for i in range(len(weights))])
            self.pretrain_seconds = None
        else:
            public = synthetic_identities(
                cfg.pretrain_identities, cfg.pretrain_images, image_size=size,
                seed=cfg.data_seed, domain="public",
            )  # fmt: skip
            steps = cfg.pretrain_epochs * -(-len(public.labels) // cfg.pretrain_batch)
            start = time.perf_counter()
            pretrain(
                backbone,
                (np.asarray(public.images), public.labels),
                epochs=cfg.pretrain_epochs,
                optimizer=keras.optimizers.Adam(
                    keras.optimizers.schedules.CosineDecay(cfg.pretrain_lr, steps)
                ),
                batch_size=cfg.pretrain_batch,
                verbose=0,
            )
            self.pretrain_seconds = time.perf_counter() - start
            self.log(f"pretrained in {self.pretrain_seconds:.0f} s")
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, **{f"w{i}": w for i, w in enumerate(backbone.get_weights())})
            tmp.replace(path)
        return backbone, f"last-layer-regime-resnet_gn-{key}"

    def _task_features(self, backbone, name, task):
        from kdpemb.datasets import synthetic_identities
        from kdpemb.features import extract

        cfg = self.config
        per_class = max(cfg.train_per_class) + cfg.test_per_class
        first = 0 if task == "private" else cfg.tuning_first_identity
        data = synthetic_identities(
            cfg.num_classes, per_class, image_size=cfg.image_size,
            seed=cfg.data_seed, first_identity=first,
        )  # fmt: skip
        features = extract(
            backbone, data.images, cache=self.cache, backbone_name=name, verbose=0
        )
        features = features.reshape(cfg.num_classes, per_class, -1)
        labels = np.repeat(np.arange(cfg.num_classes), per_class).reshape(
            cfg.num_classes, per_class
        )
        train = max(cfg.train_per_class)
        return {
            "train": (features[:, :train], labels[:, :train]),
            "evaluation": (features[:, train:], labels[:, train:]),
        }

    def train(self, task, n):
        """`n` training rows: the first n / K of every class."""
        x, y = self.features[task]["train"]
        per_class, rest = divmod(n, self.config.num_classes)
        if rest or not 0 < per_class <= x.shape[1]:
            raise ValueError(
                f"N = {n} must be K = {self.config.num_classes} times at most "
                f"{x.shape[1]} images per class."
            )
        return _flat(x[:, :per_class]), _flat(y[:, :per_class])

    def evaluation(self, task):
        x, y = self.features[task]["evaluation"]
        return _flat(x), _flat(y)


def _flat(array):
    return array.reshape(-1, *array.shape[2:])


# ------------------------------------------------------------------ runs --


def _optimizer(spec):
    import keras

    name, learning_rate = spec
    return getattr(keras.optimizers, name)(learning_rate)


def fit_accuracy(method, setting, train, evaluation, epsilon, delta, seed):
    """Fits one configuration; returns (accuracy on `evaluation`, facts).

    `setting`: dict with "steps" and optionally "optimizer" ((name, lr)),
    "batch" (None: full batch), "l2", "budget_split", "head_init".
    """
    import keras

    from kdpemb.models import LastLayerDPClassifier

    features, labels = train
    keras.utils.set_random_seed(seed)
    private = math.isfinite(epsilon)
    kwargs = {
        "feature_clip_norm": 1.0,
        "l2": setting.get("l2"),
        "seed": seed,
    }
    if private:
        kwargs.update(target_epsilon=epsilon, delta=delta)
    else:
        kwargs.update(noise_multiplier=0.0)
    if method == "dp-sgd":
        kwargs["clip_norm"] = math.sqrt(2.0) if private else 1e9
        kwargs["head_init"] = setting.get("head_init", "zeros")
    else:
        kwargs["budget_split"] = setting.get("budget_split", 0.5)
    num_classes = int(labels.max()) + 1
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ReproducibleNoiseWarning: a benchmark.
        model = LastLayerDPClassifier(num_classes, method, **kwargs)
        if setting.get("optimizer"):
            model.compile(_optimizer(setting["optimizer"]))
        batch = setting.get("batch")
        steps = setting["steps"]
        epochs = steps if batch is None else setting["epochs"]
        model.fit(features, labels, batch_size=batch, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - start
    scores = model.predict(evaluation[0], batch_size=8192, verbose=0)
    accuracy = float((scores.argmax(axis=1) == evaluation[1]).mean())
    facts = {
        "ridge": _ridge(model, features),
        "seconds": round(seconds, 2),
        "noise_multiplier": float(model.step_noise_multiplier),
        "steps": int(model.planned_steps),
    }
    if private:
        spent = model.privacy_statement(delta).epsilon
        if spent > epsilon:
            raise AssertionError(f"ε = {spent} spent, past the target {epsilon}")
        facts["epsilon_spent"] = spent
    return accuracy, facts


def _ridge(model, features):
    """λ of a closed-form run (l2 · N or its noise-scaled default); DP-SGD: l2 · N."""
    n, dim = features.shape
    if model.method == "dp-sgd":
        return (model.l2 or 0.0) * n
    setup, per_step = model._method.releases(
        model.step_noise_multiplier, model.planned_steps
    )
    return float(model._method.ridge((setup or per_step)[0], n, dim))


def logistic_optimum(train, evaluation, l2):
    """scikit-learn's ridge-regularised softmax regression (no intercept).

    Minimises mean loss + l2/2 ‖W‖² on features clipped to norm 1, as
    DP-Newton and DP-FC do: `C = 1 / (N · l2)`.
    """
    from sklearn.linear_model import LogisticRegression

    from kdpemb.models.last_layer.last_layer_stats import clip_rows

    x, y = train
    model = LogisticRegression(
        C=1.0 / (len(x) * l2), fit_intercept=False, max_iter=2000, tol=1e-6
    )
    model.fit(clip_rows(x, 1.0), y)
    predicted = model.predict(clip_rows(evaluation[0], 1.0))
    return float((predicted == evaluation[1]).mean())


def _settings(cfg, method, n, epsilon, logistic_l2):
    """The grid of (method, n, ε): a list of setting dicts."""
    if not math.isfinite(epsilon):
        if method == "dp-ls":
            return [{"steps": 1, "l2": l2} for l2 in cfg.ls_l2_nonprivate]
        if method == "dp-newton":
            steps = (
                cfg.newton_steps_nonprivate_large
                if n >= 10_000
                else cfg.newton_steps_nonprivate
            )
            return [{"optimizer": ("SGD", 0.5), "steps": steps, "l2": logistic_l2}]
        if method == "dp-fc":
            return [
                {"optimizer": ("SGD", 0.3), "steps": cfg.fc_steps_nonprivate,
                 "l2": logistic_l2}
            ]  # fmt: skip
        return [
            {"optimizer": opt, "steps": steps, "l2": l2}
            for opt, steps in cfg.sgd_grid_nonprivate
            for l2 in (None, logistic_l2)
        ]
    if method == "dp-ls":
        return [
            {"steps": 1, "l2": l2, "budget_split": s}
            for l2 in cfg.ls_l2
            for s in cfg.ls_budget_splits
        ]
    if method == "dp-newton":
        large = n >= cfg.large_n
        steps = cfg.newton_steps_large if large else cfg.newton_steps
        variants = cfg.newton_variants[:1] if large else cfg.newton_variants
        return [
            {"optimizer": ("SGD", lr), "steps": t, "l2": l2}
            for t in steps
            for lr, l2 in variants
        ]
    if method == "dp-fc":
        return [
            {"optimizer": ("SGD", lr), "steps": t, "l2": l2}
            for t in cfg.fc_steps
            for lr, l2 in cfg.fc_variants
        ]
    return [{"optimizer": opt, "steps": steps} for opt, steps in cfg.sgd_grid]


class Study:
    """Runs and records; records already in `records.jsonl` are reused."""

    def __init__(self, config, output, log=print, measure=True):
        self.config = config
        self.measure = measure  # False: report the records there, run nothing.
        self.output = pathlib.Path(output)
        self.output.mkdir(parents=True, exist_ok=True)
        self.records_path = self.output / "records.jsonl"
        self.log = log
        self.done = {}
        # (group, method, N, ε) -> the private runs of the chosen setting.
        self.chosen = {}
        self._check_fingerprint()
        if self.records_path.exists():
            for line in self.records_path.read_text().splitlines():
                record = json.loads(line)
                self.done[record["key"]] = record
        self.data = RegimeData(config, log)

    def _check_fingerprint(self):
        """Records are keyed by their settings only: refuse another task's."""
        cfg = self.config
        data = {
            f.name: getattr(cfg, f.name)
            for f in dataclasses.fields(cfg)
            if f.name.startswith("pretrain")
            or f.name in ("image_size", "width", "groups", "embedding_dim",
                          "data_seed", "num_classes", "test_per_class",
                          "tuning_first_identity")
        }  # fmt: skip
        data["max_train_per_class"] = max(cfg.train_per_class)
        data["study_version"] = STUDY_VERSION
        data = json.loads(json.dumps(data))
        path = self.output / "fingerprint.json"
        if path.exists():
            found = json.loads(path.read_text())
            if found != data:
                raise ValueError(
                    f"{self.output} holds records of another study ({found}); "
                    f"this one is {data}. Use another --output."
                )
        else:
            path.write_text(json.dumps(data, indent=1))

    def record(self, kind, **fields):
        """Measures (or reuses) one record; `fields` name it."""
        key = _key({"kind": kind, **fields})
        if key in self.done:
            return self.done[key]
        if not self.measure:
            raise _Missing(key)
        start = time.perf_counter()
        train = self.data.train(fields["task"], fields["n"])
        evaluation = self.data.evaluation(fields["task"])
        if kind == "logistic":
            value, facts = logistic_optimum(train, evaluation, fields["l2"]), {}
        else:
            value, facts = fit_accuracy(
                fields["method"], fields["setting"], train, evaluation,
                fields["epsilon"], 1.0 / fields["n"] ** 2, fields["seed"],
            )  # fmt: skip
        record = {
            "key": key,
            "kind": kind,
            **fields,
            "accuracy": value,
            **facts,
            "wall": round(time.perf_counter() - start, 2),
        }
        with self.records_path.open("a") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")
        self.done[key] = record
        self.log(json.dumps(_short(record), default=_json_default))
        return record

    def n_of(self, per_class):
        return per_class * self.config.num_classes

    def logistic_l2(self, n):
        """The l2 of the best public logistic optimum at N = n."""
        scores = [
            (self.record("logistic", task="tuning", n=n, l2=l2)["accuracy"], -l2, l2)
            for l2 in self.config.logistic_l2
        ]
        return max(scores)[2]

    def tuned(self, method, n, epsilon, settings, kind="main"):
        """Chooses the best setting on the public task; runs it privately.

        With `measure=False` a cell without all its records is left out.
        """
        try:
            return self._tuned(method, n, epsilon, settings, kind)
        except _Missing:
            return None, None, []

    def _tuned(self, method, n, epsilon, settings, kind):
        cfg = self.config
        if len(settings) == 1:  # Nothing to choose.
            setting, tuning_accuracy = settings[0], None
        else:
            tuning = [
                self.record(
                    "tuning",
                    group=kind,
                    task="tuning",
                    method=method,
                    n=n,
                    epsilon=epsilon,
                    setting=s,
                    seed=cfg.tuning_seed,
                )
                for s in settings
            ]
            best = max(range(len(tuning)), key=lambda i: (tuning[i]["accuracy"], -i))
            setting, tuning_accuracy = settings[best], tuning[best]["accuracy"]
        seeds = cfg.seeds if _random(method, epsilon, setting) else cfg.seeds[:1]
        runs = [
            self.record(
                "private",
                group=kind,
                task="private",
                method=method,
                n=n,
                epsilon=epsilon,
                setting=setting,
                seed=seed,
            )
            for seed in seeds
        ]
        self.chosen[(kind, method, n, epsilon)] = runs
        return setting, tuning_accuracy, runs

    def main_grid(self, sizes=None):
        cfg = self.config
        sizes = sizes or [self.n_of(p) for p in cfg.train_per_class]
        for n in sizes:
            try:
                l2 = self.logistic_l2(n)
                # The optimum each ε = ∞ row is measured against.
                self.record("logistic", task="private", n=n, l2=l2)
            except _Missing:
                continue
            for epsilon in sorted(cfg.epsilons, reverse=True):
                for method in METHODS:
                    settings = _settings(cfg, method, n, epsilon, l2)
                    self.tuned(method, n, epsilon, settings)

    def ablations(self):
        cfg = self.config
        n = cfg.ablation_n
        for epsilon in cfg.ablation_epsilons:
            # Random heads against the zero heads of the main grid ("main")
            # and of the single full-batch step ("steps:single", below).
            tuned, _, _ = self.tuned(
                "dp-sgd", n, epsilon, _settings(cfg, "dp-sgd", n, epsilon, None)
            )
            for name, base in (("single", SINGLE_STEP), ("tuned", tuned)):
                if base is None or (name == "tuned" and base == SINGLE_STEP):
                    continue  # Measured just before.
                self.tuned(
                    "dp-sgd", n, epsilon, [{**base, "head_init": "random"}],
                    f"init:{name}:random",
                )  # fmt: skip
            # Optimizers at full batch, each with its own tuned lr and steps.
            for name, lrs in cfg.optimizer_grid:
                settings = [
                    {"optimizer": (name, lr), "steps": t}
                    for lr in lrs
                    for t in cfg.optimizer_steps
                ]
                self.tuned("dp-sgd", n, epsilon, settings, f"optimizer:{name}")
            # One full-batch step against many small Poisson steps.
            self.tuned("dp-sgd", n, epsilon, [SINGLE_STEP], "steps:single")
            small = [
                {"optimizer": ("Adam", lr), "batch": cfg.small_batch, "epochs": e,
                 "steps": e * round(n / cfg.small_batch)}
                for lr in cfg.small_lrs
                for e in cfg.small_epochs
            ]  # fmt: skip
            self.tuned("dp-sgd", n, epsilon, small, "steps:small")


class _Missing(Exception):
    """A record `--report` does not have (it measures nothing)."""


def _random(method, epsilon, setting):
    """Whether seeds change the run: noise, sampling or a random head."""
    return (
        math.isfinite(epsilon)
        or setting.get("batch") is not None
        or setting.get("head_init") == "random"
    )


def _json_default(value):
    return str(value)


def _short(record):
    keep = ("kind", "group", "task", "method", "n", "epsilon", "setting", "seed",
            "l2", "accuracy", "steps", "epsilon_spent", "wall")  # fmt: skip
    return {k: record[k] for k in keep if k in record}


# --------------------------------------------------------------- summary --


def summarize(study):
    """Rows per (group, method, N, ε) of this run: the chosen setting, mean ± std.

    Only the configurations chosen by this invocation's grids are shown;
    other records in `records.jsonl` (older grids) are kept but not used.
    """
    runs = study.chosen
    rows = []
    for (group, method, n, epsilon), records in runs.items():
        accuracies = [r["accuracy"] for r in records]
        first = records[0]
        rows.append(
            {
                "group": group,
                "method": method,
                "n": n,
                "epsilon": float(epsilon),
                "setting": first["setting"],
                "seeds": sorted(r["seed"] for r in records),
                "accuracy_mean": statistics.mean(accuracies),
                "accuracy_std": (
                    statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
                ),
                "noise_multiplier": first["noise_multiplier"],
                "steps": first["steps"],
                "ridge": first.get("ridge"),
                "epsilon_spent": max(r.get("epsilon_spent", 0.0) for r in records),
                "seconds": statistics.mean(r["seconds"] for r in records),
            }
        )
    rows.sort(key=lambda r: (r["group"], r["n"], r["method"], r["epsilon"]))
    sizes = {n for (_, _, n, _) in runs}
    optima = {
        r["n"]: (r["l2"], r["accuracy"])
        for r in study.done.values()
        if r["kind"] == "logistic" and r["task"] == "private" and r["n"] in sizes
    }
    return {"rows": rows, "logistic_optima": optima}


def _epsilon_name(epsilon):
    return "∞" if not math.isfinite(epsilon) else f"{epsilon:g}"


def _setting_name(row):
    setting = row["setting"]
    parts = []
    if setting.get("optimizer"):
        name, lr = setting["optimizer"]
        parts.append(f"{name} {lr:g}")
    if setting.get("batch"):
        parts.append(f"B={setting['batch']}")
    parts.append(f"T={row['steps']}")
    if row["method"] == "dp-sgd":
        if setting.get("l2"):
            parts.append(f"l2={setting['l2']:g}")
    else:
        parts.append(f"λ/N={row['ridge'] / row['n']:.2g}")
        if row["method"] == "dp-ls" and math.isfinite(row["epsilon"]):
            parts.append(f"s={setting.get('budget_split', 0.5):g}")
    if setting.get("head_init") == "random":
        parts.append("random head")
    return ", ".join(parts)


def _accuracy_name(row):
    if row["accuracy_std"]:
        return f"{row['accuracy_mean']:.3f} ± {row['accuracy_std']:.3f}"
    return f"{row['accuracy_mean']:.3f}"


def _method_table(epsilons, cell, name):
    """A markdown table: one row per method, one column per ε, `name(row)`."""
    lines = [
        "| method | " + " | ".join(f"ε = {_epsilon_name(e)}" for e in epsilons) + " |",
        "|---|" + "---|" * len(epsilons),
    ]
    for method in METHODS:
        cells = [name(cell[method, e]) if (method, e) in cell else "" for e in epsilons]
        lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
    return lines


def markdown(summary):
    """The accuracy table, the chosen settings and the ablations, as markdown."""
    rows = summary["rows"]
    main = [r for r in rows if r["group"] == "main"]
    lines = []
    for n in sorted({r["n"] for r in main}):
        these = [r for r in main if r["n"] == n]
        epsilons = sorted({r["epsilon"] for r in these})
        seeds = ", ".join(str(s) for s in max((r["seeds"] for r in these), key=len))
        cell = {(r["method"], r["epsilon"]): r for r in these}
        lines += [
            f"**N = {n:,}** (δ = 1/N² = {1 / n**2:.0e}): test accuracy, mean ± std "
            f"over seeds {seeds} (one run at ε = ∞, where nothing is random)",
            "",
            *_method_table(epsilons, cell, _accuracy_name),
        ]
        if n in summary["logistic_optima"]:
            l2, accuracy = summary["logistic_optima"][n]
            cells = [f"{accuracy:.3f}" if math.isinf(e) else "" for e in epsilons]
            lines.append(
                f"| scikit-learn logistic optimum (l2 = {l2:g}) | "
                + " | ".join(cells)
                + " |"
            )
        lines += ["", "Chosen on the public task (T steps, λ the ridge):", ""]
        lines += _method_table(epsilons, cell, _setting_name)
        lines.append("")
    ablations = [r for r in rows if r["group"] != "main"]
    if ablations:
        lines += [
            "Ablations (DP-SGD; mean ± std over the seeds):",
            "",
            "| N | ε | group | setting | accuracy |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(ablations, key=lambda r: (r["n"], r["epsilon"], r["group"])):
            lines.append(
                f"| {r['n']:,} | {_epsilon_name(r['epsilon'])} | {r['group']} | "
                f"{_setting_name(r)} | {r['accuracy_mean']:.3f} ± "
                f"{r['accuracy_std']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(summary, output, config):
    """One privacy-utility PNG per N; returns their paths."""
    from kdpemb import plots

    main = [r for r in summary["rows"] if r["group"] == "main"]
    paths = []
    for n in sorted({r["n"] for r in main}):
        curves = {}
        for method in METHODS:
            these = sorted(
                (r for r in main if r["n"] == n and r["method"] == method),
                key=lambda r: r["epsilon"],
            )
            if these:
                curves[LABELS[method]] = (
                    [r["epsilon"] for r in these],
                    [r["accuracy_mean"] for r in these],
                )
        paths.append(
            plots.plot_privacy_utility(
                curves,
                pathlib.Path(output) / f"last_layer_n{n}.png",
                utility_name=f"test accuracy ({config.num_classes} classes)",
                title=(
                    f"Last-layer DP, d = {config.embedding_dim}, "
                    f"K = {config.num_classes}, N = {n:,}"
                ),
            )
        )
    return paths


def main(argv=None):
    """`python -m benchmarks.last_layer utility [--quick] [--output DIR] ...`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.last_layer utility")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--output", default=None, help="results folder")
    parser.add_argument("--sizes", default=None, help="comma-separated N values")
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument(
        "--report", action="store_true",
        help="measure nothing: the table and curves of the records there",
    )  # fmt: skip
    args = parser.parse_args(argv)
    config = QUICK if args.quick else RegimeConfig()
    output = pathlib.Path(args.output or f"{config.cache}/results")
    study = Study(config, output, measure=not args.report)
    sizes = None if args.sizes is None else [int(s) for s in args.sizes.split(",")]
    study.main_grid(sizes)
    if not args.no_ablations and (sizes is None or config.ablation_n in sizes):
        study.ablations()
    summary = summarize(study)
    (output / "summary.json").write_text(
        json.dumps(summary, indent=1, default=_json_default)
    )
    (output / "table.md").write_text(markdown(summary))
    plot(summary, output, config)
    return summary

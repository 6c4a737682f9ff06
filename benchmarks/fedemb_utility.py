"""DP-FedEmb utility study: public pretraining, then private fine-tuning.

Issue 17's study on the synthetic identities. Every method starts from
the same backbone and is evaluated by Recall@FAR=1e-3 and 1e-2 over all
pairs of held-out private-domain identities (never trained on):

- `untrained`: the backbone as initialised;
- `public-pretrained`: `kdpemb.models.pretrain` on public-domain
  identities (disjoint, shifted nuisance), and nothing else;
- `centralized`: the public-pretrained backbone fine-tuned non-privately
  with a global head over every private user's identity (the upper bound);
- `FedEmb (non-private)`: FedEmb rounds without clipping or noise;
- `DP-FedEmb` and `DP-FedAvg`: the same rounds with clipping and noise
  multiplier z, whose ε is stated for a simulated deployment (noise s·z,
  s·M clients per round, `deployment_users` users), never as the run's own.
- `DP-FTRL-FedEmb`: DP-FedEmb rounds without sampling (every virtual
  client once per epoch) and tree-aggregated noise, restarted every
  epoch. Its per-node noise is set so that the simulated deployment (s·M
  clients per round over `deployment_users` users, the same rounds, its
  trees restarted at the deployment's epochs) has the ε of DP-FedEmb's
  deployment (RDP: the tree has no PLD model). The run restarts its tree
  every run epoch, more often than the deployment: a prefix sum over
  several trees holds at least as many node noises as one over a single
  tree (popcount(a + b) <= popcount(a) + popcount(b)), so the run is at
  least as noisy as the deployment it stands for, and its recall is a
  conservative estimate of the deployment's.

    python -m benchmarks.fedemb_utility            # the study (GPU: minutes)
    python -m benchmarks.fedemb_utility --quick    # smoke test (seconds)
    python -m benchmarks.fedemb_utility --seeds 0 --methods centralized
    python -m benchmarks.fedemb_utility --set curve_points=10 --curves curves.png

Every run is evaluated on two sets of identities that no method trains
on: the validation identities (`val recall@far=…`, for choosing
hyperparameters) and the test identities (`recall@far=…`, the figures
reported). Prints one JSON line per finished run (so a cut-off run keeps
what it did), a summary, and each method's Recall@FAR over the
centralized run's, paired by seed, with a 95 % t-interval
(`paired_ratios`); `--output FILE` writes all of it as JSON.
"""

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
import warnings

FARS = (1e-3, 1e-2)
METHODS = (
    "untrained",
    "public-pretrained",
    "centralized",
    "FedEmb (non-private)",
    "DP-FedEmb",
    "DP-FedAvg",
    "DP-FTRL-FedEmb",
)


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Sizes and hyperparameters of the study. Hyperparameters are to be
    chosen on the validation identities (`val_*`), apart from the private
    users and from the held-out test identities that the tables report
    (the defaults below were chosen on the test identities, before the
    validation split existed)."""

    image_size: int = 32
    width: int = 32
    embedding_dim: int = 64
    head_scale: float = 30.0
    # Public pretraining.
    public_identities: int = 2000
    public_images: int = 8
    pretrain_epochs: int = 12
    pretrain_lr: float = 2e-3
    batch_size: int = 64
    # Private users (one identity each) and the held-out identities.
    private_identities: int = 4000
    private_images: int = 8
    eval_identities: int = 200
    eval_images: int = 8
    eval_first_identity: int = 1_000_000
    # Validation identities: for choosing hyperparameters, never reported.
    val_identities: int = 200
    val_images: int = 8
    val_first_identity: int = 2_000_000
    # Centralized fine-tuning (the upper bound).
    centralized_epochs: int = 10
    centralized_lr: float = 1e-3
    centralized_batch: int = 64
    centralized_decay: int = 1  # 1: cosine decay of the learning rate; 0: constant.
    # FedEmb rounds.
    users_per_client: int = 4
    clients_per_round: int = 64
    local_steps: int = 4
    client_batch: int = 16
    client_lr: float = 0.01
    head_lr_scale: float = 100.0
    reconstruction_steps: int = 0
    server_optimizer: str = "adam"  # or "sgd" (momentum 0.9)
    server_lr: float = 1e-3
    rounds: int = 300
    clip_norm: float = 1.0
    noise_multiplier: float = 0.01
    adaptive_quantile: float = 0.0  # > 0: adaptive clipping from clip_norm.
    # DP-FTRL: rounds per epoch (0: the divisor of `rounds` closest to P / M)
    # and the tree's estimator ("standard" or Honaker's "efficient").
    ftrl_rounds_per_epoch: int = 0
    ftrl_estimator: str = "standard"
    # The simulated deployment that states ε.
    deployment_scale: float = 256.0
    deployment_users: int = 10_000_000
    seeds: tuple = (0, 1, 2)
    # Convergence curves: Recall@FAR on the validation identities about
    # this many times along each run (0: only at the end).
    curve_points: int = 0


QUICK = StudyConfig(
    image_size=16,
    width=8,
    embedding_dim=16,
    public_identities=30,
    public_images=4,
    pretrain_epochs=1,
    private_identities=40,
    private_images=4,
    eval_identities=20,
    eval_images=4,
    val_identities=20,
    val_images=4,
    centralized_epochs=1,
    clients_per_round=2,
    local_steps=2,
    client_batch=4,
    rounds=2,
    deployment_scale=4.0,
    deployment_users=1000,
    seeds=(0,),
)


def _log(record):
    print(json.dumps(record), flush=True)


class Study:
    """Data and the shared pretrained backbone of one seed."""

    def __init__(self, config, seed, pretrained_cache=None):
        import numpy as np

        from kdpemb.datasets import synthetic_identities

        self.config = config
        self.seed = seed
        size = config.image_size

        def render(count, images, **kwargs):
            data = synthetic_identities(
                count, images, image_size=size, seed=seed, **kwargs
            )
            return np.asarray(data.images), data.labels, data.user_ids

        self.public = render(
            config.public_identities, config.public_images, domain="public"
        )
        self.private = render(config.private_identities, config.private_images)
        self.held_out = render(
            config.eval_identities,
            config.eval_images,
            first_identity=config.eval_first_identity,
        )[:2]
        self.validation = render(
            config.val_identities,
            config.val_images,
            first_identity=config.val_first_identity,
        )[:2]
        self._pretrained = None
        self._cache = pretrained_cache
        if pretrained_cache and os.path.exists(pretrained_cache):
            with np.load(pretrained_cache) as weights:
                self._pretrained = [weights[f"w{i}"] for i in range(len(weights))]

    def backbone(self):
        import keras

        from kdpemb.models import resnet_gn

        keras.utils.set_random_seed(self.seed)
        size = self.config.image_size
        return resnet_gn(
            (size, size, 3),
            embedding_dim=self.config.embedding_dim,
            width=self.config.width,
        )

    def recalls(self, backbone):
        """Recall@FAR on the test identities (`recall@far=…`) and on the
        validation identities (`val recall@far=…`)."""
        from kdpemb.metrics import recall_at_far

        recalls = {}
        for prefix, (images, labels) in (
            ("", self.held_out),
            ("val ", self.validation),
        ):
            embeddings = backbone.predict(images, batch_size=512, verbose=0)
            values = recall_at_far(embeddings, labels, far=FARS)
            for far, value in zip(FARS, values, strict=True):
                recalls[f"{prefix}recall@far={far:g}"] = float(value)
        return recalls

    def pretrained(self):
        """A fresh copy of the public-pretrained backbone (trained once)."""
        import keras
        import numpy as np

        from kdpemb.models import pretrain

        cfg = self.config
        if self._pretrained is None:
            backbone = self.backbone()
            steps = cfg.pretrain_epochs * -(-len(self.public[1]) // cfg.batch_size)
            pretrain(
                backbone,
                self.public[:2],
                epochs=cfg.pretrain_epochs,
                head_scale=cfg.head_scale,
                optimizer=keras.optimizers.Adam(
                    keras.optimizers.schedules.CosineDecay(cfg.pretrain_lr, steps)
                ),
                batch_size=cfg.batch_size,
                verbose=0,
            )
            self._pretrained = backbone.get_weights()
            if self._cache:
                np.savez(
                    self._cache, **{f"w{i}": w for i, w in enumerate(self._pretrained)}
                )
        backbone = self.backbone()
        backbone.set_weights(self._pretrained)
        return backbone

    def centralized(self):
        import keras

        from kdpemb.models import CentralizedBaseline

        cfg = self.config
        backbone = self.pretrained()
        model = CentralizedBaseline(
            backbone, cfg.private_identities, head="cosine", head_scale=cfg.head_scale
        )
        steps = cfg.centralized_epochs * -(
            -len(self.private[1]) // cfg.centralized_batch
        )
        learning_rate = cfg.centralized_lr
        if cfg.centralized_decay:
            learning_rate = keras.optimizers.schedules.CosineDecay(learning_rate, steps)
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        curve = self.curve(cfg, cfg.centralized_epochs, backbone)
        history = model.fit(
            self.private[0],
            self.private[1],
            batch_size=cfg.centralized_batch,
            epochs=cfg.centralized_epochs,
            verbose=0,
            callbacks=curve,
        )
        info = {"examples": cfg.centralized_epochs * len(self.private[1])}
        return backbone, {**info, **self.curve_of(history, curve, "epochs", 1)}

    def _pool(self, cfg):
        return -(-cfg.private_identities // cfg.users_per_client)

    def _ftrl_rounds_per_epoch(self, cfg):
        if cfg.ftrl_rounds_per_epoch:
            if cfg.rounds % cfg.ftrl_rounds_per_epoch:
                raise ValueError(
                    f"ftrl_rounds_per_epoch={cfg.ftrl_rounds_per_epoch} must "
                    f"divide rounds={cfg.rounds}: DP-FTRL trains whole epochs."
                )
            return cfg.ftrl_rounds_per_epoch
        ideal = self._pool(cfg) / cfg.clients_per_round
        divisors = [r for r in range(1, cfg.rounds + 1) if cfg.rounds % r == 0]
        return min(divisors, key=lambda r: abs(r - ideal))

    def ftrl_noise(self, cfg):
        """The run's per-node z and the deployment it is stated for: the
        tree deployment whose ε equals DP-FedEmb's deployment ε."""
        from kdpemb import privacy

        delta = 0.1 / cfg.deployment_users
        k, pool = cfg.users_per_client, self._pool(cfg)
        deployment_clients = -(-cfg.deployment_users // k)
        poisson = privacy.Schedule.virtual_clients(
            cfg.private_identities,
            cfg.clients_per_round,
            users_per_client=k,
            num_clients=pool,
        )
        target = privacy.simulated_deployment(
            poisson,
            cfg.noise_multiplier,
            cfg.rounds,
            scale=cfg.deployment_scale,
            deployment_users=cfg.deployment_users,
            delta=delta,
            deployment_clients=deployment_clients,
        ).deployment.epsilon
        rounds_per_epoch = self._ftrl_rounds_per_epoch(cfg)
        clients = cfg.deployment_scale * pool / rounds_per_epoch
        deployment = privacy.Schedule.virtual_clients(
            cfg.deployment_users,
            clients,
            users_per_client=k,
            num_clients=deployment_clients,
            sampling="epochs",
        )
        mechanism = deployment.privacy_mechanism(1.0, noise="tree")
        z = privacy.calibrate_noise_multiplier(
            mechanism, cfg.rounds, delta, target_epsilon=target, accountant="rdp"
        )
        deployed = mechanism.with_noise_multiplier(z)
        return z / cfg.deployment_scale, {
            "rounds per epoch": rounds_per_epoch,
            "deployment epsilon": privacy.epsilon(deployed, cfg.rounds, delta),
            "deployment rho": deployed.zcdp_rho(cfg.rounds),
            "deployment delta": delta,
            "deployment noise multiplier": z,
            "deployment clients per round": clients,
            "deployment rounds per epoch": deployment.steps_per_epoch,
            "deployment users": cfg.deployment_users,
        }

    def ftrl(self, **overrides):
        from kdpemb.data import VirtualClients
        from kdpemb.models import FedEmbModel

        cfg = dataclasses.replace(self.config, **overrides)
        noise_multiplier, info = self.ftrl_noise(cfg)
        rounds_per_epoch = info["rounds per epoch"]
        images, labels, users = self.private
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Fixed seeds, as above.
            clients = VirtualClients(
                images,
                labels,
                users,
                clients_per_round=None,
                users_per_client=cfg.users_per_client,
                num_clients=self._pool(cfg),
                sampling="epochs",
                rounds_per_epoch=rounds_per_epoch,
                local_steps=cfg.local_steps,
                batch_size=cfg.client_batch,
                seed=self.seed,
            )
            model = FedEmbModel(
                self.pretrained(),
                head="cosine",
                head_scale=cfg.head_scale,
                client_optimizer=cfg.client_lr,
                head_lr_scale=cfg.head_lr_scale,
                reconstruction_steps=cfg.reconstruction_steps,
                clip_norm=cfg.clip_norm,
                noise_multiplier=noise_multiplier,
                noise="tree",
                tree_estimator=cfg.ftrl_estimator,
                seed=self.seed,
            )
        model.compile(optimizer=self._server(cfg))
        epochs = cfg.rounds // rounds_per_epoch
        curve = self.curve(cfg, epochs, model.backbone)
        # Rounds in order (Keras would shuffle them within each epoch), so
        # a run with curves trains on the same order as one without.
        history = model.fit(
            clients, epochs=epochs, verbose=0, callbacks=curve, shuffle=False
        )
        info.update(rounds=cfg.rounds, **{"noise multiplier": noise_multiplier})
        info.update(self.curve_of(history, curve, "rounds", rounds_per_epoch))
        return model.backbone, info

    def _server(self, cfg):
        import keras

        if cfg.server_optimizer == "sgd":
            return keras.optimizers.SGD(cfg.server_lr, momentum=0.9)
        return keras.optimizers.Adam(cfg.server_lr)

    def fedemb(self, aggregation, private, **overrides):

        from kdpemb import privacy
        from kdpemb.data import VirtualClients
        from kdpemb.models import FedEmbModel

        cfg = dataclasses.replace(self.config, **overrides)
        # Epochs only to evaluate the curve: with Poisson sampling, an
        # epoch is a count of rounds (round t is drawn from the seed and t).
        epochs = self.curve_epochs(cfg)
        images, labels, users = self.private
        with warnings.catch_warnings():
            # Fixed seeds void the guarantee; a benchmark wants them.
            warnings.simplefilter("ignore")
            clients = VirtualClients(
                images,
                labels,
                users,
                clients_per_round=cfg.clients_per_round,
                users_per_client=cfg.users_per_client,
                num_clients=-(-cfg.private_identities // cfg.users_per_client),
                local_steps=cfg.local_steps,
                batch_size=cfg.client_batch,
                rounds_per_epoch=cfg.rounds // epochs,
                seed=self.seed,
            )
            model = FedEmbModel(
                self.pretrained(),
                aggregation=aggregation,
                num_classes=cfg.private_identities if aggregation == "full" else None,
                head="cosine",
                head_scale=cfg.head_scale,
                client_optimizer=cfg.client_lr,
                head_lr_scale=cfg.head_lr_scale,
                reconstruction_steps=cfg.reconstruction_steps,
                clip_norm=cfg.clip_norm if private else 1e9,
                noise_multiplier=cfg.noise_multiplier if private else 0.0,
                adaptive_clipping=(
                    privacy.AdaptiveClipping(target_quantile=cfg.adaptive_quantile)
                    if private and cfg.adaptive_quantile
                    else None
                ),
                seed=self.seed,
            )
        model.compile(optimizer=self._server(cfg))
        curve = self.curve(cfg, epochs, model.backbone)
        history = model.fit(
            clients, epochs=epochs, verbose=0, callbacks=curve, shuffle=False
        )  # Rounds in order: the same with and without curves.
        info = {"rounds": cfg.rounds}
        info.update(self.curve_of(history, curve, "rounds", cfg.rounds // epochs))
        if private and cfg.adaptive_quantile:
            info["final clip norm"] = float(model.current_clip_norm.numpy())
        if private:
            info.update(self.deployment(model, cfg))
        return model.backbone, info

    def curve_epochs(self, cfg):
        """FedEmb's epochs: `curve_points` of them when they divide the
        rounds (else the nearest divisor), or 1."""
        if not cfg.curve_points:
            return 1
        divisors = [e for e in range(1, cfg.rounds + 1) if cfg.rounds % e == 0]
        return min(divisors, key=lambda e: abs(e - cfg.curve_points))

    def curve(self, cfg, epochs, backbone):
        """The callbacks that evaluate the validation identities along a run
        of `epochs` epochs (about `curve_points` times; none for 0)."""
        if not cfg.curve_points:
            return []
        from kdpemb.callbacks import RecallAtFAR

        every = max(1, epochs // cfg.curve_points)
        return [RecallAtFAR(self.validation, far=FARS, every_n_epochs=every,
                            backbone=backbone)]  # fmt: skip

    @staticmethod
    def curve_of(history, curve, unit, per_epoch):
        """`{"curve": [[x, val recall@1e-3, val recall@1e-2], ...], "curve
        unit": unit}` from a fit's history: the callback logs every
        `every_n_epochs`-th epoch, so its i-th value is of epoch
        (i + 1) · every, at x = that many epochs × `per_epoch`."""
        if not curve:
            return {}
        every, keys = curve[0].every_n_epochs, curve[0].keys
        values = [history.history.get(key, []) for key in keys]
        epochs = len(history.epoch)
        if any(len(v) != epochs // every for v in values):
            raise ValueError(
                f"The curve has {[len(v) for v in values]} points for {epochs} "
                f"epochs evaluated every {every}: the callback's logs were lost."
            )
        points = [
            [(i + 1) * every * per_epoch, *(float(v[i]) for v in values)]
            for i in range(len(values[0]))
        ]
        return {"curve": points, "curve unit": unit}

    def deployment(self, model, cfg):
        delta = 0.1 / cfg.deployment_users
        statement = model.simulated_deployment(
            cfg.deployment_scale,
            cfg.deployment_users,
            delta=delta,
            deployment_clients=-(-cfg.deployment_users // cfg.users_per_client),
        )
        return {
            "deployment epsilon": statement.deployment.epsilon,
            "deployment delta": delta,
            "deployment noise multiplier": statement.deployment.noise_multiplier,
            "deployment clients per round": statement.deployment_clients_per_round,
            "deployment users": cfg.deployment_users,
        }

    def run(self, method, **overrides):
        start = time.perf_counter()
        if method == "untrained":
            backbone, info = self.backbone(), {}
        elif method == "public-pretrained":
            backbone, info = self.pretrained(), {}
        elif method == "centralized":
            backbone, info = self.centralized()
        elif method == "FedEmb (non-private)":
            backbone, info = self.fedemb("partial", private=False, **overrides)
        elif method == "DP-FedEmb":
            backbone, info = self.fedemb("partial", private=True, **overrides)
        elif method == "DP-FedAvg":
            backbone, info = self.fedemb("full", private=True, **overrides)
        elif method == "DP-FTRL-FedEmb":
            backbone, info = self.ftrl(**overrides)
        else:
            raise ValueError(f"unknown method {method!r}; one of {METHODS}")
        record = {"method": method, "seed": self.seed, **overrides, **info}
        record.update(self.recalls(backbone))
        record["seconds"] = round(time.perf_counter() - start, 1)
        return record


def summarize(records):
    """Mean and std over seeds of each method (and each ablation)."""
    groups = {}
    for record in records:
        key = tuple(
            (k, v)
            for k, v in record.items()
            if k
            not in ("seed", "seconds", "final clip norm", "noise multiplier", "curve")
            and not k.startswith(("recall", "val recall", "deploy"))
        )
        groups.setdefault(key, []).append(record)
    summary = []
    for key, group in groups.items():
        row = dict(key)
        row["seeds"] = [r["seed"] for r in group]
        for prefix, far in itertools.product(("val ", ""), FARS):
            # Validation first: the figures to choose hyperparameters on.
            values = [r[f"{prefix}recall@far={far:g}"] for r in group]
            row[f"{prefix}recall@far={far:g} mean"] = statistics.fmean(values)
            row[f"{prefix}recall@far={far:g} std"] = (
                statistics.stdev(values) if len(values) > 1 else 0.0
            )
        if "deployment epsilon" in group[0]:
            row["deployment epsilon"] = group[0]["deployment epsilon"]
        summary.append(row)
    return summary


# Two-sided 95 % Student t quantiles by degrees of freedom (1-10), for
# the interval of a mean over a few seeds; beyond 10 the value of 10
# (a slightly wider interval, on the safe side).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def paired_ratios(records, reference="centralized", key="recall@far=0.001"):
    """Each method's `key` over the reference's, paired by seed.

    Returns one row per method (and ablation) with the per-seed ratios R,
    their mean and a 95 % t-interval of the mean (None with one seed).
    Seeds the reference lacks, or where its value is 0 (no ratio), are
    left out.

    >>> runs = [{"method": "centralized", "seed": s, "r": v}
    ...         for s, v in ((0, 0.5), (1, 0.4))]
    >>> runs += [{"method": "A", "seed": s, "r": v} for s, v in ((0, 0.45), (1, 0.4))]
    >>> row = paired_ratios(runs, key="r")[0]
    >>> row["method"], row["ratios"], round(row["mean"], 3)
    ('A', [0.9, 1.0], 0.95)
    """
    base = {r["seed"]: r[key] for r in records if r["method"] == reference and r[key]}
    groups = {}
    for record in records:
        if record["method"] == reference or record["seed"] not in base:
            continue
        label = tuple(
            (k, v)
            for k, v in record.items()
            if k
            not in ("seed", "seconds", "final clip norm", "noise multiplier", "curve")
            and not k.startswith(("recall", "val recall", "deploy"))
        )
        groups.setdefault(label, []).append(record[key] / base[record["seed"]])
    rows = []
    for label, ratios in groups.items():
        mean = statistics.fmean(ratios)
        interval = None
        if len(ratios) > 1:
            half = (
                T95[min(len(ratios), len(T95) + 1) - 2]
                * statistics.stdev(ratios)
                / len(ratios) ** 0.5
            )
            interval = (mean - half, mean + half)
        rows.append(
            {**dict(label), "key": key, "ratios": ratios, "mean": mean,
             "interval95": interval}
        )  # fmt: skip
    return rows


def plot_curves(records, path):
    """Writes the validation curves of `records` (those with a "curve") to
    the PNG `path`: Recall@FAR=1e-3 and 1e-2 against epochs (the
    centralized baseline) or rounds (the federated methods), one line per
    method and seed. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = [f.name for f in dataclasses.fields(StudyConfig)]
    runs = [r for r in records if r.get("curve")]
    if not runs:
        raise ValueError(
            "No run has a curve: set curve_points (e.g. --set curve_points=10)."
        )
    units = sorted({r["curve unit"] for r in runs})
    figure, axes = plt.subplots(
        len(FARS), max(1, len(units)), figsize=(5 * max(1, len(units)), 7),
        squeeze=False,
    )  # fmt: skip
    for column, unit in enumerate(units):
        for row, far in enumerate(FARS):
            axis = axes[row][column]
            for run in (r for r in runs if r["curve unit"] == unit):
                x = [point[0] for point in run["curve"]]
                y = [point[1 + row] for point in run["curve"]]
                settings = [  # An ablation's overrides tell its runs apart.
                    f"{k}={run[k]}" for k in fields if k in run and k != "rounds"
                ]
                label = " ".join([run["method"], *settings, f"(seed {run['seed']})"])
                axis.plot(x, y, marker=".", label=label)
            axis.set_xlabel(unit)
            axis.set_ylabel(f"validation Recall@FAR={far:g}")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument(
        "--set", nargs="*", default=[], help="config overrides, e.g. rounds=100"
    )
    parser.add_argument(
        "--ablate",
        nargs="*",
        default=[],
        help="extra DP-FedEmb runs, e.g. users_per_client=1,16 local_steps=1,8",
    )
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--curves", default=None, help="PNG of the validation curves (curve_points)"
    )
    parser.add_argument(
        "--pretrained-cache", default=None, help=".npz of the pretrained weights"
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else StudyConfig()
    config = dataclasses.replace(config, **_parse(args.set))
    seeds = tuple(args.seeds) if args.seeds is not None else config.seeds
    _log({"config": dataclasses.asdict(config), "seeds": seeds})
    records = []
    for seed in seeds:
        cache = args.pretrained_cache and args.pretrained_cache.format(seed=seed)
        study = Study(config, seed, cache)
        for method in args.methods:
            records.append(study.run(method))
            _log(records[-1])
        for name, values in _parse(args.ablate, many=True).items():
            for value in values:
                records.append(study.run("DP-FedEmb", **{name: value}))
                _log(records[-1])
    summary = summarize(records)
    for row in summary:
        _log({"summary": row})
    ratios = [
        row
        for key in (f"recall@far={far:g}" for far in FARS)
        for row in paired_ratios(records, key=key)
    ]
    for row in ratios:
        _log({"ratio to centralized": row})
    if args.curves:
        plot_curves(records, args.curves)
    if args.output:
        with open(args.output, "w") as file:
            json.dump(
                {
                    "config": dataclasses.asdict(config),
                    "runs": records,
                    "summary": summary,
                    "ratios to centralized": ratios,
                },
                file,
                indent=1,
            )
    return summary


def _parse(items, many=False):
    fields = {f.name: f.type for f in dataclasses.fields(StudyConfig)}
    parsed = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in fields:
            raise SystemExit(f"unknown setting {name!r}; one of {sorted(fields)}")
        kind = fields[name] if fields[name] in (int, float, str) else float
        values = [kind(v) for v in text.split(",")]
        parsed[name] = values if many else values[0]
    return parsed


if __name__ == "__main__":
    sys.exit(main() and 0)

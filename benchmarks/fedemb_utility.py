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

    python -m benchmarks.fedemb_utility --cpu --tune --output tuned.json
    python -m benchmarks.fedemb_utility --cpu --tuned tuned.json --curves cpu.png
    KERAS_BACKEND=jax python -m benchmarks.fedemb_utility --gpu-slot  # one H200
    python -m benchmarks.fedemb_utility --quick      # smoke test (seconds)
    python -m benchmarks.fedemb_utility --seeds 0 --methods centralized

`--tune` walks `TUNING_GRID` (written down before the runs) on the
validation identities; `--tuned` runs every method with what it chose
(`--tuned builtin`: `CHOSEN`, the CPU study's choice). The centralized
baseline's head is imprinted from the private users' mean embeddings
(`CentralizedBaseline.imprint_head`) unless `centralized_head=random`.

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
    # The global head's start: "imprint" (each identity's column is the
    # mean normalised embedding of its images under the pretrained
    # backbone) or "random". A random 1-of-N head at the start sends large,
    # uninformative gradients into the pretrained backbone.
    centralized_head: str = "imprint"
    # FedEmb rounds.
    users_per_client: int = 4
    clients_per_round: int = 64
    local_steps: int = 4
    client_batch: int = 16
    client_lr: float = 0.01
    client_momentum: float = 0.0
    head_lr_scale: float = 100.0
    reconstruction_steps: int = 0
    # The local heads' start (DP-FedEmb, DP-FTRL-FedEmb): "random" or
    # "class_means" (imprinted from the client's own examples).
    local_head_init: str = "random"
    server_optimizer: str = "adam"  # or "sgd" (with server_momentum)
    server_lr: float = 1e-3
    server_momentum: float = 0.9  # "sgd" only.
    # The server's learning rate over the rounds: linear warm-up from
    # lr / 20 over the first server_warmup rounds (-1: a tenth of the
    # rounds), then constant
    # (server_decay=0) or cosine decay (1), reaching 0 at step `rounds`.
    server_warmup: int = 0
    server_decay: int = 0
    rounds: int = 300
    clip_norm: float = 1.0
    noise_multiplier: float = 0.01
    # > 0: instead of noise_multiplier, the run's z is calibrated so that
    # the simulated deployment spends this ε (equal ε across k and methods).
    deployment_epsilon: float = 0.0
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
    deployment_epsilon=8.0,
    seeds=(0,),
)


# The study at a size that a 2-core CPU runs in about a minute a run
# (16 x 16 images, 1,000 private users): the tables of docs/fedemb.md.
CPU = StudyConfig(
    image_size=16,
    width=16,
    embedding_dim=32,
    public_identities=1000,
    pretrain_epochs=6,
    private_identities=1000,
    centralized_epochs=16,
    clients_per_round=16,
    rounds=150,
    curve_points=5,
    deployment_epsilon=4.0,
    seeds=(0, 1, 2, 3, 4),
)

# The tuning grid, written down before any run of the study. `--tune`
# walks it in order on seed TUNING_SEED. A stage tries each value of one
# setting for one method, scores every run by its validation
# Recall@FAR=1e-3 (the test identities are never looked at), and keeps the
# best value for the stages after it. "fedemb" stages are scored on
# DP-FedEmb at the deployment ε of `deployment_epsilon` (so a larger k
# pays its privacy cost in noise) and set every federated method; a
# method's own stage sets that method only. "server" is
# "optimizer:learning rate".
TUNING_SEED = 0
TUNING_GRID = (
    ("centralized", "centralized_lr", (1e-3, 3e-3)),
    ("centralized", "centralized_epochs", (8, 16, 32)),
    ("fedemb", "local_head_init", ("random", "class_means")),
    ("fedemb", "server", ("adam:0.003", "sgd:0.3", "sgd:1", "sgd:3")),
    ("fedemb", "users_per_client", (4, 16, 64)),
    ("fedemb", "client_momentum", (0.0, 0.9)),
    ("fedemb", "server_schedule", ("constant", "warmup-cosine")),
    ("DP-FedEmb", "clip_norm", (0.3, 1.0, 3.0)),
    ("DP-FedAvg", "server", ("adam:0.003", "sgd:0.3", "sgd:1", "sgd:3")),
    ("DP-FTRL-FedEmb", "clip_norm", (0.3, 1.0, 3.0)),
)
# As first written, the grid also had ("fedemb", "local_steps", (4, 8))
# after client_momentum and ("DP-FTRL-FedEmb", "server", ("sgd:0.3",
# "sgd:1", "sgd:3")) before DP-FTRL's clip norm; both were dropped for CPU
# time before any of their runs (docs/fedemb.md).
# `--quick --tune`: one stage of each kind, at the quick sizes.
QUICK_GRID = (
    ("centralized", "centralized_lr", (1e-3, 3e-3)),
    ("fedemb", "server", ("adam:0.003", "sgd:1")),
    ("fedemb", "users_per_client", (2, 4)),
    ("DP-FedAvg", "server", ("sgd:1",)),
    ("DP-FTRL-FedEmb", "clip_norm", (1.0,)),
)
FEDERATED = ("FedEmb (non-private)", "DP-FedEmb", "DP-FedAvg", "DP-FTRL-FedEmb")


# What `--tune` chose on the CPU study (docs/fedemb.md): the settings
# `--tuned builtin` and `--gpu-slot` run with.
_SHARED = {
    "local_head_init": "class_means",
    "server_optimizer": "adam",
    "server_lr": 0.003,
    "users_per_client": 16,
    "client_momentum": 0.9,
    "server_warmup": 0,
    "server_decay": 0,
}
CHOSEN = {
    "centralized": {"centralized_lr": 0.003, "centralized_epochs": 32},
    "FedEmb (non-private)": dict(_SHARED),
    "DP-FedEmb": {**_SHARED, "clip_norm": 0.3},
    "DP-FedAvg": {
        **{k: v for k, v in _SHARED.items() if k != "local_head_init"},
        "server_optimizer": "sgd",
        "server_lr": 3.0,
    },
    "DP-FTRL-FedEmb": {**_SHARED, "clip_norm": 0.3},
}

# `--gpu-slot`: the GPU-scale comparison of one seed with the chosen
# settings, sized for about 9 minutes on one H200 under JAX.
GPU_SLOT_METHODS = (
    "public-pretrained",
    "centralized",
    "FedEmb (non-private)",
    "DP-FedEmb",
)


def gpu_slot(quick=False):
    """`(config, methods, seeds, chosen)` of `--gpu-slot`: the default
    (GPU) sizes, or the quick ones, with the validation curves on."""
    if not CHOSEN:
        raise ValueError("CHOSEN is empty: run --cpu --tune and fill it in.")
    base = QUICK if quick else StudyConfig(deployment_epsilon=4.0)
    config = dataclasses.replace(base, curve_points=base.curve_points or 6)
    return config, GPU_SLOT_METHODS, (0,), CHOSEN


def setting(name, value):
    """The config overrides of one grid value (`server` and
    `server_schedule` name two; "warmup-cosine": a tenth of the rounds of
    warm-up, then cosine decay)."""
    if name == "server_schedule":
        if value not in ("constant", "warmup-cosine"):
            raise ValueError(
                f"server_schedule={value!r}: use 'constant' or 'warmup-cosine'."
            )
        cosine = value == "warmup-cosine"
        return {"server_warmup": -1 if cosine else 0, "server_decay": int(cosine)}
    if name == "server":
        optimizer, _, rate = str(value).partition(":")
        return {"server_optimizer": optimizer, "server_lr": float(rate)}
    return {name: value}


def tune(config, grid=TUNING_GRID, seed=TUNING_SEED, cache=None, log=None, done=()):
    """Walks `grid` (see `TUNING_GRID`) on `seed`; returns `{method:
    overrides}` with the choices for every method and the runs made.

    A value that leaves the method's settings as an earlier run of the
    walk had them (e.g. the default, or the value chosen before) reuses
    that run. `done`: records of an earlier, cut-off walk of the same
    grid; a run whose stage, method and settings match one of them is
    taken from it instead of being run again."""
    if not config.deployment_epsilon:
        raise ValueError(
            "Tuning needs deployment_epsilon > 0: the DP runs are compared at "
            "one deployment ε (a larger k costs more ε at the same z)."
        )
    log = log or (lambda record: None)
    log({"grid": grid, "seed": seed})
    study = Study(config, seed, cache)
    chosen = {method: {} for method in ("centralized", *FEDERATED)}
    runs, seen = [], {}
    for target, name, values in grid:
        method = "DP-FedEmb" if target == "fedemb" else target
        scored = []
        for value in values:
            overrides = {**chosen[method], **setting(name, value)}
            label = f"{target}: {name}={value}"
            earlier = [
                r for r in done
                if r.get("tuning") == label and r["method"] == method
                and r["seed"] == seed
                and all(r.get(k) == v for k, v in overrides.items())
            ]  # fmt: skip
            settings = (method, tuple(sorted(
                dataclasses.asdict(dataclasses.replace(config, **overrides)).items()
            )))  # fmt: skip
            if earlier:
                record = earlier[-1]
            elif settings in seen:
                record = {**seen[settings], "tuning": label}
            else:
                record = study.run(method, **overrides)
                record["tuning"] = label
            seen[settings] = record
            runs.append(record)
            log(record)
            scored.append((record["val recall@far=0.001"], value))
        best = max(scored, key=lambda pair: pair[0])[1]
        for each in FEDERATED if target == "fedemb" else (target,):
            if each == "DP-FedAvg" and name == "local_head_init":
                continue  # Its global head starts at random whatever is set.
            chosen[each].update(setting(name, best))
        log({"tuned": target, "setting": name, "scores": scored, "best": best})
    return chosen, runs


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

    def centralized(self, **overrides):
        import keras

        from kdpemb.models import CentralizedBaseline

        cfg = dataclasses.replace(self.config, **overrides)
        backbone = self.pretrained()
        model = CentralizedBaseline(
            backbone, cfg.private_identities, head="cosine", head_scale=cfg.head_scale
        )
        if cfg.centralized_head == "imprint":
            model.imprint_head(*self.private[:2], batch_size=512)
        elif cfg.centralized_head != "random":
            raise ValueError(
                f"centralized_head={cfg.centralized_head!r}: use 'imprint' or 'random'."
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
        target = (
            cfg.deployment_epsilon
            or privacy.simulated_deployment(
                poisson,
                self.noise_multiplier(cfg, poisson),
                cfg.rounds,
                scale=cfg.deployment_scale,
                deployment_users=cfg.deployment_users,
                delta=delta,
                deployment_clients=deployment_clients,
            ).deployment.epsilon
        )
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
                head_init=cfg.local_head_init,
                client_optimizer=self._client(cfg),
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

    @staticmethod
    def _server(cfg):
        """The server optimizer of `cfg`: one step per round."""
        import keras

        rate = cfg.server_lr
        if cfg.server_warmup or cfg.server_decay:
            warmup = cfg.server_warmup if cfg.server_warmup >= 0 else cfg.rounds // 10
            warmup = min(warmup, cfg.rounds - 1)
            rate = keras.optimizers.schedules.CosineDecay(
                cfg.server_lr / 20 if warmup else cfg.server_lr,
                # Without decay, a period too long to be seen.
                decay_steps=cfg.rounds - warmup if cfg.server_decay else 10**9,
                warmup_target=cfg.server_lr if warmup else None,
                warmup_steps=warmup,
            )
        if cfg.server_optimizer == "sgd":
            return keras.optimizers.SGD(rate, momentum=cfg.server_momentum)
        if cfg.server_optimizer == "adam":
            return keras.optimizers.Adam(rate)
        raise ValueError(
            f"server_optimizer={cfg.server_optimizer!r}: use 'sgd' or 'adam'."
        )

    @staticmethod
    def _client(cfg):
        import keras

        return keras.optimizers.SGD(cfg.client_lr, momentum=cfg.client_momentum)

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
                # DP-FedAvg's global head starts at random, whatever is set.
                head_init=cfg.local_head_init if aggregation == "partial" else None,
                client_optimizer=self._client(cfg),
                head_lr_scale=cfg.head_lr_scale,
                reconstruction_steps=cfg.reconstruction_steps,
                clip_norm=cfg.clip_norm if private else 1e9,
                noise_multiplier=(
                    self.noise_multiplier(cfg, clients.schedule) if private else 0.0
                ),
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
            info["noise multiplier"] = float(model.noise_multiplier)
            info.update(self.deployment(model, cfg))
        return model.backbone, info

    @staticmethod
    def noise_multiplier(cfg, schedule):
        """The run's z: `noise_multiplier`, or, with `deployment_epsilon`,
        the z whose simulated deployment (Poisson rounds) spends that ε."""
        from kdpemb import privacy

        if not cfg.deployment_epsilon:
            return cfg.noise_multiplier
        return privacy.calibrate_run_noise(
            schedule,
            cfg.rounds,
            0.1 / cfg.deployment_users,
            target_epsilon=cfg.deployment_epsilon,
            scale=cfg.deployment_scale,
            deployment_users=cfg.deployment_users,
            deployment_clients=-(-cfg.deployment_users // cfg.users_per_client),
        )

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
            backbone, info = self.centralized(**overrides)
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


_NOT_SETTINGS = (
    "seed", "seconds", "final clip norm", "noise multiplier", "curve", "tuning"
)  # fmt: skip


def _settings_of(record):
    """What tells a run's group apart: its method and settings, in the
    order they came (the first record's order is the row's), but compared
    whatever the order (runs made apart list them differently)."""
    return _Settings(
        (k, v)
        for k, v in record.items()
        if k not in _NOT_SETTINGS
        and not k.startswith(("recall", "val recall", "deploy"))
    )


class _Settings(tuple):
    """A tuple of (name, value) pairs that equals any order of the same."""

    def __eq__(self, other):
        return dict(self) == dict(other)

    def __hash__(self):
        return hash(frozenset(self))


def summarize(records):
    """Mean and std over seeds of each method (and each ablation)."""
    groups = {}
    for record in records:
        key = _settings_of(record)
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
        label = _settings_of(record)
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
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    size.add_argument("--cpu", action="store_true", help="the CPU-scale study")
    parser.add_argument(
        "--gpu-slot",
        action="store_true",
        help="the GPU-scale comparison, seed 0, chosen settings (about 9 "
        "minutes on one H200; run it with KERAS_BACKEND=jax); writes "
        "fedemb_gpu_slot.json and "
        "fedemb_gpu_slot.png unless --output / --curves say otherwise",
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--methods", nargs="*", default=None, help="default: all")
    parser.add_argument(
        "--set", nargs="*", default=[], help="config overrides, e.g. rounds=100"
    )
    parser.add_argument(
        "--ablate",
        nargs="*",
        default=[],
        help="extra DP-FedEmb runs, e.g. users_per_client=1,16 local_steps=1,8",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="walk TUNING_GRID on the validation identities of seed "
        f"{TUNING_SEED} and print (--output: write) the chosen settings",
    )
    parser.add_argument(
        "--tuned",
        default=None,
        help="the --tune --output FILE whose chosen settings each method runs "
        "with, or 'builtin' (CHOSEN: the CPU study's choice)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        help="with --tune: the log (JSON lines) of a cut-off --tune run, whose "
        "finished runs are reused",
    )
    parser.add_argument(
        "--combine",
        nargs="*",
        default=None,
        help="--output FILEs of earlier runs (e.g. the centralized baseline "
        "and the federated methods run apart): summarised, paired and drawn "
        "together, nothing trained",
    )
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--curves", default=None, help="PNG of the validation curves (curve_points)"
    )
    parser.add_argument(
        "--pretrained-cache", default=None, help=".npz of the pretrained weights"
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else CPU if args.cpu else StudyConfig()
    chosen = {}
    if args.tune and (args.tuned or args.methods or args.ablate or args.seeds):
        parser.error("--tune walks its grid on one seed: drop --tuned, "
                     "--methods, --ablate and --seeds")  # fmt: skip
    if args.gpu_slot:
        if args.tune or args.cpu or args.methods or args.tuned:
            parser.error(
                "--gpu-slot runs its own methods with the chosen settings: "
                "drop --tune, --cpu, --methods and --tuned"
            )
        config, args.methods, seeds, chosen = gpu_slot(args.quick)
        args.output = args.output or "fedemb_gpu_slot.json"
        args.curves = args.curves or "fedemb_gpu_slot.png"
    if args.methods is None:
        args.methods = list(METHODS)
    settings = _parse(args.set)
    config = dataclasses.replace(config, **settings)
    if not args.gpu_slot:
        seeds = config.seeds
    if args.seeds is not None:
        seeds = tuple(args.seeds)
    _log({"config": dataclasses.asdict(config), "seeds": seeds})

    def cache_of(seed):
        return args.pretrained_cache and args.pretrained_cache.format(seed=seed)

    if args.tune:
        grid = QUICK_GRID if args.quick else TUNING_GRID
        done = []
        if args.resume:
            with open(args.resume) as file:
                for line in file:
                    if line.startswith('{"method"'):
                        done.append(json.loads(line))
        chosen, runs = tune(
            config, grid, cache=cache_of(TUNING_SEED), log=_log, done=done
        )
        _log({"chosen": chosen})
        if args.output:
            with open(args.output, "w") as file:
                json.dump(
                    {"config": dataclasses.asdict(config), "grid": grid,
                     "seed": TUNING_SEED, "runs": runs, "chosen": chosen},
                    file, indent=1,
                )  # fmt: skip
        return chosen
    if args.tuned == "builtin":
        chosen = CHOSEN
    elif args.tuned:
        with open(args.tuned) as file:
            saved = json.load(file)
        if "chosen" not in saved:
            raise SystemExit(f"{args.tuned} has no 'chosen' settings: give the "
                             "--output file of a --tune run.")  # fmt: skip
        chosen = saved["chosen"]
    # What --set names wins over the tuned choice.
    chosen = {
        method: {k: v for k, v in values.items() if k not in settings}
        for method, values in chosen.items()
    }
    if chosen:
        _log({"tuned settings": chosen})
    records = []
    if args.combine:
        for path in args.combine:
            with open(path) as file:
                records.extend(json.load(file)["runs"])
        seeds = ()  # Nothing to train.
    for seed in seeds:
        study = Study(config, seed, cache_of(seed))
        for method in args.methods:
            records.append(study.run(method, **chosen.get(method, {})))
            _log(records[-1])
        for name, values in _parse(args.ablate, many=True).items():
            for value in values:
                overrides = {**chosen.get("DP-FedEmb", {}), name: value}
                records.append(study.run("DP-FedEmb", **overrides))
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
                    "tuned settings": chosen,
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

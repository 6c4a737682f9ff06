"""DP-FedEmb: utility on synthetic identities, and the cost of a round.

Utility (`utility()`): `small_cnn` backbones trained on synthetic
identities (one user per identity) and evaluated by Recall@FAR=1e-3 (and
1e-2) over all pairs of held-out identities (`first_identity=1_000_000`,
past every training identity), embedded by `model.backbone`:

1. `non_private`: non-private FedEmb (`noise_multiplier=0`,
   `clip_norm=1e9`) against `CentralizedBaseline` with an ordinary `fit`
   over the same number of examples, and the untrained backbone;
2. `dp_comparison`: DP-FedEmb (`aggregation="partial"`) against DP-FedAvg
   (`aggregation="full"`, a global head over every training identity) at
   the same noise multiplier and clip norm, the mean and standard
   deviation over seeds, with ε at δ = 0.1 / users.

`defaults()` (not part of `run`) repeats the non-private FedEmb run with
FedEmbModel's default server optimizer and head learning-rate scale.
FedEmb runs use client SGD(0.01), `head_lr_scale=100` (the default) and a
server Adam(3e-3); see `UtilityConfig` and docs/fedemb.md.

Speed (`speed()`), measured in one run after a warm-up, alternating the
two so that both see the same load on a shared machine:

- CPU: seconds of one FedEmb round of M clients × S local steps × batch B
  with noise on, against M·S ordinary non-private gradient steps at
  batch B (`CentralizedBaseline.fit` over M·S batches) on the same
  backbone and images; the ratio (goal: at most 1.2).
- GPU (when the backend sees one): examples per second of a round with
  every client trained at once against centralized training at batch
  M×B; the ratio (goal: at least 0.5). "no GPU" otherwise.

    python -m benchmarks fedemb              # both (~35 min on 2 CPU cores)
    python -m benchmarks fedemb --quick      # smoke test
    python -m benchmarks.fedemb speed        # one part as JSON; also
    python -m benchmarks.fedemb non-private  # utility, defaults, all,
    python -m benchmarks.fedemb dp 0 partial # and one DP run (seed, method)
"""

import dataclasses
import json
import math
import statistics
import sys
import warnings

import keras
import numpy as np

from benchmarks.timing import gpu_available, time_fit, timed
from kdpemb.data import VirtualClients
from kdpemb.datasets import synthetic_identities
from kdpemb.metrics import recall_at_far
from kdpemb.models import CentralizedBaseline, FedEmbModel, small_cnn

FARS = (1e-3, 1e-2)


@dataclasses.dataclass(frozen=True)
class UtilityConfig:
    """Sizes and hyperparameters of the utility runs."""

    image_size: int = 32
    width: int = 8
    groups: int = 4
    embedding_dim: int = 32
    eval_identities: int = 200
    eval_images: int = 8
    eval_first_identity: int = 1_000_000  # Past every training identity.
    # Non-private comparison: training data and the centralized baseline.
    identities: int = 200
    images_per_identity: int = 20
    centralized_epochs: int = 25
    centralized_batch: int = 64
    centralized_lr: float = 1e-3
    # FedEmb rounds (both comparisons): users of one identity each.
    clients_per_round: int = 8
    users_per_client: int = 4
    local_steps: int = 8
    batch_size: int = 8
    client_lr: float = 0.01
    head_lr_scale: float = 100.0
    server_lr: float = 3e-3  # Adam.
    # DP comparison.
    dp_identities: int = 4000
    dp_images_per_identity: int = 4
    dp_clients_per_round: int = 16
    dp_rounds: int = 200
    noise_multiplier: float = 0.5
    clip_norm: float = 0.05
    seeds: tuple = (0, 1, 2)

    @property
    def examples_per_round(self):
        return self.clients_per_round * self.local_steps * self.batch_size

    @property
    def centralized_examples(self):
        return self.centralized_epochs * self.identities * self.images_per_identity

    @property
    def rounds(self):
        """FedEmb rounds that see (in expectation) the centralized examples."""
        return max(1, round(self.centralized_examples / self.examples_per_round))


QUICK_UTILITY = UtilityConfig(
    image_size=16,
    width=4,
    groups=2,
    embedding_dim=8,
    eval_identities=20,
    eval_images=4,
    identities=24,
    images_per_identity=4,
    centralized_epochs=1,
    centralized_batch=16,
    clients_per_round=2,
    local_steps=2,
    batch_size=4,
    dp_identities=24,
    dp_images_per_identity=4,
    dp_clients_per_round=2,
    dp_rounds=2,
    seeds=(0,),
)


def _silenced(function, *args, **kwargs):
    # Fixed seeds make a benchmark repeatable; they void the guarantee,
    # which does not matter here, so their warnings are silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return function(*args, **kwargs)


def _backbone(config, seed):
    keras.utils.set_random_seed(seed)
    return small_cnn(
        (config.image_size, config.image_size, 3),
        embedding_dim=config.embedding_dim,
        width=config.width,
        groups=config.groups,
    )


def _recalls(backbone, evaluation):
    """Recall@FAR at 1e-3 (the figure) and 1e-2 (less noisy at this scale)."""
    images, labels = evaluation
    embeddings = backbone.predict(images, batch_size=512, verbose=0)
    return [float(v) for v in recall_at_far(embeddings, labels, far=FARS)]


def _identities(config, count, per_identity, first_identity=0):
    data = synthetic_identities(
        count,
        per_identity,
        image_size=config.image_size,
        seed=0,
        first_identity=first_identity,
    )
    return np.asarray(data.images), data.labels, data.user_ids


def _fedemb(config, train, *, seed, clients_per_round, rounds, server=None, **args):
    """Fits a FedEmbModel for `rounds` rounds; returns it and its clients."""
    images, labels, users = train
    # The benchmark's user count is a public setting: P is given from it.
    num_users = np.unique(users).size
    clients = _silenced(
        VirtualClients,
        images, labels, users,
        clients_per_round=clients_per_round,
        users_per_client=config.users_per_client,
        num_clients=-(-num_users // config.users_per_client),
        local_steps=config.local_steps,
        batch_size=config.batch_size,
        rounds_per_epoch=rounds,
        seed=seed,
    )  # fmt: skip
    settings = {
        "client_optimizer": config.client_lr,
        "head_lr_scale": config.head_lr_scale,
        **args,
    }
    model = _silenced(FedEmbModel, _backbone(config, seed), seed=seed, **settings)
    model.compile(optimizer=server or keras.optimizers.Adam(config.server_lr))
    model.fit(clients, epochs=1, verbose=0)
    return model, clients


def _evaluation(config):
    first = config.eval_first_identity
    if first < max(config.identities, config.dp_identities):
        raise ValueError("the held-out identities must not be training identities")
    return _identities(config, config.eval_identities, config.eval_images, first)[:2]


def _record(figures, name, backbone, evaluation):
    for far, value in zip(FARS, _recalls(backbone, evaluation), strict=True):
        figures[f"{name} recall@far={far:.0e}".replace("e-0", "e-")] = value


def non_private(config, evaluation=None):
    """Untrained, centralized and non-private FedEmb Recall@FAR=1e-3."""
    evaluation = evaluation or _evaluation(config)
    train = _identities(config, config.identities, config.images_per_identity)
    figures = {}
    _record(figures, "untrained", _backbone(config, 0), evaluation)

    centralized = CentralizedBaseline(_backbone(config, 0), config.identities)
    centralized.compile(
        optimizer=keras.optimizers.Adam(config.centralized_lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    _, seconds = timed(
        centralized.fit,
        train[0],
        train[1],
        batch_size=config.centralized_batch,
        epochs=config.centralized_epochs,
        verbose=0,
    )
    _record(figures, "centralized", centralized.backbone, evaluation)
    figures["centralized examples"] = config.centralized_examples
    figures["centralized seconds"] = seconds

    (model, _), seconds = timed(
        _fedemb,
        config,
        train,
        seed=0,
        clients_per_round=config.clients_per_round,
        rounds=config.rounds,
        clip_norm=1e9,
        noise_multiplier=0.0,
    )
    _record(figures, "non-private FedEmb", model.backbone, evaluation)
    figures["non-private FedEmb examples (expected)"] = (
        config.rounds * config.examples_per_round
    )
    figures["non-private FedEmb rounds"] = config.rounds
    figures["non-private FedEmb seconds"] = seconds
    figures["gap: centralized - non-private FedEmb"] = (
        figures["centralized recall@far=1e-3"]
        - figures["non-private FedEmb recall@far=1e-3"]
    )
    return figures


def dp_run(config, seed, aggregation, evaluation=None):
    """One DP-FedEmb ("partial") or DP-FedAvg ("full") run: recall and ε."""
    evaluation = evaluation or _evaluation(config)
    train = _identities(config, config.dp_identities, config.dp_images_per_identity)
    (model, clients), seconds = timed(
        _fedemb,
        config,
        train,
        seed=seed,
        clients_per_round=config.dp_clients_per_round,
        rounds=config.dp_rounds,
        aggregation=aggregation,
        num_classes=config.dp_identities if aggregation == "full" else None,
        clip_norm=config.clip_norm,
        noise_multiplier=config.noise_multiplier,
    )
    delta = 0.1 / clients.num_users
    recall, recall_1e2 = _recalls(model.backbone, evaluation)
    untrained, untrained_1e2 = _recalls(_backbone(config, seed), evaluation)
    return {
        "recall": recall,
        "untrained recall": untrained,
        "recall@far=1e-2": recall_1e2,
        "untrained recall@far=1e-2": untrained_1e2,
        "epsilon": model.privacy_statement(delta).epsilon,
        "delta": delta,
        "users": clients.num_users,
        "seconds": seconds,
    }


METHODS = {"DP-FedEmb": "partial", "DP-FedAvg": "full"}


def dp_comparison(config, evaluation=None):
    """DP-FedEmb against DP-FedAvg over `config.seeds`."""
    evaluation = evaluation or _evaluation(config)
    runs = {
        (name, seed): dp_run(config, seed, aggregation, evaluation)
        for seed in config.seeds
        for name, aggregation in METHODS.items()
    }
    return summarize_dp(config, runs)


def summarize_dp(config, runs):
    """Figures from `{(method, seed): dp_run(...)}`."""
    figures = {}
    for (name, seed), run in sorted(runs.items()):
        figures[f"{name} seed {seed} recall@far=1e-3"] = run["recall"]
    untrained = [runs[("DP-FedEmb", seed)]["untrained recall"] for seed in config.seeds]
    figures["DP untrained recall@far=1e-3 mean"] = statistics.fmean(untrained)
    figures["DP untrained recall@far=1e-2 mean"] = statistics.fmean(
        runs[("DP-FedEmb", seed)]["untrained recall@far=1e-2"] for seed in config.seeds
    )
    for name in METHODS:
        values = [runs[(name, seed)]["recall"] for seed in config.seeds]
        figures[f"{name} recall@far=1e-3 mean"] = statistics.fmean(values)
        figures[f"{name} recall@far=1e-3 std"] = (
            statistics.stdev(values) if len(values) > 1 else 0.0
        )
        figures[f"{name} recall@far=1e-2 mean"] = statistics.fmean(
            runs[(name, seed)]["recall@far=1e-2"] for seed in config.seeds
        )
        figures[f"{name} seconds per run"] = statistics.fmean(
            runs[(name, seed)]["seconds"] for seed in config.seeds
        )
    first = runs[("DP-FedEmb", config.seeds[0])]
    figures["DP epsilon"] = first["epsilon"]
    figures["DP delta"] = first["delta"]
    figures["DP users"] = first["users"]
    figures["DP rounds"] = config.dp_rounds
    figures["DP noise multiplier"] = config.noise_multiplier
    figures["DP clip norm"] = config.clip_norm
    return figures


def utility(quick=False, config=None):
    """Both comparisons; see the module docstring."""
    config = config or (QUICK_UTILITY if quick else UtilityConfig())
    evaluation = _evaluation(config)
    figures = {
        **non_private(config, evaluation),
        **dp_comparison(config, evaluation),
    }
    return {
        "figures": figures,
        "ratios": {
            "non-private FedEmb / centralized recall": _ratio(
                figures["non-private FedEmb recall@far=1e-3"],
                figures["centralized recall@far=1e-3"],
            ),
            "DP-FedEmb / DP-FedAvg recall": _ratio(
                figures["DP-FedEmb recall@far=1e-3 mean"],
                figures["DP-FedAvg recall@far=1e-3 mean"],
            ),
        },
        "config": dataclasses.asdict(config),
    }


def _ratio(a, b):
    return a / b if b else math.inf


@dataclasses.dataclass(frozen=True)
class SpeedConfig:
    """Sizes of the speed runs (M, S, B and the backbone)."""

    clients_per_round: int = 8
    local_steps: int = 4
    batch_size: int = 32
    image_size: int = 32
    width: int = 8
    groups: int = 4
    embedding_dim: int = 32
    rounds: int = 3
    repeats: int = 3
    gpu_clients_per_round: int = 64


QUICK_SPEED = SpeedConfig(
    clients_per_round=2,
    local_steps=2,
    batch_size=4,
    image_size=16,
    width=4,
    groups=2,
    embedding_dim=8,
    rounds=1,
    repeats=1,
    gpu_clients_per_round=4,
)


class _SameRound(keras.utils.PyDataset):
    """The same prepared element, `length` times (only the step counts)."""

    def __init__(self, element, length):
        super().__init__()
        self.element, self.length = element, length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.element


def _full_round(config, clients_per_round, seed=0):
    """A round in which every one of M clients fills S batches of B."""
    steps, batch = config.local_steps, config.batch_size
    per_user = steps * batch  # One user of 4 identities fills a client.
    data = synthetic_identities(
        4 * clients_per_round,
        per_user // 4 + 1,
        image_size=config.image_size,
        seed=seed,
        identities_per_user=4,
    )
    clients = _silenced(
        VirtualClients,
        np.asarray(data.images), data.labels, data.user_ids,
        clients_per_round=clients_per_round,
        sampling="fixed",
        local_steps=steps,
        batch_size=batch,
        seed=seed,
    )  # fmt: skip
    element = clients.round(0)
    assert element["example_mask"].all(), "every slot of the round is filled"
    return clients, element


def _round_against_centralized(config, clients_per_round, parallelism, batch):
    """Seconds per round and per M·S·B examples of centralized training."""
    clients, element = _full_round(config, clients_per_round)
    shape = (config.image_size, config.image_size, 3)

    def backbone():
        keras.utils.set_random_seed(0)
        return small_cnn(shape, config.embedding_dim, config.width, config.groups)

    fedemb = _silenced(
        FedEmbModel,
        backbone(),
        clip_norm=1.0,
        noise_multiplier=1.0,
        schedule=clients.schedule,  # The rounds below are copies of one.
        client_parallelism=parallelism,
        seed=0,
    )
    fedemb.compile()
    rounds = _SameRound(element, config.rounds)
    images = element["images"].reshape(-1, *shape)
    labels = element["global_labels"].reshape(-1)
    centralized = CentralizedBaseline(backbone(), clients.num_classes)
    centralized.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    images = np.concatenate([images] * config.rounds)
    labels = np.concatenate([labels] * config.rounds)
    # Warm-up: tracing and compilation.
    time_fit(fedemb, _SameRound(element, 1))
    time_fit(centralized, images[:batch], y=labels[:batch], batch_size=batch)
    fed, central = [], []
    for _ in range(config.repeats):
        fed.append(time_fit(fedemb, rounds) / config.rounds)
        central.append(
            time_fit(centralized, images, y=labels, batch_size=batch, shuffle=False)
            / config.rounds
        )
    examples = element["example_mask"].sum()
    return statistics.median(fed), statistics.median(central), int(examples)


def speed(quick=False, config=None):
    """Time of a round against the same work as centralized steps."""
    config = config or (QUICK_SPEED if quick else SpeedConfig())
    m, s, b = config.clients_per_round, config.local_steps, config.batch_size
    cpu_ratio = "CPU: round time / centralized time (goal <= 1.2)"
    gpu_ratio = "GPU: round / centralized examples/s (goal >= 0.5)"
    figures, ratios = {}, {}
    if gpu_available():
        figures["CPU"] = ratios[cpu_ratio] = "skipped: the backend runs on a GPU"
        m = config.gpu_clients_per_round
        round_s, central_s, examples = _round_against_centralized(
            config, m, parallelism="all", batch=m * b
        )
        figures[f"GPU: round of {m} clients x {s} x {b} (examples/s)"] = (
            examples / round_s
        )
        figures[f"GPU: centralized at batch {m * b} (examples/s)"] = (
            examples / central_s
        )
        ratios[gpu_ratio] = central_s / round_s
    else:
        round_s, central_s, examples = _round_against_centralized(
            config, m, parallelism=1, batch=b
        )
        figures[f"CPU: round of {m} clients x {s} steps x {b} (s)"] = round_s
        figures[f"CPU: {m * s} centralized steps at batch {b} (s)"] = central_s
        figures["CPU: examples per round"] = examples
        ratios[cpu_ratio] = round_s / central_s
        figures["GPU"] = ratios[gpu_ratio] = "no GPU"
    return {"figures": figures, "ratios": ratios, "config": dataclasses.asdict(config)}


def run(quick=False):
    """Both parts; see the module docstring."""
    speed_result = speed(quick)
    utility_result = utility(quick)
    return {
        "figures": {**utility_result["figures"], **speed_result["figures"]},
        "ratios": {**utility_result["ratios"], **speed_result["ratios"]},
        "config": {
            "utility": utility_result["config"],
            "speed": speed_result["config"],
        },
    }


def defaults(quick=False, config=None, rounds=None):
    """Non-private FedEmb: server optimizers against head learning-rate scales.

    FedEmbModel's defaults are head_lr_scale=100 (client SGD(0.01) in every
    run) and, since 0.2, the server Adam(3e-3) (compile's default, which
    was SGD(1.0, momentum=0.9) before); the benchmark's own runs use a
    server Adam(3e-3).
    """
    config = config or (QUICK_UTILITY if quick else UtilityConfig())
    rounds = rounds or config.rounds
    evaluation = _evaluation(config)
    train = _identities(config, config.identities, config.images_per_identity)
    figures = {}
    _record(figures, "untrained", _backbone(config, 0), evaluation)
    servers = {
        "SGD(1.0, momentum=0.9)": lambda: keras.optimizers.SGD(1.0, momentum=0.9),
        "Adam(1e-3)": lambda: keras.optimizers.Adam(1e-3),
        "Adam(3e-3)": lambda: keras.optimizers.Adam(3e-3),
    }
    for server, optimizer in servers.items():
        for head_lr_scale in (10.0, 100.0):
            model, _ = _fedemb(
                config,
                train,
                seed=0,
                clients_per_round=config.clients_per_round,
                rounds=rounds,
                server=optimizer(),
                client_optimizer=0.01,
                head_lr_scale=head_lr_scale,
                clip_norm=1e9,
                noise_multiplier=0.0,
            )
            key = f"server {server}, head_lr_scale {head_lr_scale:g}:"
            _record(figures, key, model.backbone, evaluation)
    figures["rounds"] = rounds
    return {"figures": figures, "ratios": {}, "config": dataclasses.asdict(config)}


def main(argv=None):
    """`python -m benchmarks.fedemb PART [--quick]`, one part as JSON.

    PART: all, utility, speed, non-private, defaults, or `dp SEED
    {partial,full}` (one DP run, for splitting the DP comparison).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    quick = "--quick" in args
    args = [a for a in args if a != "--quick"]
    config = QUICK_UTILITY if quick else UtilityConfig()
    parts = {
        "all": lambda: run(quick),
        "utility": lambda: utility(quick),
        "speed": lambda: speed(quick),
        "non-private": lambda: non_private(config),
        "defaults": lambda: defaults(quick),
    }
    if args and args[0] == "dp" and len(args) == 3:
        result = dp_run(config, int(args[1]), args[2])
    elif len(args) == 1 and args[0] in parts:
        result = parts[args[0]]()
    else:
        print(main.__doc__)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

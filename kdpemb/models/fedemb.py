"""`FedEmbModel`: DP-FedEmb and DP-FedAvg as a `keras.Model`.

One `train_step` is one round: the round's virtual clients train locally
(`fedemb_round`), their updates are clipped and summed, Gaussian noise is
added once, and the server optimizer applies the noisy mean update to the
backbone.
"""

import contextlib
import math
import numbers
import warnings

import keras
from keras import ops

from kdpemb import _validation as validation
from kdpemb import distribute, privacy
from kdpemb.datasets import inputs
from kdpemb.errors import (
    DataDependentScheduleWarning,
    HostsDisagreeError,
    PrivacyBudgetExhaustedError,
    RoundsOutOfEpochError,
)
from kdpemb.models import (
    backbone_checks,
    backends,
    fedemb_round,
    heads,
    multi_host,
    privacy_plan,
    private_state,
)
from kdpemb.models.frozen_settings import FrozenSettings
from kdpemb.models.optimizer_restore import RestoresOptimizer
from kdpemb.privacy import (
    AdaptiveClipping,
    Schedule,
    gaussian_sum,
    protocol,
    quantile_clip,
    tree_noise,
)
from kdpemb.privacy.schedule import NOISES

AGGREGATIONS = ("partial", "full")
_FROZEN_SETTINGS = frozenset(
    {
        "aggregation",
        "num_classes",
        "client_optimizer",
        "head_lr_scale",
        "head_init",
        "head_type",  # The `head` argument (`model.head` is DP-FedAvg's head).
        "head_scale",
        "head_margin",
        "reconstruction_steps",
        "clip_norm",
        "noise_multiplier",
        "delta",
        "client_parallelism",
        "seed",
        "backbone",
        "embedding_dim",
        "log_local_loss",
        "log_nonfinite_updates",
        "target_epsilon",
        "planned_steps",
        "calibrated_noise_multiplier",
        "adaptive_clipping",
        "noise",
        "tree_estimator",
    }
)
HEAD_INITS = ("zeros", "random")


def _client_sgd(client_optimizer):
    """`(learning_rate, momentum, nesterov)` of the client optimizer."""
    if isinstance(client_optimizer, dict):
        client_optimizer = keras.optimizers.SGD(**client_optimizer)
    if isinstance(client_optimizer, numbers.Real) and not isinstance(
        client_optimizer, bool
    ):
        client_optimizer = keras.optimizers.SGD(float(client_optimizer))
    if type(client_optimizer) is not keras.optimizers.SGD:
        raise ValueError(
            "client_optimizer must be a learning rate (float) or a "
            "keras.optimizers.SGD (with optional momentum and nesterov); got "
            f"{client_optimizer!r}. Local optimizer state lives only inside "
            "one client's local steps, where kdpemb runs SGD itself; use any "
            "Keras optimizer as the server optimizer in compile()."
        )
    ignored = {
        name: getattr(client_optimizer, name, None)
        for name in ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm")
        if getattr(client_optimizer, name, None)
    }
    if client_optimizer.use_ema:
        ignored["use_ema"] = True
    if client_optimizer.gradient_accumulation_steps:
        ignored["gradient_accumulation_steps"] = (
            client_optimizer.gradient_accumulation_steps
        )
    if ignored:
        raise ValueError(
            f"client_optimizer sets {ignored}, which local SGD does not "
            "implement; use SGD(learning_rate, momentum=..., nesterov=...) only."
        )
    learning_rate = client_optimizer.learning_rate
    if isinstance(
        client_optimizer._learning_rate,
        keras.optimizers.schedules.LearningRateSchedule,
    ):
        raise ValueError(
            "client_optimizer must have a constant learning rate; schedule the "
            "server optimizer instead."
        )
    learning_rate = float(ops.convert_to_numpy(learning_rate))
    momentum = float(client_optimizer.momentum)
    if learning_rate <= 0 or not 0 <= momentum < 1:
        raise ValueError(
            f"client_optimizer needs learning_rate > 0 and 0 <= momentum < 1, "
            f"got learning_rate={learning_rate}, momentum={momentum}."
        )
    return learning_rate, momentum, bool(client_optimizer.nesterov)


def _default_parallelism():
    if keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() in ("gpu", "tpu"):
            return "all"
        if keras.distribution.distribution() is not None:
            return "all"
    return 1


@keras.saving.register_keras_serializable(package="kdpemb")
class FedEmbModel(RestoresOptimizer, FrozenSettings, keras.Model):
    """An embedding backbone trained with user-level DP-FedEmb or DP-FedAvg.

    Train it on `kdpemb.data.VirtualClients` rounds: each `train_step` is
    one round. Every sampled virtual client trains a copy of the backbone
    and a softmax head on its own examples for the schedule's
    `local_steps` batches; its backbone update Δ (θ_local − θ) is clipped
    to L2 norm `clip_norm` (non-finite updates become zeros); the clipped
    updates of all clients on all devices are summed; N(0, (z·C)²) is
    added once; the sum is divided by the expected number of clients M;
    and the server optimizer applies −(noisy mean) as a gradient.

    - `aggregation="partial"` (DP-FedEmb): each client's head has one
      column per identity it holds, starts from zeros (or random) every
      round, and is thrown away. Only the backbone is shared.
    - `aggregation="full"` (DP-FedAvg): the head is a global
      `[embedding_dim, num_classes]` variable, trained locally, and
      clipped, noised and aggregated with the backbone.
    - `noise_multiplier=0` with a huge `clip_norm` is non-private
      federated training.

    Who is sampled, and how often, is the `kdpemb.privacy.Schedule` in
    `model.schedule`: the `VirtualClients`' own `clients.schedule`, taken
    at the first `fit` on them (or given as `schedule=`, which a fit on a
    `tf.data.Dataset` of rounds needs). It is set once: a later fit on
    rounds of another schedule is refused. The privacy unit is the user:
    see `privacy_mechanism()` and `privacy_statement()`. `model.backbone`
    is the embedding model to export; `model.save` keeps the backbone,
    the head, the server optimizer, the schedule and `private_steps`, so a
    loaded model keeps counting.

    Logs: `private_steps` only, unless you opt in to `local_loss` or
    `nonfinite_updates`, which are computed from private data without
    noise and are not covered by the guarantee.

    Every setting is fixed at construction (assigning one raises): the
    traced round and the accounting of past rounds depend on it. Layers
    with random state in the backbone (Dropout, random augmentation) draw
    the same values at every local step, since the backbone's state is
    never updated from training.

    Args:
        backbone: `keras.Model` from images to embeddings `[batch, D]`,
            built (give it a `keras.Input`). It receives images as float32
            in their stored range (0-255 for uint8 data): put a
            `Rescaling` layer first. Trainable BatchNormalization is
            refused (use GroupNormalization, or freeze it).
        embedding_dim: int or None. If the backbone's output dimension
            differs, a `Dense(embedding_dim)` projection is appended to the
            backbone. Defaults to the backbone's output dimension.
        aggregation: "partial" (DP-FedEmb, default) or "full" (DP-FedAvg).
        num_classes: int. Global identities, for `aggregation="full"`.
        client_optimizer: float or `keras.optimizers.SGD`. Local SGD
            (learning rate, momentum, nesterov). Defaults to `SGD(0.01)`.
        head_lr_scale: float. The head's local learning rate is the
            client's times this. Defaults to `100`, the reference code's value.
        head_init: "zeros", "random" or None (the default: "zeros" for
            the softmax head, "random" for the cosine head). DP-FedEmb: a
            local head starts at zeros or from N(0, 1/D), fresh per client
            and round. DP-FedAvg: the global head's initial value (a
            data-independent draw).
        head: "softmax" (default): local logits `e · W`; or "cosine":
            `s · normalize(e) · normalize(W)`, a normalised softmax that
            often learns better embeddings. A cosine head needs
            `head_init="random"`: a zero column has no direction.
        head_scale: float. s, the bound on the cosine logits. Defaults to 16.
        head_margin: float in [0, 1). Additive cosine margin (CosFace) on
            the true class in the local loss; cosine head only. Defaults
            to 0.
        reconstruction_steps: int. First local batches that train only
            the head, backbone frozen. Must be below the schedule's
            `local_steps`.
        clip_norm: float. C (the initial C with `adaptive_clipping`).
        noise_multiplier: float. z (0 for no noise). Give this or
            `target_epsilon`; with `target_epsilon` it is the calibrated z
            (None until the first fit).
        schedule: `kdpemb.privacy.Schedule` or None. The rounds' schedule
            (`clients.schedule`, or `Schedule.virtual_clients(...)`). None
            (the default) takes it from the `VirtualClients` of the first
            `fit`.
        delta: float or None. The δ of `privacy_statement()` (and of
            `kdpemb.callbacks.PrivacyBudget`) when they are not given one;
            below 1 / (number of users).
        client_parallelism: int, "all" or None. Clients trained at once
            (vectorised); 1 trains them one after another, so peak memory
            does not grow with M. None picks "all" on a JAX GPU/TPU or
            under `keras.distribution`, else 1.
        seed: int or None. Seed of the noise and random heads. None (the
            default) draws it from OS entropy; a fixed seed makes the noise
            predictable and warns (tests only).
        log_local_loss: bool. Log the clients' mean local training loss as
            `local_loss`. Computed on private data without noise: not
            covered by the guarantee. Defaults to False.
        log_nonfinite_updates: bool. Log `nonfinite_updates`, the round's
            count of sampled clients whose update was non-finite (and
            zeroed), to debug divergence. Computed on private data without
            noise (one user's extreme pixel can flip it): not covered by
            the guarantee. Defaults to False.
        target_epsilon: float or None. Instead of `noise_multiplier`:
            the first `fit` calibrates the smallest z that keeps the
            planned rounds within (target_epsilon, delta)-DP (needs
            `delta`), prints it unless `verbose=0`, and sets
            `noise_multiplier`. Every later fit may only take the planned
            rounds not yet taken: one that would go past them is refused
            before any round (`PrivacyBudgetExhaustedError`), also when a
            callback restores a checkpoint as training begins; a round
            past the plan is never run on the data. Saved with the model,
            with the plan.
        planned_steps: int or None. The rounds `target_epsilon` is spent
            over. None (the default) plans the first fit's rounds
            (epochs × rounds per epoch, with `steps_per_execution` k
            ceil(steps_per_epoch / k) · k per epoch); give it to train
            over several fits.
        calibrated_noise_multiplier: set by the first fit and saved with
            the model. Pass it (with the saved `planned_steps`) only to
            resume from weights (`load_weights`) of rounds taken: the
            first fit checks that it meets the target over
            `planned_steps`.
        adaptive_clipping: `kdpemb.privacy.AdaptiveClipping` or None.
            Adaptive quantile clipping (Andrew et al. 2021): `clip_norm` is
            the initial C, and every round moves C (the model variable
            `current_clip_norm`, logged as `clip_norm`) towards the
            `target_quantile` of the sampled clients' update norms, from
            their count within C plus Gaussian noise σ_b. The round's
            noise is z · (its C). The count costs privacy: the round is
            accounted as one Gaussian of multiplier
            z_eff = (z⁻² + (2σ_b)⁻²)^(-1/2) < z (`privacy_mechanism()`);
            with `target_epsilon` it is z_eff that is calibrated.
        noise: "independent" (default): fresh N(0, (zC)²) every round; or
            "tree": DP-FTRL (Kairouz et al. 2021). Rounds need a schedule
            without sampling (`VirtualClients(..., sampling="epochs")`:
            every user in at most one round per epoch), and the noise is
            correlated across rounds through a binary tree over each
            epoch's rounds (restarted every epoch): round j adds the
            difference of the tree's noisy prefix sums, so after j rounds
            the model has moved by a noisy prefix sum whose noise is the
            sum of about log2(j) node draws. The open nodes' noise is model
            state (`tree_open_noise`, levels × the model's size), saved and
            restored with the model: a saved `FedEmbModel` holds noise that
            later rounds subtract, so keep it as private as the data
            (export `model.backbone`). Accounting:
            `kdpemb.privacy.TreeAggregation` (RDP and zCDP ρ).
        tree_estimator: "standard" (default) or "efficient": Honaker's
            estimator, which combines every released tree node for a
            lower-variance prefix sum at no privacy cost (it draws
            floor(log2 R) + 1 noise tensors per round instead of one).
            `noise="tree"` only.

    Example:

    >>> import keras
    >>> from kdpemb.models import FedEmbModel, small_cnn
    >>> from kdpemb.privacy import Schedule
    >>> schedule = Schedule.virtual_clients(40, clients_per_round=4,
    ...                                     users_per_client=2, num_clients=20,
    ...                                     local_steps=2)
    >>> model = FedEmbModel(small_cnn((16, 16, 3), embedding_dim=8),
    ...                     clip_norm=1.0, noise_multiplier=1.0,
    ...                     schedule=schedule, delta=1e-3)
    >>> model.compile()
    >>> model.privacy_mechanism().unit
    'user'
    >>> model.privacy_statement().delta
    0.001
    """

    _FROZEN_SETTINGS = _FROZEN_SETTINGS

    def __init__(
        self,
        backbone,
        embedding_dim=None,
        *,
        aggregation="partial",
        num_classes=None,
        client_optimizer=0.01,
        head_lr_scale=100.0,
        head_init=None,
        head="softmax",
        head_scale=heads.DEFAULT_SCALE,
        head_margin=0.0,
        reconstruction_steps=0,
        clip_norm=1.0,
        noise_multiplier=None,
        schedule=None,
        delta=None,
        client_parallelism=None,
        seed=None,
        log_local_loss=False,
        log_nonfinite_updates=False,
        target_epsilon=None,
        planned_steps=None,
        calibrated_noise_multiplier=None,
        adaptive_clipping=None,
        noise="independent",
        tree_estimator="standard",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(noise, str) or noise not in NOISES:
            raise ValueError(f"noise must be one of {NOISES}, got {noise!r}.")
        if (
            not isinstance(tree_estimator, str)
            or tree_estimator not in tree_noise.ESTIMATORS
        ):
            raise ValueError(
                f"tree_estimator must be one of {tree_noise.ESTIMATORS}, got "
                f"{tree_estimator!r}."
            )
        if noise != "tree" and tree_estimator != "standard":
            raise ValueError(
                f"tree_estimator={tree_estimator!r} is for noise='tree' only."
            )
        if noise == "tree" and adaptive_clipping is not None:
            raise ValueError(
                "noise='tree' adds to each round the noise of tree nodes drawn "
                "in earlier rounds at their clip norm; adaptive clipping changes "
                "C every round, so the nodes would not share one scale. Use a "
                "fixed clip_norm with noise='tree'."
            )
        self.noise = noise
        self.tree_estimator = tree_estimator
        self.tree_open_noise = None
        if not isinstance(aggregation, str) or aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}."
            )
        head, head_scale, head_margin = validation.check_head(
            head, head_scale, head_margin
        )
        if head_init is None:
            head_init = "random" if head == "cosine" else "zeros"
        if not isinstance(head_init, str) or head_init not in HEAD_INITS:
            raise ValueError(
                f"head_init must be one of {HEAD_INITS}, got {head_init!r}."
            )
        if head == "cosine" and head_init != "random":
            raise ValueError(
                "head='cosine' normalises the head's columns, and a zero column "
                "has no direction (its cosine logits would be 0/0): pass "
                "head_init='random' (or leave head_init=None)."
            )
        self.head_type, self.head_scale, self.head_margin = (
            head,
            head_scale,
            head_margin,
        )
        self.aggregation = aggregation
        self.head_init = head_init
        if (
            not isinstance(reconstruction_steps, numbers.Integral)
            or isinstance(reconstruction_steps, bool)
            or reconstruction_steps < 0
        ):
            raise ValueError(
                f"reconstruction_steps must be an int >= 0, got "
                f"{reconstruction_steps!r}."
            )
        self.reconstruction_steps = int(reconstruction_steps)
        self.client_optimizer = _client_sgd(client_optimizer)
        self.head_lr_scale = validation.check_positive(head_lr_scale, "head_lr_scale")
        self.clip_norm = validation.check_positive(clip_norm, "clip_norm")
        self.delta = None if delta is None else validation.check_delta(delta)
        (
            self.noise_multiplier,
            self.target_epsilon,
            self.planned_steps,
            self.calibrated_noise_multiplier,
        ) = privacy_plan.check_settings(
            noise_multiplier,
            target_epsilon,
            self.delta,
            planned_steps,
            calibrated_noise_multiplier,
        )
        if client_parallelism not in (None, "all"):
            client_parallelism = validation.check_positive_int(
                client_parallelism, "client_parallelism"
            )
        self.client_parallelism = client_parallelism
        self.log_local_loss = validation.check_bool(log_local_loss, "log_local_loss")
        self.log_nonfinite_updates = validation.check_bool(
            log_nonfinite_updates, "log_nonfinite_updates"
        )
        self._schedule = None
        if schedule is not None:
            self._adopt_schedule(_as_schedule(schedule))

        if embedding_dim is not None:
            embedding_dim = validation.check_positive_int(
                embedding_dim,
                "embedding_dim",
                "It is the width of the embedding (None: the backbone's output).",
            )
        if num_classes is not None:
            num_classes = validation.check_positive_int(num_classes, "num_classes")
        backbone_checks.check_backbone(backbone)
        output_dim = _output_dim(backbone)
        if embedding_dim is not None and embedding_dim != output_dim:
            backbone = keras.Sequential(
                [backbone, keras.layers.Dense(int(embedding_dim), name="projection")],
                name=f"{backbone.name}_embedding",
            )
            backbone.build(_input_shape(backbone.layers[0]))
            output_dim = int(embedding_dim)
        self.backbone = backbone
        self.embedding_dim = output_dim

        if aggregation == "full":
            if num_classes is None:
                raise ValueError(
                    "aggregation='full' (DP-FedAvg) trains a global head: pass "
                    "num_classes, the number of identities in the training data."
                )
            self.num_classes = validation.check_positive_int(num_classes, "num_classes")
            self.head = self.add_weight(
                shape=(output_dim, self.num_classes),
                initializer=(
                    "zeros"
                    if head_init == "zeros"
                    else keras.initializers.RandomNormal(stddev=output_dim**-0.5)
                ),
                name="head",
            )
        else:
            self.num_classes = None if num_classes is None else int(num_classes)
            self.head = None

        self.private_steps = private_state.add_private_steps(self)
        self._head_columns = None
        self.seed = seed
        self.adaptive_clipping = (
            None
            if adaptive_clipping is None
            else AdaptiveClipping.from_config(adaptive_clipping)
        )
        names = ("noise_seed", "head_seed")
        if self.adaptive_clipping is not None:
            # C is model state: saved, restored, and moved by every round.
            self.current_clip_norm = private_state.add_state(
                self, "current_clip_norm", initializer=self.clip_norm
            )
            names += ("count_seed",)  # The count's noise: its own stream.
        generators = private_state.noise_seed_generators(seed, names, "FedEmbModel")
        self.noise_seed, self.head_seed = generators[:2]
        if self.adaptive_clipping is not None:
            self.count_seed = generators[2]
        if self._schedule is not None:
            self._build_tree_state()
            self._build_epoch_state()
        self.built = True
        self._freeze_settings()

    def _reseed(self, hosts):
        # With seed=None the noise comes from OS entropy, drawn afresh at
        # construction and at every fit, so no generator state anyone has
        # seen (a copied model, a checkpoint) predicts later noise. On
        # several hosts it is the chief's entropy, the same everywhere.
        generators = [self.noise_seed, self.head_seed]
        if self.adaptive_clipping is not None:
            generators.append(self.count_seed)
        private_state.reseed(generators, self.seed, randbits=hosts.shared_bits)

    # ------------------------------------------------------- schedule --

    @property
    def schedule(self):
        """The `kdpemb.privacy.Schedule` of the rounds; None until known."""
        return self._schedule

    @schedule.setter
    def schedule(self, value):
        raise AttributeError(
            "FedEmbModel.schedule is set once: give it as "
            "FedEmbModel(..., schedule=...) or let the first fit on a "
            "VirtualClients take clients.schedule. The accounting of past "
            "rounds depends on it; build a new FedEmbModel for another one."
        )

    def _adopt_schedule(self, schedule):
        """Sets the schedule (once), after the checks that need it."""
        steps_taken = (
            protocol.read_private_steps(self) if hasattr(self, "private_steps") else 0
        )
        if self._schedule is None and steps_taken:
            raise ValueError(
                f"This FedEmbModel has taken {steps_taken} "
                "private steps but has no schedule (weights loaded into a model "
                "built without one): the schedule of those steps cannot be "
                "guessed from the data. Build it with FedEmbModel(..., "
                "schedule=<the schedule of those steps>), or load the whole "
                "model with keras.saving.load_model."
            )
        if self._schedule is not None:
            if schedule != self._schedule:
                raise ValueError(
                    "The rounds are sampled with another schedule than the "
                    "model's, so its privacy accounting would be wrong "
                    f"({_schedule_differences(self._schedule, schedule)}). "
                    f"Model: {self._schedule}. Rounds: {schedule}. Fit it on "
                    "rounds of the model's schedule, or build a new "
                    "FedEmbModel for these."
                )
            return
        if not self.reconstruction_steps < schedule.local_steps:
            raise ValueError(
                f"reconstruction_steps={self.reconstruction_steps} must be in "
                f"[0, local_steps={schedule.local_steps}) of the schedule: "
                "with every step frozen the backbone would never change."
            )
        if self.delta is not None:
            validation.check_delta(self.delta, schedule.population, schedule.unit)
        # Checks that noise and sampling go together.
        schedule.privacy_mechanism(0.0, noise=self.noise)
        self._schedule = schedule
        if hasattr(self, "private_steps"):  # Built: else __init__ builds it.
            # At a fit under a tf.distribute strategy: its variables, like
            # the model's, are created in its scope.
            strategy = getattr(self, "_distribute_strategy", None)
            with strategy.scope() if strategy else contextlib.nullcontext():
                self._build_tree_state()
                self._build_epoch_state()

    def _noised_variables(self):
        """The variables whose update is clipped, noised and applied."""
        variables = list(self.backbone.trainable_variables)
        if self.aggregation == "full":
            variables.append(self.head)
        return variables

    def _build_epoch_state(self):
        """Rounds without sampling: the layout id of the model's current
        epoch of rounds (-1: none yet), which of its rounds were taken, and
        a count of rounds refused because they did not belong to it (see
        `_epoch_aligned`)."""
        if self._schedule.sampling != "epochs" or hasattr(self, "data_epoch"):
            return
        self.data_epoch = private_state.add_state(
            self, "data_epoch", dtype="int32", initializer=-1
        )
        self.epoch_rounds_taken = private_state.add_state(
            self,
            "epoch_rounds_taken",
            shape=(self._schedule.steps_per_epoch,),
            dtype="int32",
        )
        self.misaligned_rounds = private_state.add_state(
            self, "misaligned_rounds", dtype="int32"
        )

    def _build_tree_state(self):
        """With `noise="tree"`: the open tree nodes' noise, one
        `[levels, *shape]` variable per noised variable (zeros: none open)."""
        if self.noise != "tree" or self.tree_open_noise is not None:
            return
        levels = tree_noise.tree_levels(self._schedule.steps_per_epoch)
        self.tree_open_noise = [
            private_state.add_state(
                self, f"tree_open_noise_{index}", shape=(levels, *variable.shape)
            )
            for index, variable in enumerate(self._noised_variables())
        ]

    # -------------------------------------------------------- privacy --

    def privacy_mechanism(self):
        """The user-level mechanism of one round (`kdpemb.privacy`)."""
        schedule = self._known_schedule()
        if self.noise_multiplier is None:
            raise ValueError(
                f"The noise for target_epsilon={self.target_epsilon} is "
                "calibrated at the first fit, over the rounds it plans: fit "
                "the model first."
            )
        if self.adaptive_clipping is None:
            return schedule.privacy_mechanism(
                self.noise_multiplier, self.clip_norm, noise=self.noise
            )
        # The update sum and the count are one Gaussian of multiplier z_eff;
        # C changes every round, so the statement names none.
        return schedule.privacy_mechanism(
            self.adaptive_clipping.effective_noise_multiplier(
                self.noise_multiplier, schedule.sample_size
            )
        )

    def privacy_statement(self, delta=None, accountant=None):
        """The `PrivacyStatement` (unit: user) of the rounds taken so far.

        Args:
            delta: float or None. Defaults to the model's `delta`.
            accountant: str or None. "pld" or "rdp"; None (default):
                "pld" where it models the mechanism, else "rdp".
        """
        return protocol.privacy_statement(self, delta, accountant)

    def ledger_resume_steps(self, counted):
        """The rounds to resume from when `kdpemb.callbacks.PrivacyLedger`
        counted `counted` begun before a crash: `counted`; with rounds
        without sampling (`sampling="epochs"`), the next multiple of the
        epoch's R rounds. Their accounting (and the tree noise) counts
        whole epochs, in each of which a user takes part once; the killed
        epoch's rounds released part of one, and the resumed run starts a
        new one (a user takes part again), so the killed epoch counts as a
        whole one. Never fewer rounds than `counted`."""
        schedule = self._known_schedule()
        if schedule.sampling != "epochs":
            return counted
        rounds = schedule.steps_per_epoch
        return -(-counted // rounds) * rounds

    def simulated_deployment(
        self,
        scale,
        deployment_users,
        delta=None,
        deployment_clients=None,
        accountant="pld",
    ):
        """The guarantee of a *simulated deployment* of these rounds.

        A deployment with noise s·z and s·M clients per round over
        `deployment_users` users has the same noise std in the mean update
        as this run (z, M), so, for a large enough population, the same
        utility. Returns `kdpemb.privacy.DeploymentStatement` for the
        rounds taken so far (with adaptive clipping, z is the effective
        multiplier of update and count). It is an extrapolation, never
        this run's guarantee: that is `privacy_statement()`.

        Args:
            scale: float >= 1. s.
            deployment_users: int. Users of the deployment.
            delta: float or None. Defaults to the model's `delta` (it must
                be below 1 / deployment_users).
            deployment_clients: int or None. Virtual clients of the
                deployment; None takes ceil(users / k), or, when this run's
                pool is a fixed public count, the run's ratio of clients to
                users.
            accountant: str. "pld" (default) or "rdp".
        """
        schedule = self._known_schedule()
        if deployment_clients is None and schedule.num_clients is not None:
            deployment_clients = max(
                -(-deployment_users // schedule.users_per_client),
                math.ceil(deployment_users * schedule.pool_size / schedule.population),
            )
        return privacy.simulated_deployment(
            schedule,
            self.privacy_mechanism().noise_multiplier,
            protocol.read_private_steps(self),
            scale=scale,
            deployment_users=deployment_users,
            delta=protocol.model_delta(self, delta, who="simulated_deployment"),
            deployment_clients=deployment_clients,
            clip_norm=self.privacy_mechanism().clip_norm,
            accountant=accountant,
        )

    def _known_schedule(self):
        if self._schedule is None:
            raise ValueError(
                "The FedEmbModel does not know its schedule yet: fit it on a "
                "kdpemb.data.VirtualClients first, or build it with "
                "FedEmbModel(..., schedule=clients.schedule)."
            )
        return self._schedule

    # ------------------------------------------------------- training --

    def compile(self, optimizer=None, **kwargs):
        """`optimizer` is the server optimizer; defaults to SGD(1.0, momentum=0.9)."""
        if optimizer is None:
            optimizer = keras.optimizers.SGD(learning_rate=1.0, momentum=0.9)
        if kwargs.get("loss") is not None:
            raise ValueError(
                "FedEmbModel computes its own local loss; compile it without loss."
            )
        policy = keras.mixed_precision.dtype_policy().name
        if policy == "mixed_float16" or isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            raise ValueError(
                "FedEmbModel does not scale its local losses, so float16 loss "
                "scaling would shrink every server update; use the "
                "'mixed_bfloat16' policy (or float32) instead."
            )
        kwargs["auto_scale_loss"] = False
        super().compile(optimizer=optimizer, **kwargs)

    def fit(self, x=None, *args, **kwargs):
        """`keras.Model.fit`; `x` is a `kdpemb.data.VirtualClients` or its
        `to_tf_dataset()` (whose schedule is taken or checked alike), or,
        with `schedule=` given to the model, any dataset of the same round
        dicts (e.g. one derived from `to_tf_dataset()` by `.map`).

        Everything is checked before the first round: the schedule (taken
        from the `VirtualClients` once, or compared with the model's),
        the round shape, the image shape against the backbone's input
        (`VirtualClients.image_shape`, or the dataset's element spec; None
        dimensions match anything), and, under a `tf.distribute` strategy
        of several replicas, that the number of rounds is known (a dataset of
        unknown or infinite cardinality needs `steps_per_epoch`). Warns
        with `DataDependentScheduleWarning` when P is not a public count.
        """
        hosts = distribute.current_hosts(self)
        # Every host checks alone, then they tell each other whether all
        # passed (one host refusing would leave the others waiting).
        self._calibrated_this_fit = False
        try:
            with hosts.together("FedEmbModel.fit"):
                x, args, kwargs, clients, verbose = self._checked_fit(
                    x, args, kwargs, hosts
                )
        except HostsDisagreeError:
            # Another host refused: keep no plan this host fixed alone.
            if self._calibrated_this_fit:
                self._forget_plan()
            raise
        x = multi_host.join_fit(self, x, clients, hosts)
        self._reseed(hosts)
        schedule = self._schedule
        if verbose and self.train_function is None:
            print(
                "FedEmbModel: compiling the round (the first round waits for "
                "it; about a minute on a CPU)…",
                flush=True,
            )
        if not schedule.pool_is_public:
            warnings.warn(
                f"The schedule's {schedule.pool_size} virtual clients are "
                f"ceil(N / k) of the private user count N = "
                f"{schedule.population} (k = {schedule.users_per_client}): "
                "adding or removing one user can change P, and with it every "
                "user's client. Pass num_clients from a public count (e.g. "
                "enrolled users) to VirtualClients or Schedule.virtual_clients.",
                DataDependentScheduleWarning,
                stacklevel=2,
            )
        misaligned = self._misaligned()
        history = super().fit(x, *args, **kwargs)
        multi_host.check_rounds_aligned(self._hosts_guard)
        skipped = self._misaligned() - misaligned
        if skipped:
            raise RoundsOutOfEpochError(
                f"{skipped} round(s) of this fit were not rounds of the model's "
                f"current epoch of {self._schedule.steps_per_epoch} rounds "
                "(another epoch layout, or a round already taken) and were "
                "not trained (they released nothing and are not counted): a "
                "user could otherwise take part twice in one epoch of the "
                "accounting. Training stopped there. Fit on the VirtualClients "
                "itself (or its to_tf_dataset()) with whole epochs; the model "
                "is as after its last counted round."
            )
        return history

    def _checked_fit(self, x, args, kwargs, hosts):
        """`fit`'s checks, before any round; returns `(x, args, kwargs,
        clients, verbose)` to fit with (guards added)."""
        from kdpemb.data import VirtualClients
        from kdpemb.data.virtual_clients import clients_of

        for name in ("validation_data", "validation_split"):
            if kwargs.get(name):
                raise ValueError(
                    f"FedEmbModel.fit does not take {name}: there is no loss "
                    "to validate. Use the kdpemb.callbacks.RecallAtFAR "
                    "callback on held-out identities."
                )
        _check_strategy(self)
        _check_known_length(self, x, kwargs.get("steps_per_epoch"))
        clients = x if isinstance(x, VirtualClients) else clients_of(x)
        if clients is not None:
            self._check_clients(clients)
        elif self._schedule is None:
            raise ValueError(
                f"fit got {type(x).__name__}, which carries no schedule: a "
                "FedEmbModel fit on anything but a kdpemb.data.VirtualClients or "
                "its to_tf_dataset() (e.g. a dataset derived from it by .map) "
                "needs it given, "
                "FedEmbModel(..., schedule=clients.schedule). You then vouch "
                "that the rounds are sampled as it states."
            )
        else:
            rows, steps = _round_shape(x)
            if steps is not None:
                _check_round_steps(steps, self._schedule.local_steps)
            _check_rows_split(rows)
            image_shape = _round_image_shape(x)
            if image_shape is not None:
                _check_image_shape(self.backbone, image_shape, "the rounds")
            self._head_columns = None
        kwargs = multi_host.check_fit(self, x, clients, kwargs, hosts)
        arguments = privacy_plan.fit_arguments(args, kwargs)
        verbose = privacy_plan.is_verbose(arguments)
        self._hosts_guard = None
        if hosts.count > 1:
            self._hosts_guard = multi_host.HostsGuard(hosts)
            callbacks = privacy_plan.with_guard(
                arguments.get("callbacks"), self._hosts_guard, self
            )
            arguments = {**arguments, "callbacks": callbacks}
            args, kwargs = (), arguments
        if self._schedule.sampling == "epochs":
            self._check_epoch_alignment(arguments)
            # Checked again after every other callback (one may restore a
            # model saved mid-epoch), and at every round.
            callbacks = privacy_plan.with_guard(
                arguments.get("callbacks"), _EpochGuard(), self
            )
            arguments = {**arguments, "callbacks": callbacks}
            args, kwargs = (), arguments
        if self.target_epsilon is not None:

            def steps_of(initial_epoch):
                return privacy_plan.fit_steps(
                    x,
                    arguments,
                    _known_length,
                    self.steps_per_execution,
                    initial_epoch,
                )

            calibrated = self._plan_budget(steps_of(self._initial_epoch), verbose)
            self._calibrated_this_fit = calibrated
            # Checked again once the callbacks have begun (one may restore
            # other weights); the round itself never goes past the plan.
            guard = privacy_plan.PlanGuard(
                steps_of, on_restored_steps=self._forget_plan if calibrated else None
            )
            callbacks = privacy_plan.with_guard(arguments.get("callbacks"), guard, self)
            args, kwargs = (), {**arguments, "callbacks": callbacks}
        return x, args, kwargs, clients, verbose

    def _misaligned(self):
        if not hasattr(self, "misaligned_rounds"):
            return 0
        return int(ops.convert_to_numpy(self.misaligned_rounds.value))

    def _check_epoch_alignment(self, arguments):
        """Rounds without sampling (`sampling="epochs"`) are accounted per
        epoch of the schedule's R rounds, counted from the model's first
        round: every fit must start at an epoch boundary and run whole
        epochs of R rounds, or a user could take part twice in what the
        accounting counts as one epoch (one tree)."""
        self._check_whole_epochs()
        rounds = self._schedule.steps_per_epoch
        steps_per_epoch = arguments.get("steps_per_epoch")
        if steps_per_epoch is not None and steps_per_epoch != rounds:
            raise ValueError(
                f"steps_per_epoch={steps_per_epoch}: with sampling='epochs' an "
                f"epoch is the schedule's {rounds} rounds (each user at most "
                "once). Leave steps_per_epoch None."
            )

    def _check_whole_epochs(self):
        """Refuses to train a model whose last epoch was cut short."""
        rounds = self._schedule.steps_per_epoch
        taken = protocol.read_private_steps(self)
        if taken % rounds:
            raise ValueError(
                f"This model has taken {taken} rounds, which is not a whole "
                f"number of epochs of {rounds} rounds (sampling='epochs'): the "
                "last epoch was cut short. A new fit starts a new epoch of the "
                "data, in which its users take part again, while the "
                "accounting (and the tree noise) would count those rounds in "
                "the unfinished epoch. Resume from a checkpoint saved at the "
                "end of an epoch (ModelCheckpoint's and BackupAndRestore's "
                "default save_freq='epoch')."
            )

    def _plan_budget(self, steps, verbose):
        """With a `target_epsilon`: calibrates the noise at the first fit (over
        `planned_steps`, or this fit's `steps`), then refuses a fit of
        `steps` rounds that would go past the plan, before any round. The
        plan is fixed only by a fit that passes; a plan given to the
        constructor is checked against the target once. Returns whether
        this call calibrated."""
        if steps is None:
            raise ValueError(
                "With target_epsilon, fit must know how many rounds it runs, "
                "and this round source does not say (unknown or infinite "
                "length): pass steps_per_epoch, or fit on VirtualClients or "
                "their to_tf_dataset()."
            )
        if self.calibrated_noise_multiplier is not None:
            self._check_given_plan()
            privacy_plan.check_budget(self, steps)
            return False
        taken = protocol.read_private_steps(self)
        if taken:
            raise ValueError(
                f"This FedEmbModel has taken {taken} private rounds (weights "
                "loaded into a new model?) but does not know the noise they "
                "were calibrated with: a new calibration would account them "
                "at another noise and misstate ε. Load the whole model with "
                "keras.saving.load_model, or build it with the saved "
                "planned_steps=... and calibrated_noise_multiplier=... "
                "(model.planned_steps and model.calibrated_noise_multiplier "
                "of the model that took them)."
            )
        planned = self.planned_steps or steps
        schedule = self._known_schedule()
        z_eff = privacy_plan.calibrate(
            schedule.privacy_mechanism(1.0, noise=self.noise),
            planned,
            self.target_epsilon,
            self.delta,
            verbose,
            "FedEmbModel",
        )
        z = z_eff
        if self.adaptive_clipping is not None:
            # z is the round's z_eff: what the count leaves to the update.
            clients = schedule.sample_size
            z = self.adaptive_clipping.update_noise_multiplier(z_eff, clients)
            if verbose:
                sigma = self.adaptive_clipping.count_stddev_for(clients)
                print(
                    f"FedEmbModel: with the count's noise σ_b = {sigma:.4g}, "
                    f"the update's noise multiplier is {z:.4g}.",
                    flush=True,
                )
        if steps > planned:
            # Refused before the plan is fixed: a later fit plans afresh.
            after = privacy.epsilon(
                schedule.privacy_mechanism(z_eff, noise=self.noise), steps, self.delta
            )
            raise PrivacyBudgetExhaustedError(
                f"This fit's {steps} rounds are more than the planned_steps="
                f"{planned} that target_epsilon={self.target_epsilon} (δ = "
                f"{self.delta}) is spent over; at the calibrated noise they "
                f"would take ε to {after:.4g}. Fit at most {planned} more rounds, "
                "or build a new FedEmbModel with a larger planned_steps."
            )
        self._given_planned_steps = self.planned_steps
        with self._settings_unfrozen():
            self.planned_steps = planned
            self.calibrated_noise_multiplier = z
            self.noise_multiplier = z
        self._plan_checked = True
        return True

    def _forget_plan(self):
        """Undoes this fit's calibration: a callback restored rounds that
        were taken at a noise this model does not know."""
        with self._settings_unfrozen():
            self.planned_steps = self._given_planned_steps
            self.calibrated_noise_multiplier = None
            self.noise_multiplier = None
        self._plan_checked = False
        self.train_function = None

    def _check_given_plan(self):
        """Checks a plan given to the constructor once per model."""
        if not getattr(self, "_plan_checked", False):
            privacy_plan.check_plan(self)
            self._plan_checked = True

    def train_on_batch(self, *args, **kwargs):
        if self.target_epsilon is not None:
            if self.calibrated_noise_multiplier is None:
                raise ValueError(
                    "A FedEmbModel with target_epsilon calibrates its noise at "
                    "its first fit, over the rounds it plans: fit it first."
                )
            self._check_given_plan()
            privacy_plan.check_budget(self, 1)
        misaligned = self._misaligned()
        logs = super().train_on_batch(*args, **kwargs)
        if self._misaligned() > misaligned:
            raise RoundsOutOfEpochError(
                "This round is not one of the rounds of the model's current "
                f"epoch of {self._schedule.steps_per_epoch} rounds (another "
                "epoch layout, or a round already taken): it was not trained "
                "(it released nothing and is not counted)."
            )
        return logs

    def _check_clients(self, clients):
        """Checks the model against its `VirtualClients`, then adopts their
        schedule (if it has none) and head width; a fit refused by these
        checks adopts nothing."""
        _check_image_shape(
            self.backbone, clients.image_shape, "the VirtualClients (image_shape)"
        )
        if (
            self.aggregation == "partial"
            and clients.users_per_client == 1
            and clients.max_identities_per_user == 1
        ):
            raise ValueError(
                "Every virtual client holds a single identity (one user of one "
                "identity each), so its local softmax head has one class, a "
                "zero loss and no gradient: the backbone would never change. "
                "Group users into virtual clients with users_per_client > 1 "
                "(e.g. 4 to 16) in VirtualClients."
            )
        if self.aggregation == "full" and self.num_classes != clients.num_classes:
            raise ValueError(
                f"The model's global head has num_classes={self.num_classes} "
                f"columns but the VirtualClients have {clients.num_classes} "
                "identities; build both with the same num_classes."
            )
        _check_rows_split(clients.max_clients_per_round)
        self._adopt_schedule(clients.schedule)
        # Local heads need one column per identity a client can hold.
        self._head_columns = clients.max_local_classes

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # TensorFlow trainer under a strategy: Keras would average the first
        # distributed round over replicas to learn shapes, which fails on the
        # bool masks (and builds a round for nothing). The model is built at
        # construction; only the server optimizer's variables remain, and
        # they must be created in the strategy's scope.
        strategy = getattr(self, "_distribute_strategy", None)
        if strategy is None:
            return
        with strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)

    def call(self, images, training=False):
        """The embeddings of `images` (float32 pixel values)."""
        return self.backbone(ops.cast(images, "float32"), training=training)

    def train_step(self, *args):
        # TensorFlow calls train_step(data); JAX calls train_step(state, data).
        return backends.current().train_step(self, args, self._round)

    def _round_config(self, num_rows):
        learning_rate, momentum, nesterov = self.client_optimizer
        parallelism = self.client_parallelism or _default_parallelism()
        if parallelism == "all":
            parallelism = num_rows or 1
        return fedemb_round.RoundConfig(
            learning_rate=learning_rate,
            momentum=momentum,
            nesterov=nesterov,
            head_lr_scale=self.head_lr_scale,
            reconstruction_steps=self.reconstruction_steps,
            clip_norm=self.clip_norm,
            client_parallelism=int(parallelism),
            full_aggregation=self.aggregation == "full",
            head=self.head_type,
            head_scale=self.head_scale,
            head_margin=self.head_margin,
        )

    def _round_inputs(self, data, local_steps, head_columns=None):
        """`(trainer, theta, non_trainable, heads, data)` of a round: the
        local training as the model runs it, from the server's weights."""
        plumbing = backends.current()
        num_rows = data["images"].shape[0]
        config = self._round_config(num_rows)
        trainer = fedemb_round.ClientTrainer(
            self.backbone, config, plumbing.value_and_grad
        )
        theta = [v.value for v in self.backbone.trainable_variables]
        non_trainable = [v.value for v in self.backbone.non_trainable_variables]
        if self.aggregation == "full":
            heads = self.head.value
            data = dict(
                data,
                labels=data["global_labels"],
                num_local_classes=ops.full_like(
                    data["num_local_classes"], self.num_classes
                ),
            )
        else:
            columns = head_columns or (data["labels"].shape[-1] * local_steps)
            shape = (ops.shape(data["images"])[0], self.embedding_dim, columns)
            heads = (
                fedemb_round.random_heads(shape, self.head_seed)
                if self.head_init == "random"
                else ops.zeros(shape, "float32")
            )
        return trainer, theta, non_trainable, heads, data

    def _round(self, data):
        plumbing = backends.current()
        schedule = self._known_schedule()
        data = _check_round(data, schedule.local_steps)
        # Rounds of no known shape until now (e.g. a PyDataset of rounds).
        _check_image_shape(self.backbone, data["images"].shape[3:], "the round")
        trainer, theta, non_trainable, heads, data = self._round_inputs(
            data, schedule.local_steps, self._head_columns
        )
        adaptive = self.adaptive_clipping is not None
        # Adaptive clipping: this round clips to, and noises with, the C
        # before the round's update of C.
        clip_norm = self.current_clip_norm.value if adaptive else None
        result = _run_round_on_devices(
            plumbing, trainer, theta, non_trainable, heads, data, clip_norm
        )

        clipped = result.clipped
        hosts_aligned = self._hosts_aligned(data)
        within_plan = _both(
            _both(self._within_plan(), hosts_aligned),
            self._epoch_aligned(data, hosts_aligned),
        )
        if self.noise == "tree":
            noise = self._tree_round_noise(clipped, within_plan)
        else:
            noise = gaussian_sum.gaussian_noise(
                clipped, self.noise_multiplier, self.noise_seed
            )
        share = plumbing.noise_share()
        if adaptive:
            clients = schedule.sample_size
            count_noise = quantile_clip.count_noise(
                self.adaptive_clipping.count_stddev_for(clients), self.count_seed
            )
            noisy_count = plumbing.replica_sum(
                quantile_clip.centred_count(clipped) + share * count_noise
            )
            next_clip_norm = quantile_clip.next_clip_norm(
                clip_norm, noisy_count, clients, self.adaptive_clipping
            )
            if within_plan is not None:
                next_clip_norm = ops.where(within_plan, next_clip_norm, clip_norm)
            self.current_clip_norm.assign(next_clip_norm)
        mean_update = [
            (total + share * n) / schedule.sample_size
            for total, n in zip(clipped.total, noise, strict=True)
        ]
        if within_plan is not None:
            # A round past the plan releases nothing computed from the data
            # (a zero update; momentum still moves the weights) and is not
            # counted.
            mean_update = [
                ops.where(within_plan, u, ops.zeros_like(u)) for u in mean_update
            ]
        variables = self._noised_variables()
        # The server optimizer descends the gradient -Δ (Keras sums the
        # replicas' gradients, so each passes its share).
        self.optimizer.apply([-u for u in mean_update], variables)
        self.private_steps.assign_add(
            1 if within_plan is None else ops.cast(within_plan, "int32")
        )

        # Only opted-in logs are computed from private data without noise.
        logs = {"private_steps": self.private_steps.value}
        if adaptive:  # Computed from the noisy count only.
            logs["clip_norm"] = self.current_clip_norm.value
        if self.log_nonfinite_updates:
            logs["nonfinite_updates"] = plumbing.replica_sum(clipped.num_nonfinite)
        if self.log_local_loss:
            count = ops.cast(plumbing.replica_sum(clipped.count), "float32")
            logs["local_loss"] = plumbing.replica_sum(result.loss_sum) / ops.maximum(
                count, 1.0
            )
        if hosts_aligned is not None:
            logs["misaligned_hosts"] = 1 - ops.cast(hosts_aligned, "int32")
        if within_plan is not None:
            for name in ("nonfinite_updates", "local_loss"):
                if name in logs:
                    logs[name] = ops.where(
                        within_plan, logs[name], ops.zeros_like(logs[name])
                    )
        return plumbing.replica_logs(logs)

    def _hosts_aligned(self, data):
        """On several hosts, whose rounds carry their index on every row
        (`VirtualClients.host_round`): whether every host's rows are of the
        same round (a traced bool, the same on every replica); else None.

        A round of mixed rounds would let a user's data count twice and is
        not the sample the accounting assumes: it releases nothing, is not
        counted, and `fit` raises after it."""
        if "round_index" not in data:
            return None
        plumbing = backends.current()
        index = ops.cast(data["round_index"], "int32")
        low, high = ops.min(index), ops.max(index)
        # JAX: the rows of every host are one global array. TensorFlow: each
        # replica's low must equal the mean low over the replicas.
        replicas = plumbing.replica_sum(ops.ones((), "int32"))
        differs = ops.logical_or(
            ops.not_equal(low, high),
            ops.not_equal(plumbing.replica_sum(low), replicas * low),
        )
        return ops.equal(plumbing.replica_sum(ops.cast(differs, "int32")), 0)

    def _epoch_aligned(self, data, hosts_aligned=None):
        """With rounds without sampling (`VirtualClients` rounds say their
        epoch layout, `epoch_id`, and position): whether this round belongs
        to the model's current epoch of R rounds (a traced bool).

        The accounting (and the tree) count a user once per epoch of R
        rounds from the model's first. So the R rounds of a model epoch
        must be R distinct rounds of one epoch layout, in any order (Keras
        shuffles them). `fit` refuses what it can see up front; this
        catches the rest (a data pass cut short, a loader that serves an
        epoch's rounds to the next one): a round that does not belong
        releases nothing, is not counted, and `fit` then raises."""
        if self._schedule.sampling != "epochs":
            return None
        missing = [key for key in ("epoch_id", "round_in_epoch") if key not in data]
        if missing:
            raise ValueError(
                f"Rounds without sampling (sampling='epochs') must say which "
                f"epoch layout and position they are (keys {missing} are "
                "missing), so that each user is counted once per epoch: "
                "VirtualClients(..., sampling='epochs') adds them; a dataset "
                "derived from its to_tf_dataset() must keep them."
            )
        rounds = self._schedule.steps_per_epoch
        starts = ops.equal(self.private_steps.value % rounds, 0)
        data_epoch = ops.cast(data["epoch_id"][0], "int32")
        data_position = ops.cast(data["round_in_epoch"][0], "int32")
        this_round = ops.cast(ops.equal(ops.arange(rounds), data_position), "int32")
        taken = ops.where(starts, 0, self.epoch_rounds_taken.value)
        aligned = ops.logical_and(
            ops.logical_or(starts, ops.equal(data_epoch, self.data_epoch.value)),
            ops.logical_and(
                ops.equal(ops.sum(this_round), 1),  # A position in [0, R).
                ops.equal(ops.sum(taken * this_round), 0),  # Not taken yet.
            ),
        )
        if hosts_aligned is not None:  # A mixed round takes no position.
            aligned = ops.logical_and(aligned, hosts_aligned)
        self.data_epoch.assign(ops.where(aligned, data_epoch, self.data_epoch.value))
        self.epoch_rounds_taken.assign(
            ops.where(
                aligned, ops.maximum(taken, this_round), self.epoch_rounds_taken.value
            )
        )
        self.misaligned_rounds.assign_add(1 - ops.cast(aligned, "int32"))
        return aligned

    def _tree_round_noise(self, clipped, within_plan):
        """This round's tree noise; moves the tree's state (unless the round
        is past the plan: then nothing moves)."""
        steps_per_tree = self._known_schedule().steps_per_epoch
        round_in_tree = self.private_steps.value % steps_per_tree + 1
        state = [v.value for v in self.tree_open_noise]
        noise, new_state = tree_noise.tree_noise(
            clipped,
            self.noise_multiplier,
            self.noise_seed,
            state,
            round_in_tree,
            efficient=self.tree_estimator == "efficient",
        )
        for variable, old, new in zip(
            self.tree_open_noise, state, new_state, strict=True
        ):
            variable.assign(
                new if within_plan is None else ops.where(within_plan, new, old)
            )
        return noise

    def _within_plan(self):
        """With a `target_epsilon`: whether this round is within the plan (a
        traced bool), else None. The fit refuses, before any round, a fit
        that would go past the plan; this holds where a callback changed
        `private_steps` mid-fit, and no error can be raised from the traced
        round: a round past the plan releases nothing computed from the
        data (its update, C and opt-in logs are dropped) and is not
        counted."""
        if self.target_epsilon is None:
            return None
        if self.planned_steps is None:
            raise ValueError(
                "A FedEmbModel with target_epsilon plans its rounds at its "
                "first fit: fit it first."
            )
        return ops.less(self.private_steps.value, self.planned_steps)

    def test_step(self, data):
        raise NotImplementedError(
            "FedEmbModel has no loss to evaluate on held-out identities; "
            "evaluate the embeddings with kdpemb.metrics.recall_at_far or the "
            "kdpemb.callbacks.RecallAtFAR callback."
        )

    # ---------------------------------------------------------- saving --

    def get_config(self):
        learning_rate, momentum, nesterov = self.client_optimizer
        return {
            **super().get_config(),
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "aggregation": self.aggregation,
            "num_classes": self.num_classes,
            "client_optimizer": {
                "learning_rate": learning_rate,
                "momentum": momentum,
                "nesterov": nesterov,
            },
            "head_lr_scale": self.head_lr_scale,
            "head_init": self.head_init,
            "head": self.head_type,
            "head_scale": self.head_scale,
            "head_margin": self.head_margin,
            "reconstruction_steps": self.reconstruction_steps,
            "clip_norm": self.clip_norm,
            "noise_multiplier": (
                None if self.target_epsilon is not None else self.noise_multiplier
            ),
            "schedule": None if self._schedule is None else self._schedule.get_config(),
            "delta": self.delta,
            "client_parallelism": self.client_parallelism,
            "log_local_loss": self.log_local_loss,
            "log_nonfinite_updates": self.log_nonfinite_updates,
            # A reloaded model draws fresh noise: never reuse the seed.
            "seed": None,
            "target_epsilon": self.target_epsilon,
            "planned_steps": self.planned_steps,
            "calibrated_noise_multiplier": self.calibrated_noise_multiplier,
            "adaptive_clipping": (
                None
                if self.adaptive_clipping is None
                else self.adaptive_clipping.get_config()
            ),
            "noise": self.noise,
            "tree_estimator": self.tree_estimator,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)


class _EpochGuard(keras.callbacks.Callback):
    """Rounds without sampling: once every other callback has run its
    `on_train_begin` (one may restore a model saved mid-epoch), refuses a
    model whose last epoch was cut short, before any round; then stops
    training at the first round that did not belong to the model's epoch
    (`fit` raises after it)."""

    def on_train_begin(self, logs=None):
        self.model._check_whole_epochs()
        self._misaligned = self.model._misaligned()

    def on_train_batch_end(self, batch, logs=None):
        if self.model._misaligned() > self._misaligned:
            self.model.stop_training = True


def _run_round_on_devices(plumbing, trainer, theta, non_trainable, heads, data, clip):
    """`fedemb_round.run_round`, each device training only its share of
    the round's rows (`backends.sum_over_devices`); the sums are over all
    of them."""
    per_row_heads = len(heads.shape) == 3
    rows = dict(data, heads=heads) if per_row_heads else dict(data)
    shared = (theta, non_trainable, None if per_row_heads else heads, clip)

    def local(rows, shared):
        theta, non_trainable, shared_head, clip_norm = shared
        rows = dict(rows)
        heads = rows.pop("heads") if per_row_heads else shared_head
        result = fedemb_round.run_round(
            trainer, theta, non_trainable, heads, rows, clip_norm=clip_norm
        )
        sums = result.clipped
        return (
            sums.total,
            sums.count,
            sums.num_nonfinite,
            sums.num_within_clip,
            result.loss_sum,
        )

    total, count, nonfinite, within, loss_sum = plumbing.sum_over_devices(
        local, rows, shared
    )
    clipped = gaussian_sum.ClippedSum(
        total=total,
        clip_norm=trainer.config.clip_norm if clip is None else clip,
        count=count,
        num_nonfinite=nonfinite,
        num_within_clip=within,
    )
    return fedemb_round.RoundResult(clipped=clipped, loss_sum=loss_sum)


def _both(first, second):
    """`first and second` of two traced bools, where None means true."""
    if first is None or second is None:
        return second if first is None else first
    return ops.logical_and(first, second)


def _as_schedule(schedule):
    """A `Schedule` (or its config) of user-level rounds, or a clear error."""
    if isinstance(schedule, dict):
        schedule = Schedule.from_config(schedule)
    if not isinstance(schedule, Schedule):
        raise TypeError(
            "schedule must be a kdpemb.privacy.Schedule, e.g. clients.schedule "
            "of the VirtualClients or Schedule.virtual_clients(...); got "
            f"{type(schedule).__name__}."
        )
    if schedule.unit != "user":
        raise ValueError(
            f"FedEmbModel protects users, but the schedule samples "
            f"{schedule.unit}s: use clients.schedule of the VirtualClients or "
            "Schedule.virtual_clients(...)."
        )
    return schedule


def _schedule_differences(mine, theirs):
    mine, theirs = mine.get_config(), theirs.get_config()
    return "; ".join(
        f"{key}: model {mine[key]!r}, rounds {theirs[key]!r}"
        for key in mine
        if mine[key] != theirs[key]
    )


def _round_shape(x):
    """`(M_max, local steps)` of a round source whose element spec tells
    them (a `tf.data.Dataset`); None where unknown."""
    spec = getattr(x, "element_spec", None)
    if not isinstance(spec, dict) or "images" not in spec:
        return None, None
    shape = getattr(spec["images"], "shape", None)
    if shape is None or len(shape) < 2:
        return None, None
    return tuple(None if d is None else int(d) for d in tuple(shape)[:2])


def _round_image_shape(x):
    """The image shape of a round source whose element spec tells it (a
    `tf.data.Dataset` of rounds `(M, S, B, *image)`), or None."""
    spec = getattr(x, "element_spec", None)
    if not isinstance(spec, dict) or "images" not in spec:
        return None
    shape = getattr(spec["images"], "shape", None)
    if shape is None or shape.rank is None or shape.rank < 4:
        return None
    return tuple(None if d is None else int(d) for d in tuple(shape)[3:])


def _check_image_shape(backbone, image_shape, where):
    """Refuses rounds of images the backbone was not built for (`extract`
    refuses them alike): a convolutional backbone would otherwise train on
    them without a word."""
    inputs.check_input_shape(
        inputs.model_input_shape(backbone), (None, *image_shape), where
    )


def _check_rows_split(rows):
    """The client rows of a round must split evenly over the devices."""
    devices = _data_parallel_devices()
    if rows is not None and devices > 1 and rows % devices:
        size = -(-rows // devices) * devices
        raise ValueError(
            f"The rounds hold {rows} client rows, which do not split over "
            f"{devices} devices; build the VirtualClients with "
            f"max_clients_per_round={size}."
        )


def _known_length(x):
    """Rounds in one pass over `x`, or None if unknown or infinite."""
    cardinality = getattr(x, "cardinality", None)
    if callable(cardinality):  # tf.data.Dataset
        count = int(cardinality())
        return count if count >= 0 else None
    if isinstance(x, keras.utils.PyDataset):
        return x.num_batches
    return None


def _check_known_length(model, x, steps_per_epoch):
    """Under several tf.distribute replicas, refuses a round source of
    unknown length: Keras then calls the step once more at its end, on
    some replicas only, and `private_steps` stops matching the rounds."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return
    if steps_per_epoch is not None or _known_length(x) is not None:
        return
    raise ValueError(
        f"Under {type(strategy).__name__} with {strategy.num_replicas_in_sync} "
        f"replicas, fit needs to know how many rounds an epoch holds, and "
        f"{type(x).__name__} does not say (unknown or infinite cardinality, "
        "e.g. after .filter): the replicas would count different numbers of "
        "private steps. Pass steps_per_epoch (at most the rounds the dataset "
        "holds), or fit on VirtualClients.to_tf_dataset(), whose cardinality "
        "is known."
    )


def _data_parallel_devices():
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return int(distribution.device_mesh.devices.size)


def _check_strategy(model):
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise NotImplementedError(
            "FedEmbModel does not support ParameterServerStrategy: its workers "
            "step asynchronously, so a round would not be one sum of the "
            "sampled clients. Use MultiWorkerMirroredStrategy on several "
            "machines, MirroredStrategy on one."
        )


def _input_shape(backbone):
    shape = getattr(backbone, "input_shape", None)
    if shape is None:
        raise ValueError(
            "The backbone must be built with a known input shape: create it "
            "with keras.Input(shape=...) or call backbone.build(...)."
        )
    return shape


def _output_dim(backbone):
    if not backbone.built:
        raise ValueError(
            f"The backbone {backbone.name!r} is not built: create it with "
            "keras.Input(shape=...) or call backbone.build(input_shape) first."
        )
    try:
        shape = backbone.output_shape
    except (AttributeError, ValueError):
        spec = backbone.compute_output_spec(
            keras.KerasTensor(_input_shape(backbone), dtype="float32")
        )
        shape = spec.shape
    if len(shape) != 2 or shape[-1] is None:
        raise ValueError(
            f"The backbone must map images to embeddings [batch, D]; its output "
            f"shape is {shape}. End it with pooling or Flatten and a Dense layer."
        )
    return int(shape[-1])


def _check_round(data, local_steps):
    if isinstance(data, tuple) and data and all(d is None for d in data[1:]):
        # `(round,)`, as a Python generator must yield it, or `(round, None,
        # None)` from `train_on_batch`.
        data = data[0]
    if not isinstance(data, dict) or "client_mask" not in data:
        raise ValueError(
            "FedEmbModel trains on rounds of kdpemb.data.VirtualClients (dicts "
            "with images, labels, example_mask, client_mask, ...); got "
            f"{type(data).__name__}."
        )
    _check_round_steps(data["images"].shape[1], local_steps)
    return data


def _check_round_steps(steps, local_steps):
    if steps is not None and steps != local_steps:
        raise ValueError(
            f"The rounds hold {steps} local steps per client but the model's "
            f"schedule has local_steps={local_steps}: give the model the "
            "schedule of these rounds, FedEmbModel(..., schedule=clients.schedule)."
        )

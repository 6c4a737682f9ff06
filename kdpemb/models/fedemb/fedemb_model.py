"""`FedEmbModel`: DP-FedEmb and DP-FedAvg as a `keras.Model`.

One `train_step` is one round: the round's virtual clients train locally
(`fedemb_round`), their updates are clipped and summed, Gaussian noise is
added once, and the server optimizer applies the noisy mean update to the
backbone. The model delegates: construction and config to
`fedemb_config`, `fit` to `fedemb_fit`, the round to `fedemb_step`, the
schedule and privacy to `fedemb_privacy`, argument checks to
`fedemb_checks`.
"""

import keras
from keras import ops

from kdpemb.models import heads
from kdpemb.models._shared import backends
from kdpemb.models._shared.frozen_settings import FrozenSettings
from kdpemb.models._shared.optimizer_restore import RestoresOptimizer
from kdpemb.models.fedemb import fedemb_config, fedemb_fit, fedemb_privacy, fedemb_step
from kdpemb.privacy import protocol

__all__ = ["FedEmbModel"]

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
        head_init: "zeros", "random", "class_means" or None (the
            default: "zeros" for the softmax head; for the cosine head
            "class_means", or "random" with `aggregation="full"`).
            DP-FedEmb: a local head starts at zeros or from N(0, 1/D),
            fresh per client and round; "class_means" imprints
            it from the client's own examples (column c: the normalised
            mean of the normalised embeddings of its examples of local
            class c, under the round's backbone; one extra forward pass
            per local batch), so the backbone's first local steps already
            pull each identity together. The head never leaves the client,
            so this changes nothing in the privacy arithmetic. DP-FedAvg:
            the global head's initial value (a data-independent draw;
            "class_means" is refused).
        head: "softmax" (default): local logits `e · W`; or "cosine":
            `s · normalize(e) · normalize(W)`, a normalised softmax that
            often learns better embeddings. A cosine head needs
            `head_init="random"` or `"class_means"`: a zero column has no
            direction.
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
        fedemb_config.construct(
            self,
            backbone,
            embedding_dim,
            aggregation=aggregation,
            num_classes=num_classes,
            client_optimizer=client_optimizer,
            head_lr_scale=head_lr_scale,
            head_init=head_init,
            head=head,
            head_scale=head_scale,
            head_margin=head_margin,
            reconstruction_steps=reconstruction_steps,
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            schedule=schedule,
            delta=delta,
            client_parallelism=client_parallelism,
            seed=seed,
            log_local_loss=log_local_loss,
            log_nonfinite_updates=log_nonfinite_updates,
            target_epsilon=target_epsilon,
            planned_steps=planned_steps,
            calibrated_noise_multiplier=calibrated_noise_multiplier,
            adaptive_clipping=adaptive_clipping,
            noise=noise,
            tree_estimator=tree_estimator,
        )
        self.built = True
        self._freeze_settings()

    def _reseed(self, hosts):
        fedemb_privacy.reseed(self, hosts)

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

    # -------------------------------------------------------- privacy --

    def privacy_mechanism(self):
        """The user-level mechanism of one round (`kdpemb.privacy`)."""
        return fedemb_privacy.privacy_mechanism(self)

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
        whole one. Never fewer rounds than `counted`, and with a
        `target_epsilon` never more than the plan's `planned_steps` (no
        round is taken past them)."""
        return fedemb_privacy.ledger_resume_steps(self, counted)

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
        return fedemb_privacy.simulated_deployment(
            self, scale, deployment_users, delta, deployment_clients, accountant
        )

    # ------------------------------------------------------- training --

    def compile(self, optimizer=None, **kwargs):
        """`optimizer` is the server optimizer; defaults to Adam(3e-3), the
        utility study's choice (docs/fedemb.md)."""
        if optimizer is None:
            optimizer = keras.optimizers.Adam(learning_rate=3e-3)
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

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_data=None,
        initial_epoch=0,
        steps_per_epoch=None,
        **kwargs,
    ):
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
        kwargs.update(
            y=y, batch_size=batch_size, epochs=epochs, verbose=verbose,
            callbacks=callbacks, validation_data=validation_data,
            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
        )  # fmt: skip
        return fedemb_fit.fit(self, super().fit, x, kwargs)

    def train_on_batch(self, *args, **kwargs):
        return fedemb_fit.train_on_batch(self, super().train_on_batch, args, kwargs)

    def _check_clients(self, clients):
        fedemb_fit.check_clients(self, clients)

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
        return backends.current().train_step(
            self, args, lambda data: fedemb_step.train_round(self, data)
        )

    def _round_config(self, num_rows):
        return fedemb_step.round_config(self, num_rows)

    def test_step(self, data):
        raise NotImplementedError(
            "FedEmbModel has no loss to evaluate on held-out identities; "
            "evaluate the embeddings with kdpemb.metrics.recall_at_far or the "
            "kdpemb.callbacks.RecallAtFAR callback."
        )

    # ---------------------------------------------------------- saving --

    def get_config(self):
        return {**super().get_config(), **fedemb_config.config(self)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)

"""`FedEmbModel`: DP-FedEmb and DP-FedAvg as a `keras.Model`.

One `train_step` is one round (DESIGN.md section 2): the round's virtual
clients train locally (`fedemb_round`), their updates are clipped and
summed, Gaussian noise is added once, and the server optimizer applies
the noisy mean update to the backbone.
"""

import math
import numbers
import warnings

import keras
from keras import ops

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.errors import ReproducibleNoiseWarning
from kdpemb.models import backbone_checks, backends, fedemb_round
from kdpemb.models.frozen_settings import FrozenSettings
from kdpemb.models.optimizer_restore import RestoresOptimizer
from kdpemb.privacy import gaussian_sum, protocol

AGGREGATIONS = ("partial", "full")
_FROZEN_SETTINGS = frozenset(
    {
        "aggregation",
        "num_classes",
        "local_steps",
        "client_optimizer",
        "head_lr_scale",
        "head_init",
        "reconstruction_steps",
        "clip_norm",
        "noise_multiplier",
        "clients_per_round",
        "users_per_client",
        "num_users",
        "num_clients",
        "sampling",
        "client_parallelism",
        "seed",
        "backbone",
        "embedding_dim",
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
    and a softmax head on its own examples for `local_steps` batches; its
    backbone update Δ (θ_local − θ) is clipped to L2 norm `clip_norm`
    (non-finite updates become zeros and are counted); the clipped updates
    of all clients on all devices are summed; N(0, (z·C)²) is added once;
    the sum is divided by the expected number of clients M; and the
    server optimizer applies −(noisy mean) as a gradient.

    - `aggregation="partial"` (DP-FedEmb): each client's head has one
      column per identity it holds, starts from zeros (or random) every
      round, and is thrown away. Only the backbone is shared.
    - `aggregation="full"` (DP-FedAvg): the head is a global
      `[embedding_dim, num_classes]` variable, trained locally, and
      clipped, noised and aggregated with the backbone.
    - `noise_multiplier=0` with a huge `clip_norm` is non-private
      federated training.

    The privacy unit is the user: see `privacy_mechanism()` and
    `privacy_statement(delta)`. `model.backbone` is the embedding model to
    export; `model.save` keeps the backbone, the head, the server
    optimizer and `private_steps`, so a loaded model keeps counting.

    Logs: `private_steps`, and `nonfinite_updates`, the round's count of
    sampled clients whose update was non-finite and zeroed. That count is
    computed from private data without noise and is not covered by the
    guarantee (a diverging client is a bug to see, not to hide); keep it
    out of anything you release.

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
        local_steps: int. Local batches per client (the rounds' S).
        client_optimizer: float or `keras.optimizers.SGD`. Local SGD
            (learning rate, momentum, nesterov). Defaults to `SGD(0.01)`.
        head_lr_scale: float. The head's local learning rate is the
            client's times this. Defaults to `100`, the reference code's value.
        head_init: "zeros" (default) or "random" (N(0, 1/D), fresh per
            client and round); DP-FedEmb only.
        reconstruction_steps: int. First local batches that train only
            the head, backbone frozen. Must be below `local_steps`.
        clip_norm: float. C.
        noise_multiplier: float. z (0 for no noise).
        clients_per_round: float. M, the expected clients per round.
        users_per_client: int. k.
        num_users: int or None. Users in the training data; taken from the
            `VirtualClients` at the first `fit` if None.
        num_clients: int or None. P, if the `VirtualClients` fixes it.
        sampling: "poisson" (default) or "fixed", as the `VirtualClients`.
        client_parallelism: int, "all" or None. Clients trained at once
            (vectorised); 1 trains them one after another, so peak memory
            does not grow with M. None picks "all" on a JAX GPU/TPU or
            under `keras.distribution`, else 1.
        seed: int or None. Seed of the noise and random heads. None (the
            default) draws it from OS entropy; a fixed seed makes the noise
            predictable and warns (tests only).
        log_local_loss: bool. Log the clients' mean local training loss as
            `local_loss`. It is computed on private data without noise and
            is not covered by the guarantee. Defaults to False.

    Example:

    >>> import keras
    >>> from kdpemb.models import FedEmbModel, small_cnn
    >>> model = FedEmbModel(small_cnn((16, 16, 3), embedding_dim=8),
    ...                     local_steps=2, clip_norm=1.0, noise_multiplier=1.0,
    ...                     clients_per_round=4, num_users=40)
    >>> model.compile()
    >>> model.privacy_mechanism().unit
    'user'
    """

    _FROZEN_SETTINGS = _FROZEN_SETTINGS

    def __init__(
        self,
        backbone,
        embedding_dim=None,
        *,
        aggregation="partial",
        num_classes=None,
        local_steps=1,
        client_optimizer=0.01,
        head_lr_scale=100.0,
        head_init="zeros",
        reconstruction_steps=0,
        clip_norm=1.0,
        noise_multiplier,
        clients_per_round,
        users_per_client=1,
        num_users=None,
        num_clients=None,
        sampling="poisson",
        client_parallelism=None,
        seed=None,
        log_local_loss=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}."
            )
        if head_init not in HEAD_INITS:
            raise ValueError(
                f"head_init must be one of {HEAD_INITS}, got {head_init!r}."
            )
        if aggregation == "full" and head_init != "zeros":
            raise ValueError(
                "head_init applies to DP-FedEmb's local heads; with "
                "aggregation='full' the global head starts at zeros."
            )
        self.aggregation = aggregation
        self.head_init = head_init
        self.local_steps = validation.check_positive_int(local_steps, "local_steps")
        if not isinstance(reconstruction_steps, numbers.Integral) or isinstance(
            reconstruction_steps, bool
        ):
            raise ValueError(
                f"reconstruction_steps must be an int, got {reconstruction_steps!r}."
            )
        self.reconstruction_steps = int(reconstruction_steps)
        if not 0 <= self.reconstruction_steps < self.local_steps:
            raise ValueError(
                f"reconstruction_steps={reconstruction_steps} must be in "
                f"[0, local_steps={self.local_steps}): with every step frozen "
                "the backbone would never change."
            )
        self.client_optimizer = _client_sgd(client_optimizer)
        self.head_lr_scale = validation.check_positive(head_lr_scale, "head_lr_scale")
        self.clip_norm = validation.check_positive(clip_norm, "clip_norm")
        self.noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
        self.clients_per_round = validation.check_positive(
            clients_per_round, "clients_per_round"
        )
        self.users_per_client = validation.check_positive_int(
            users_per_client, "users_per_client"
        )
        self.num_users = (
            None
            if num_users is None
            else validation.check_positive_int(num_users, "num_users")
        )
        self.num_clients = (
            None
            if num_clients is None
            else validation.check_positive_int(num_clients, "num_clients")
        )
        self.sampling = sampling
        if client_parallelism not in (None, "all"):
            client_parallelism = validation.check_positive_int(
                client_parallelism, "client_parallelism"
            )
        self.client_parallelism = client_parallelism
        self.log_local_loss = bool(log_local_loss)
        if self.num_users is not None:
            self.privacy_mechanism()  # Validates the schedule now.

        backbone_checks.check_backbone(backbone)
        output_dim = _output_dim(backbone)
        if embedding_dim is not None and int(embedding_dim) != output_dim:
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
                initializer="zeros",
                name="head",
            )
        else:
            self.num_classes = None if num_classes is None else int(num_classes)
            self.head = None

        self.private_steps = self.add_weight(
            shape=(),
            dtype="int32",
            initializer="zeros",
            trainable=False,
            aggregation="only_first_replica",
            name="private_steps",
        )
        self._head_columns = None
        self.seed = seed
        if seed is not None:
            warnings.warn(
                f"FedEmbModel(seed={seed!r}) fixes the DP noise: anyone who "
                "knows the seed can subtract it, and the guarantee is void. "
                "Use seed=None for a model you release.",
                ReproducibleNoiseWarning,
                stacklevel=2,
            )
        self.noise_seed = keras.random.SeedGenerator(seed or 0, name="noise_seed")
        self.head_seed = keras.random.SeedGenerator(
            0 if seed is None else seed + 1, name="head_seed"
        )
        self._reseed()
        self.built = True
        self._freeze_settings()

    def _reseed(self):
        # With seed=None the noise comes from OS entropy, drawn afresh at
        # construction and at every fit, so no generator state anyone has
        # seen (a copied model, a checkpoint) predicts later noise.
        if self.seed is None:
            gaussian_sum.reseed_from_entropy(self.noise_seed)
            gaussian_sum.reseed_from_entropy(self.head_seed)

    # -------------------------------------------------------- privacy --

    def privacy_mechanism(self):
        """The user-level mechanism of one round (`kdpemb.privacy`)."""
        if self.num_users is None:
            raise ValueError(
                "The privacy mechanism needs the number of users: pass "
                "num_users to FedEmbModel, or fit it on a "
                "kdpemb.data.VirtualClients first."
            )
        return privacy.virtual_clients(
            self.noise_multiplier,
            clients_per_round=self.clients_per_round,
            num_users=self.num_users,
            users_per_client=self.users_per_client,
            sampling=self.sampling,
            clip_norm=self.clip_norm,
            num_clients=self.num_clients,
        )

    def privacy_statement(self, delta, accountant="pld"):
        """The `PrivacyStatement` (unit: user) of the rounds taken so far."""
        return protocol.privacy_statement(self, delta, accountant)

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
        """`keras.Model.fit`; `x` is a `kdpemb.data.VirtualClients` (or its
        `to_tf_dataset()`, or any dataset of the same round dicts)."""
        from kdpemb.data import VirtualClients

        for name in ("validation_data", "validation_split"):
            if kwargs.get(name):
                raise ValueError(
                    f"FedEmbModel.fit does not take {name}: there is no loss "
                    "to validate. Use the kdpemb.callbacks.RecallAtFAR "
                    "callback on held-out identities."
                )
        _check_strategy(self)
        clients = getattr(x, "_kdpemb_virtual_clients", x)
        if isinstance(clients, VirtualClients):
            self._check_clients(clients)
        elif self.num_users is None:
            raise ValueError(
                "fit a FedEmbModel on a kdpemb.data.VirtualClients (or its "
                "to_tf_dataset()). To feed rounds from another source, pass "
                "num_users (and every sampling setting) to the model: you "
                "then vouch that the rounds are sampled as it states."
            )
        self._reseed()
        return super().fit(x, *args, **kwargs)

    def _check_clients(self, clients):
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
                "(e.g. 4 to 16) in VirtualClients and FedEmbModel."
            )
        num_users, num_clients = self.num_users, self.num_clients
        if num_users is None:
            num_users = clients.num_users
            if num_clients is None and clients.num_clients != math.ceil(
                clients.num_users / clients.users_per_client
            ):
                num_clients = clients.num_clients
        pool = privacy.num_virtual_clients(num_users, self.users_per_client)
        expected = {
            "num_users": (num_users, clients.num_users),
            "clients_per_round": (self.clients_per_round, clients.clients_per_round),
            "users_per_client": (self.users_per_client, clients.users_per_client),
            "sampling": (self.sampling, clients.sampling),
            "local_steps": (self.local_steps, clients.local_steps),
            "num_clients": (num_clients or pool, clients.num_clients),
        }
        if self.aggregation == "full":
            expected["num_classes"] = (self.num_classes, clients.num_classes)
        wrong = {k: v for k, v in expected.items() if v[0] != v[1]}
        if wrong:
            details = "; ".join(
                f"{key}: model {mine!r}, rounds {theirs!r}"
                for key, (mine, theirs) in wrong.items()
            )
            raise ValueError(
                "The FedEmbModel's settings do not match its VirtualClients, so "
                f"its privacy accounting would be wrong ({details}). Build both "
                "from the same values."
            )
        devices = _data_parallel_devices()
        if devices > 1 and clients.max_clients_per_round % devices:
            size = -(-clients.max_clients_per_round // devices) * devices
            raise ValueError(
                f"The rounds hold {clients.max_clients_per_round} client rows, "
                f"which do not split over {devices} devices; build the "
                f"VirtualClients with max_clients_per_round={size}."
            )
        # Validated: adopt the data's counts (once) and the head width.
        with self._settings_unfrozen():
            self.num_users, self.num_clients = num_users, num_clients
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
        )

    def _round(self, data):
        plumbing = backends.current()
        data = _check_round(data, self.local_steps)
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
            columns = self._head_columns or data["labels"].shape[-1] * self.local_steps
            shape = (ops.shape(data["images"])[0], self.embedding_dim, columns)
            heads = (
                fedemb_round.random_heads(shape, self.head_seed)
                if self.head_init == "random"
                else ops.zeros(shape, "float32")
            )
        result = fedemb_round.run_round(trainer, theta, non_trainable, heads, data)

        clipped = result.clipped
        noise = gaussian_sum.gaussian_noise(
            clipped, self.noise_multiplier, self.noise_seed
        )
        share = plumbing.noise_share()
        mean_update = [
            (total + share * n) / self.clients_per_round
            for total, n in zip(clipped.total, noise, strict=True)
        ]
        variables = list(self.backbone.trainable_variables)
        if self.aggregation == "full":
            variables.append(self.head)
        # The server optimizer descends the gradient -Δ (Keras sums the
        # replicas' gradients, so each passes its share).
        self.optimizer.apply([-u for u in mean_update], variables)
        self.private_steps.assign_add(1)

        nonfinite = plumbing.replica_sum(clipped.num_nonfinite)
        logs = {
            "private_steps": self.private_steps.value,
            "nonfinite_updates": nonfinite,
        }
        if self.log_local_loss:
            count = ops.cast(plumbing.replica_sum(clipped.count), "float32")
            logs["local_loss"] = plumbing.replica_sum(result.loss_sum) / ops.maximum(
                count, 1.0
            )
        return logs

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
            "local_steps": self.local_steps,
            "client_optimizer": {
                "learning_rate": learning_rate,
                "momentum": momentum,
                "nesterov": nesterov,
            },
            "head_lr_scale": self.head_lr_scale,
            "head_init": self.head_init,
            "reconstruction_steps": self.reconstruction_steps,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "clients_per_round": self.clients_per_round,
            "users_per_client": self.users_per_client,
            "num_users": self.num_users,
            "num_clients": self.num_clients,
            "sampling": self.sampling,
            "client_parallelism": self.client_parallelism,
            "log_local_loss": self.log_local_loss,
            # A reloaded model draws fresh noise: never reuse the seed.
            "seed": None,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)


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

    if isinstance(
        strategy,
        (
            tf.distribute.MultiWorkerMirroredStrategy,
            tf.distribute.experimental.ParameterServerStrategy,
        ),
    ):
        raise NotImplementedError(
            f"FedEmbModel does not support {type(strategy).__name__} yet: each "
            "worker would sample its own rounds, so one step would mix "
            "independent samples and the accounting would not hold. Use "
            "MirroredStrategy on one machine, or keras.distribution on JAX."
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
    if not isinstance(data, dict) or "client_mask" not in data:
        raise ValueError(
            "FedEmbModel trains on rounds of kdpemb.data.VirtualClients (dicts "
            "with images, labels, example_mask, client_mask, ...); got "
            f"{type(data).__name__}."
        )
    steps = data["images"].shape[1]
    if steps is not None and steps != local_steps:
        raise ValueError(
            f"The rounds hold {steps} local steps per client but the model has "
            f"local_steps={local_steps}; build both with the same value."
        )
    return data

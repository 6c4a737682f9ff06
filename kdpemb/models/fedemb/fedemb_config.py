"""`FedEmbModel`'s construction and saved config: the settings'
checks, the model's variables in their saved order, and `get_config`."""

import numbers

import keras

from kdpemb import _validation as validation
from kdpemb.models import backbone_checks
from kdpemb.models._shared import privacy_plan, private_state
from kdpemb.models.fedemb import fedemb_checks, fedemb_privacy
from kdpemb.privacy import AdaptiveClipping, tree_noise
from kdpemb.privacy.schedule import NOISES

AGGREGATIONS = ("partial", "full")
HEAD_INITS = ("zeros", "random", "class_means")


def construct(
    model,
    backbone,
    embedding_dim,
    *,
    aggregation,
    num_classes,
    client_optimizer,
    head_lr_scale,
    head_init,
    head,
    head_scale,
    head_margin,
    reconstruction_steps,
    clip_norm,
    noise_multiplier,
    schedule,
    delta,
    client_parallelism,
    seed,
    log_local_loss,
    log_nonfinite_updates,
    target_epsilon,
    planned_steps,
    calibrated_noise_multiplier,
    adaptive_clipping,
    noise,
    tree_estimator,
):
    """Checks the settings of `FedEmbModel(...)` and builds its state:
    the backbone (with a projection to `embedding_dim`), the global head,
    the step counter, clip norm and noise seeds, and the schedule's state."""
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
        raise ValueError(f"tree_estimator={tree_estimator!r} is for noise='tree' only.")
    if noise == "tree" and adaptive_clipping is not None:
        raise ValueError(
            "noise='tree' adds to each round the noise of tree nodes drawn "
            "in earlier rounds at their clip norm; adaptive clipping changes "
            "C every round, so the nodes would not share one scale. Use a "
            "fixed clip_norm with noise='tree'."
        )
    model.noise = noise
    model.tree_estimator = tree_estimator
    model.tree_open_noise = None
    if not isinstance(aggregation, str) or aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}."
        )
    head, head_scale, head_margin = validation.check_head(head, head_scale, head_margin)
    if head_init is None:
        # Class means: the utility study's choice for local cosine heads.
        if head == "cosine":
            head_init = "class_means" if aggregation == "partial" else "random"
        else:
            head_init = "zeros"
    if not isinstance(head_init, str) or head_init not in HEAD_INITS:
        raise ValueError(f"head_init must be one of {HEAD_INITS}, got {head_init!r}.")
    if head == "cosine" and head_init == "zeros":
        raise ValueError(
            "head='cosine' normalises the head's columns, and a zero column "
            "has no direction (its cosine logits would be 0/0): pass "
            "head_init='random' or 'class_means' (or leave head_init=None)."
        )
    if aggregation == "full" and head_init == "class_means":
        raise ValueError(
            "head_init='class_means' imprints each client's local head from "
            "its own examples; aggregation='full' (DP-FedAvg) trains one "
            "global head, whose start must not depend on anyone's data. Use "
            "head_init='random' or 'zeros' with aggregation='full'."
        )
    model.head_type, model.head_scale, model.head_margin = (
        head,
        head_scale,
        head_margin,
    )
    model.aggregation = aggregation
    model.head_init = head_init
    if (
        not isinstance(reconstruction_steps, numbers.Integral)
        or isinstance(reconstruction_steps, bool)
        or reconstruction_steps < 0
    ):
        raise ValueError(
            f"reconstruction_steps must be an int >= 0, got {reconstruction_steps!r}."
        )
    model.reconstruction_steps = int(reconstruction_steps)
    model.client_optimizer = fedemb_checks.client_sgd(client_optimizer)
    model.head_lr_scale = validation.check_positive(head_lr_scale, "head_lr_scale")
    model.clip_norm = validation.check_positive(clip_norm, "clip_norm")
    model.delta = None if delta is None else validation.check_delta(delta)
    (
        model.noise_multiplier,
        model.target_epsilon,
        model.planned_steps,
        model.calibrated_noise_multiplier,
    ) = privacy_plan.check_settings(
        noise_multiplier,
        target_epsilon,
        model.delta,
        planned_steps,
        calibrated_noise_multiplier,
    )
    if client_parallelism not in (None, "all"):
        client_parallelism = validation.check_positive_int(
            client_parallelism, "client_parallelism"
        )
    model.client_parallelism = client_parallelism
    model.log_local_loss = validation.check_bool(log_local_loss, "log_local_loss")
    model.log_nonfinite_updates = validation.check_bool(
        log_nonfinite_updates, "log_nonfinite_updates"
    )
    model._schedule = None
    if schedule is not None:
        fedemb_privacy.adopt_schedule(model, fedemb_checks.as_schedule(schedule))

    if embedding_dim is not None:
        embedding_dim = validation.check_positive_int(
            embedding_dim,
            "embedding_dim",
            "It is the width of the embedding (None: the backbone's output).",
        )
    if num_classes is not None:
        num_classes = validation.check_positive_int(num_classes, "num_classes")
    backbone_checks.check_backbone(backbone)
    output_dim = backbone_checks.output_dim(backbone)
    if embedding_dim is not None and embedding_dim != output_dim:
        backbone = keras.Sequential(
            [backbone, keras.layers.Dense(int(embedding_dim), name="projection")],
            name=f"{backbone.name}_embedding",
        )
        backbone.build(backbone_checks.input_shape(backbone.layers[0]))
        output_dim = int(embedding_dim)
    model.backbone = backbone
    model.embedding_dim = output_dim

    if aggregation == "full":
        if num_classes is None:
            raise ValueError(
                "aggregation='full' (DP-FedAvg) trains a global head: pass "
                "num_classes, the number of identities in the training data."
            )
        model.num_classes = validation.check_positive_int(num_classes, "num_classes")
        model.head = model.add_weight(
            shape=(output_dim, model.num_classes),
            initializer=(
                "zeros"
                if head_init == "zeros"
                else keras.initializers.RandomNormal(stddev=output_dim**-0.5)
            ),
            name="head",
        )
    else:
        model.num_classes = None if num_classes is None else int(num_classes)
        model.head = None

    model.private_steps = private_state.add_private_steps(model)
    model._head_columns = None
    model.seed = seed
    model.adaptive_clipping = (
        None
        if adaptive_clipping is None
        else AdaptiveClipping.from_config(adaptive_clipping)
    )
    names = ("noise_seed", "head_seed")
    if model.adaptive_clipping is not None:
        # C is model state: saved, restored, and moved by every round.
        model.current_clip_norm = private_state.add_state(
            model, "current_clip_norm", initializer=model.clip_norm
        )
        names += ("count_seed",)  # The count's noise: its own stream.
    generators = private_state.noise_seed_generators(
        seed,
        names,
        "FedEmbModel",
        stacklevel=4,  # Through `construct`.
    )
    model.noise_seed, model.head_seed = generators[:2]
    if model.adaptive_clipping is not None:
        model.count_seed = generators[2]
    if model.schedule is not None:
        fedemb_privacy.build_tree_state(model)
        fedemb_privacy.build_epoch_state(model)


def config(model):
    """The saved config of `model`, after `keras.Model`'s own keys."""
    learning_rate, momentum, nesterov = model.client_optimizer
    return {
        "backbone": keras.saving.serialize_keras_object(model.backbone),
        "aggregation": model.aggregation,
        "num_classes": model.num_classes,
        "client_optimizer": {
            "learning_rate": learning_rate,
            "momentum": momentum,
            "nesterov": nesterov,
        },
        "head_lr_scale": model.head_lr_scale,
        "head_init": model.head_init,
        "head": model.head_type,
        "head_scale": model.head_scale,
        "head_margin": model.head_margin,
        "reconstruction_steps": model.reconstruction_steps,
        "clip_norm": model.clip_norm,
        "noise_multiplier": (
            None if model.target_epsilon is not None else model.noise_multiplier
        ),
        "schedule": None if model.schedule is None else model.schedule.get_config(),
        "delta": model.delta,
        "client_parallelism": model.client_parallelism,
        "log_local_loss": model.log_local_loss,
        "log_nonfinite_updates": model.log_nonfinite_updates,
        # A reloaded model draws fresh noise: never reuse the seed.
        "seed": None,
        "target_epsilon": model.target_epsilon,
        "planned_steps": model.planned_steps,
        "calibrated_noise_multiplier": model.calibrated_noise_multiplier,
        "adaptive_clipping": (
            None
            if model.adaptive_clipping is None
            else model.adaptive_clipping.get_config()
        ),
        "noise": model.noise,
        "tree_estimator": model.tree_estimator,
    }

"""`FedEmbModel`'s round (its `train_step`): the clients' local training
on the devices (`fedemb_round`), the clipped sum, the noise (independent
or tree), adaptive clipping, the server step, and the checks that make a
round release nothing (past the plan, mixed hosts, not of the epoch)."""

import keras
from keras import ops

from kdpemb.models._shared import backends, hosts_agreement
from kdpemb.models.fedemb import fedemb_checks, fedemb_privacy, fedemb_round
from kdpemb.privacy import gaussian_sum, quantile_clip, tree_noise


def default_parallelism():
    """`client_parallelism=None`: "all" on a JAX GPU/TPU or distribution, else 1."""
    if keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() in ("gpu", "tpu"):
            return "all"
        if keras.distribution.distribution() is not None:
            return "all"
    return 1


def round_config(model, num_rows):
    """The `fedemb_round.RoundConfig` of a round of `num_rows` client rows."""
    learning_rate, momentum, nesterov = model.client_optimizer
    parallelism = model.client_parallelism or default_parallelism()
    if parallelism == "all":
        parallelism = num_rows or 1
    return fedemb_round.RoundConfig(
        learning_rate=learning_rate,
        momentum=momentum,
        nesterov=nesterov,
        head_lr_scale=model.head_lr_scale,
        reconstruction_steps=model.reconstruction_steps,
        clip_norm=model.clip_norm,
        client_parallelism=int(parallelism),
        full_aggregation=model.aggregation == "full",
        head=model.head_type,
        head_scale=model.head_scale,
        head_margin=model.head_margin,
        class_mean_heads=model.head_init == "class_means",
    )


def round_inputs(model, data, local_steps, head_columns=None):
    """`(trainer, theta, non_trainable, heads, data)` of a round: the
    local training as the model runs it, from the server's weights."""
    plumbing = backends.current()
    num_rows = data["images"].shape[0]
    config = round_config(model, num_rows)
    trainer = fedemb_round.ClientTrainer(
        model.backbone, config, plumbing.value_and_grad
    )
    theta = [v.value for v in model.backbone.trainable_variables]
    non_trainable = [v.value for v in model.backbone.non_trainable_variables]
    if model.aggregation == "full":
        heads = model.head.value
        data = dict(
            data,
            labels=data["global_labels"],
            num_local_classes=ops.full_like(
                data["num_local_classes"], model.num_classes
            ),
        )
    else:
        columns = head_columns or (data["labels"].shape[-1] * local_steps)
        shape = (ops.shape(data["images"])[0], model.embedding_dim, columns)
        heads = (
            fedemb_round.random_heads(shape, model.head_seed)
            if model.head_init in ("random", "class_means")
            else ops.zeros(shape, "float32")
        )
    return trainer, theta, non_trainable, heads, data


def train_round(model, data):
    """One round (`FedEmbModel.train_step`): local training, clipped sum,
    noise, server step; returns the logs."""
    plumbing = backends.current()
    schedule = fedemb_privacy.known_schedule(model)
    data = fedemb_checks.check_round(data, schedule.local_steps)
    # Rounds of no known shape until now (e.g. a PyDataset of rounds).
    fedemb_checks.check_image_shape(
        model.backbone, data["images"].shape[3:], "the round"
    )
    trainer, theta, non_trainable, heads, data = round_inputs(
        model, data, schedule.local_steps, model._head_columns
    )
    adaptive = model.adaptive_clipping is not None
    # Adaptive clipping: this round clips to, and noises with, the C
    # before the round's update of C.
    clip_norm = model.current_clip_norm.value if adaptive else None
    result = run_round_on_devices(
        plumbing, trainer, theta, non_trainable, heads, data, clip_norm
    )

    clipped = result.clipped
    hosts_aligned = aligned_hosts(model, data)
    within_plan = both(
        both(fedemb_privacy.within_plan(model), hosts_aligned),
        aligned_epoch(model, data, hosts_aligned),
    )
    if model.noise == "tree":
        noise = tree_round_noise(model, clipped, within_plan)
    else:
        noise = gaussian_sum.gaussian_noise(
            clipped, model.noise_multiplier, model.noise_seed
        )
    share = plumbing.noise_share()
    if adaptive:
        clients = schedule.sample_size
        count_noise = quantile_clip.count_noise(
            model.adaptive_clipping.count_stddev_for(clients), model.count_seed
        )
        noisy_count = plumbing.replica_sum(
            quantile_clip.centred_count(clipped) + share * count_noise
        )
        next_clip_norm = quantile_clip.next_clip_norm(
            clip_norm, noisy_count, clients, model.adaptive_clipping
        )
        if within_plan is not None:
            next_clip_norm = ops.where(within_plan, next_clip_norm, clip_norm)
        model.current_clip_norm.assign(next_clip_norm)
    # The global sum (TensorFlow: over the replicas) and the noise once:
    # every replica draws the same from the same seed state.
    mean_update = [
        (plumbing.replica_sum(total) + n) / schedule.sample_size
        for total, n in zip(clipped.total, noise, strict=True)
    ]
    if within_plan is not None:
        # A round past the plan releases nothing computed from the data
        # (a zero update; momentum still moves the weights) and is not
        # counted.
        mean_update = [
            ops.where(within_plan, u, ops.zeros_like(u)) for u in mean_update
        ]
    variables = fedemb_privacy.noised_variables(model)
    # The server optimizer descends the gradient -Δ, once: on TensorFlow,
    # whose optimizer sums the replicas' gradients, the first replica passes
    # it and the others zeros, so that whatever the optimizer does before
    # that sum (clipnorm, clipvalue) sees the noised update only.
    model.optimizer.apply(
        plumbing.optimizer_share([-u for u in mean_update]), variables
    )
    model.private_steps.assign_add(
        1 if within_plan is None else ops.cast(within_plan, "int32")
    )

    # Only opted-in logs are computed from private data without noise.
    logs = {"private_steps": model.private_steps.value}
    if adaptive:  # Computed from the noisy count only.
        logs["clip_norm"] = model.current_clip_norm.value
    if model.log_nonfinite_updates:
        logs["nonfinite_updates"] = plumbing.replica_sum(clipped.num_nonfinite)
    if model.log_local_loss:
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


def aligned_hosts(model, data):
    """On several hosts, whose rounds carry their index on every row
    (`VirtualClients.host_round`): whether every host's rows are of the
    same round (a traced bool, the same on every replica); else None.

    A round of mixed rounds would let a user's data count twice and is
    not the sample the accounting assumes: it releases nothing, is not
    counted, and `fit` raises after it."""
    if "round_index" not in data:
        return None
    return hosts_agreement.aligned(data["round_index"])


def aligned_epoch(model, data, hosts_aligned=None):
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
    if model.schedule.sampling != "epochs":
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
    rounds = model.schedule.steps_per_epoch
    starts = ops.equal(model.private_steps.value % rounds, 0)
    data_epoch = ops.cast(data["epoch_id"][0], "int32")
    data_position = ops.cast(data["round_in_epoch"][0], "int32")
    this_round = ops.cast(ops.equal(ops.arange(rounds), data_position), "int32")
    taken = ops.where(starts, 0, model.epoch_rounds_taken.value)
    aligned = ops.logical_and(
        ops.logical_or(starts, ops.equal(data_epoch, model.data_epoch.value)),
        ops.logical_and(
            ops.equal(ops.sum(this_round), 1),  # A position in [0, R).
            ops.equal(ops.sum(taken * this_round), 0),  # Not taken yet.
        ),
    )
    if hosts_aligned is not None:  # A mixed round takes no position.
        aligned = ops.logical_and(aligned, hosts_aligned)
    model.data_epoch.assign(ops.where(aligned, data_epoch, model.data_epoch.value))
    model.epoch_rounds_taken.assign(
        ops.where(
            aligned, ops.maximum(taken, this_round), model.epoch_rounds_taken.value
        )
    )
    model.misaligned_rounds.assign_add(1 - ops.cast(aligned, "int32"))
    return aligned


def tree_round_noise(model, clipped, within_plan):
    """This round's tree noise; moves the tree's state (unless the round
    is past the plan: then nothing moves)."""
    steps_per_tree = fedemb_privacy.known_schedule(model).steps_per_epoch
    round_in_tree = model.private_steps.value % steps_per_tree + 1
    state = [v.value for v in model.tree_open_noise]
    noise, new_state = tree_noise.tree_noise(
        clipped,
        model.noise_multiplier,
        model.noise_seed,
        state,
        round_in_tree,
        efficient=model.tree_estimator == "efficient",
    )
    for variable, old, new in zip(model.tree_open_noise, state, new_state, strict=True):
        variable.assign(
            new if within_plan is None else ops.where(within_plan, new, old)
        )
    return noise


def run_round_on_devices(plumbing, trainer, theta, non_trainable, heads, data, clip):
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


def both(first, second):
    """`first and second` of two traced bools, where None means true."""
    if first is None or second is None:
        return second if first is None else first
    return ops.logical_and(first, second)

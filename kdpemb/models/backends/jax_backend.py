"""JAX plumbing: `jax.value_and_grad` and the stateless train step."""

import jax
import keras


def value_and_grad(fn):
    """`fn(params, *args)` -> `(value, grads)`, differentiating `params`."""
    return jax.value_and_grad(fn)


def replica_sum(value):
    """Identity: a `keras.distribution` program is global (SPMD), so a sum
    over the client axis already spans every device."""
    return value


def noise_share():
    """1.0: the global program draws the noise once."""
    return 1.0


def train_step(model, args, step):
    """Runs `step(data)` with the state Keras passes in, and returns it updated.

    JAX calls `train_step(state, data)` with `state` = (trainable,
    non-trainable, optimizer, metrics variable values); inside a
    `StatelessScope` the model's variables read and write those values.
    """
    state, data = args
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    return _stateless(groups, state, step, data)


def test_step(model, args, step):
    """Runs `step(data)` with the evaluation state Keras passes in.

    JAX calls `test_step(state, data)` with `state` = (trainable,
    non-trainable, metrics variable values); only the metrics change.
    """
    state, data = args
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.metrics_variables,
    )
    return _stateless(groups, state, step, data)


def _stateless(groups, state, step, data):
    """`step(data)` inside a `StatelessScope` mapping `groups` to `state`;
    returns its logs and the groups' new values."""
    mapping = [
        pair
        for variables, values in zip(groups, state, strict=True)
        for pair in zip(variables, values, strict=True)
    ]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        logs = step(data)
    new_state = tuple(
        [scope.get_current_value(v) for v in variables] for variables in groups
    )
    return logs, new_state

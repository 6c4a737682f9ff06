"""What the hosts of a multi-host job check together: one model, one plan,
and every step's rows from one sample.

Written once for `FedEmbModel` and `DPModel`:

- `variables_digest(model)`: a digest of every variable (noise seeds and
  `private_steps` included) to compare across hosts;
- `HostsGuard(hosts, settings)`: a callback that, once the user's
  callbacks have begun (a backup may have been restored), refuses hosts
  whose models, privacy settings (`settings(model)`, a str) or starting
  epoch differ, before the first step; then stops the fit at the first
  step that reports `misaligned_hosts` (that step released nothing);
- `aligned(index)`: inside a step, whether every row of every host
  carries the same batch index (a traced bool, alike on every replica).

Example:

>>> from kdpemb.distribute import Hosts
>>> guard = HostsGuard(Hosts.single(), settings=lambda model: "")
>>> guard.misaligned_steps
0
"""

import hashlib

import keras
import numpy as np
from keras import ops

from kdpemb.models._shared import backends


def variables_digest(model):
    """A digest of every variable of `model` (weights, seeds,
    `private_steps`, and the optimizer's state once it is built) by
    position, shape, dtype and value, to compare across hosts (Keras'
    generated names may differ between processes)."""
    digest = hashlib.blake2b(digest_size=32)
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    for position, variable in enumerate(variables):
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value))
        digest.update(repr((position, value.shape, str(value.dtype))).encode())
        digest.update(value.tobytes())
    return digest.digest()


class HostsGuard(keras.callbacks.Callback):
    """After the user's callbacks (kdpemb's own guards follow it): refuses
    hosts that disagree before the first step, and stops the fit at the
    first step whose hosts served rows of different batches."""

    def __init__(self, hosts, settings):
        super().__init__()
        self.hosts, self.settings = hosts, settings
        self.misaligned_steps = 0

    def on_train_begin(self, logs=None):
        model = self.model
        self.hosts.check_agree(
            {
                "model variables": variables_digest(model),
                "privacy settings": self.settings(model),
                "initial epoch": repr(getattr(model, "_initial_epoch", None)),
            }
        )

    def on_train_batch_end(self, batch, logs=None):
        if logs and float(np.max(logs.get("misaligned_hosts", 0))) > 0:
            self.misaligned_steps += 1
            self.model.stop_training = True


def aligned(index):
    """Whether every row of `index` (int per row; on TensorFlow this
    replica's rows) holds one value, the same on every replica (a traced
    bool, the same everywhere). JAX: the rows of every host are one global
    array. TensorFlow: each replica compares its rows with the first
    replica's value (summed from the first replica alone)."""
    plumbing = backends.current()
    index = ops.cast(index, "int32")
    low, high = ops.min(index), ops.max(index)
    first = ops.cast(plumbing.noise_share(), "int32")  # 1 on the first replica.
    firsts = plumbing.replica_sum(first * low)
    differs = ops.logical_or(ops.not_equal(low, high), ops.not_equal(low, firsts))
    return ops.equal(plumbing.replica_sum(ops.cast(differs, "int32")), 0)

"""The state every private model keeps: its step count and its noise seeds.

Written once for every kdpemb model (and usable by your own, see
`kdpemb.privacy.protocol`):

- `add_private_steps(model)`: the non-trainable int32 `private_steps`
  variable. It is model state, so `save`, `save_weights` and checkpoints
  keep it, and a restored model keeps counting. Under `tf.distribute` only
  the first replica's value is kept.
- `noise_seed_generators(seed, names, owner)`: the
  `keras.random.SeedGenerator`s of DP randomness (noise, sampling, random
  heads). Assign them to attributes of the model, so that Keras tracks
  their state (a JAX train step must carry it). With `seed=None` they are
  filled from OS entropy; call `reseed(generators, seed)` again at every
  `fit`, so neither `keras.utils.set_random_seed`, a copied model nor a
  saved file predicts later draws. A fixed seed warns
  `ReproducibleNoiseWarning`.

Example:

>>> import keras
>>> class Tiny(keras.Model):
...     def __init__(self, seed=None, **kwargs):
...         super().__init__(**kwargs)
...         self.private_steps = add_private_steps(self)
...         (self.noise_seed,) = noise_seed_generators(seed, ("noise",), "Tiny")
>>> model = Tiny()
>>> int(keras.ops.convert_to_numpy(model.private_steps))
0
>>> any(v is model.noise_seed.state for v in model.non_trainable_variables)
True
"""

import warnings

import keras

from kdpemb import _validation as validation
from kdpemb import distribute
from kdpemb.errors import ReproducibleNoiseWarning
from kdpemb.privacy import gaussian_sum


def add_state(model, name, shape=(), dtype="float32", initializer=0):
    """Adds a non-trainable variable of the privacy machinery to `model`.

    Saved and restored with the model; under a strategy every replica
    computes the same value and the first replica's is kept. `initializer`
    is a constant.
    """
    return model.add_weight(
        shape=shape,
        dtype=dtype,
        initializer=keras.initializers.Constant(initializer),
        trainable=False,
        aggregation="only_first_replica",
        name=name,
    )


def add_private_steps(model):
    """Adds the `private_steps` counter to `model` and returns it."""
    return add_state(model, "private_steps", dtype="int32")


def noise_seed_generators(seed, names, owner, stacklevel=3):
    """One `SeedGenerator` per name, filled from OS entropy unless `seed` is set.

    Args:
        seed: int or None. None (for any model you release) fills every
            generator from OS entropy. An int derives generator i from
            `seed + i` and warns: tests only.
        names: sequence of str. The generators' names.
        owner: str. The model's name, for the warning.
        stacklevel: int. Of the warning: 3 points at the line that built a
            model whose `__init__` calls this; one more per helper between.

    Returns:
        list of `keras.random.SeedGenerator`, the same on every host of a
        multi-host job (`kdpemb.distribute`): the chief draws the entropy.
    """
    seed = validation.check_seed(seed)
    if seed is not None:
        warnings.warn(
            f"{owner}(seed={seed!r}) fixes the DP noise and sampling: anyone "
            "who knows the seed can predict them, and the guarantee is void. "
            "Use seed=None for a model you release.",
            ReproducibleNoiseWarning,
            stacklevel=stacklevel,
        )
    generators = [
        keras.random.SeedGenerator(0 if seed is None else int(seed) + index, name=name)
        for index, name in enumerate(names)
    ]
    # On several hosts every host must hold the same state: the chief's.
    return reseed(generators, seed, distribute.current_hosts().shared_bits)


def reseed(generators, seed, randbits=None):
    """Fresh OS entropy in every generator when `seed` is None; returns them.

    `randbits(bits)` draws the entropy (default `secrets.randbits`; on
    several hosts the chief's draw, `kdpemb.distribute.Hosts.shared_bits`).
    """
    if seed is None:
        for generator in generators:
            gaussian_sum.reseed_from_entropy(generator, randbits)
    return generators

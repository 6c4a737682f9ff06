"""A tiny but real DP-SGD model that implements kdpemb's privacy protocol.

For tests and benchmarks of privacy callbacks on both backends; kdpemb's
real DP models replace it for training. Importing this module imports Keras.
"""

import keras
import numpy as np
from keras import ops

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.models._shared import backends, private_state
from kdpemb.privacy import gaussian_sum


@keras.saving.register_keras_serializable(package="kdpemb.testing")
class ToyDPRegressor(keras.Model):
    """Linear regression trained with Poisson-sampled DP-SGD.

    Every batch must be the whole training set of `num_examples` examples
    (see `FullBatchSequence`). Each `train_step` draws a Poisson sample
    (each example independently with probability q), computes the gradient
    of ½(w·x + b − y)² of each sampled example in closed form, clips each
    to `clip_norm`, sums, adds N(0, (z·C)² I) once, divides by the expected
    batch size q·N and hands the result to the compiled optimizer. It then
    adds 1 to `private_steps`, which is all it logs: a loss on the private
    data would itself be a release.

    The sampling and the noise come from OS entropy, drawn afresh at
    construction and at every `fit`, unless `seed` is given.

    Args:
        num_examples: int. N, the size of the private training set.
        num_features: int. Input dimension.
        noise_multiplier: float. z.
        sampling_probability: float. q.
        clip_norm: float. C. Defaults to 1.
        seed: int or None. Seed of the sampling and noise (tests only: it
            warns `ReproducibleNoiseWarning`).

    Example:

    >>> import kdpemb
    >>> model = kdpemb.testing.ToyDPRegressor(
    ...     num_examples=32, num_features=3, noise_multiplier=1.0,
    ...     sampling_probability=0.25)
    >>> model.compile(optimizer="sgd")
    >>> data = kdpemb.testing.toy_regression_data(32, 3, steps_per_epoch=1)
    >>> history = model.fit(data, epochs=1, verbose=0)  # one private step
    >>> kdpemb.privacy.protocol.read_private_steps(model)
    1
    """

    def __init__(
        self,
        num_examples,
        num_features,
        noise_multiplier,
        sampling_probability,
        clip_norm=1.0,
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_examples = int(num_examples)
        self.num_features = int(num_features)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling_probability = validation.check_probability(sampling_probability)
        self.clip_norm = float(clip_norm)
        self.seed = seed
        self.privacy_mechanism()  # Validates the schedule now.
        self.kernel = self.add_weight(
            shape=(self.num_features,), initializer="zeros", name="kernel"
        )
        self.bias = self.add_weight(shape=(), initializer="zeros", name="bias")
        self.private_steps = private_state.add_private_steps(self)
        self.sampling_seed, self.noise_seed = private_state.noise_seed_generators(
            seed, ("sampling_seed", "noise_seed"), "ToyDPRegressor"
        )
        self.built = True

    def privacy_mechanism(self):
        schedule = privacy.Schedule.examples(
            self.num_examples, self.sampling_probability * self.num_examples
        )
        return schedule.privacy_mechanism(self.noise_multiplier, self.clip_norm)

    def call(self, x):
        return ops.matmul(x, self.kernel) + self.bias

    def train_step(self, *args):
        # TensorFlow calls train_step(data); JAX calls train_step(state, data).
        return backends.current().train_step(
            self, args, lambda data: self._private_update(*data[:2])
        )

    def _private_update(self, x, y):
        if x.shape[0] not in (None, self.num_examples):
            raise ValueError(
                f"Each batch must hold all {self.num_examples} examples (the "
                f"Poisson sample is drawn inside the step); got {x.shape[0]}. "
                "Feed the data with kdpemb.testing.FullBatchSequence."
            )
        # Where the batch size is not static (tf.function), this fails at run
        # time on any other batch size.
        x = ops.reshape(x, (self.num_examples, self.num_features))
        uniform = keras.random.uniform((self.num_examples,), seed=self.sampling_seed)
        sampled = uniform < self.sampling_probability
        residual = self(x) - ops.reshape(ops.cast(y, x.dtype), (-1,))
        # Example i's gradient of ½(w·x + b − y)² is r_i (x_i, 1).
        norms = ops.abs(residual) * ops.sqrt(ops.sum(x * x, axis=1) + 1.0)

        def weighted_sum(factors):
            weights = ops.where(factors > 0, factors * residual, 0.0)
            return [ops.matmul(weights, x), ops.sum(weights)]

        clipped = gaussian_sum.clipped_sum_from_norms(
            norms, self.clip_norm, weighted_sum, mask=sampled
        )
        noisy = gaussian_sum.add_gaussian_noise(
            clipped, self.noise_multiplier, self.noise_seed
        )
        denominator = self.sampling_probability * self.num_examples
        self.optimizer.apply(
            [total / denominator for total in noisy], [self.kernel, self.bias]
        )
        self.private_steps.assign_add(1)
        return {"private_steps": self.private_steps.value}

    def fit(self, *args, **kwargs):
        self._reseed()
        return super().fit(*args, **kwargs)

    def _reseed(self):
        # OS entropy at every fit: neither keras.utils.set_random_seed nor a
        # saved file predicts the draws.
        private_state.reseed([self.sampling_seed, self.noise_seed], self.seed)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_examples=self.num_examples,
            num_features=self.num_features,
            noise_multiplier=self.noise_multiplier,
            sampling_probability=self.sampling_probability,
            clip_norm=self.clip_norm,
            seed=None,  # A loaded model draws fresh noise: never reuse the seed.
        )
        return config


class FullBatchSequence(keras.utils.PyDataset):
    """Yields the whole dataset `steps_per_epoch` times per epoch.

    Example:

    >>> import kdpemb
    >>> data = kdpemb.testing.toy_regression_data(32, 3, steps_per_epoch=2)
    >>> isinstance(data, kdpemb.testing.FullBatchSequence), len(data)
    (True, 2)
    >>> [array.shape for array in data[0]]  # every batch is the whole set
    [(32, 3), (32,)]
    """

    def __init__(self, x, y, steps_per_epoch, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.steps_per_epoch = x, y, int(steps_per_epoch)

    def __len__(self):
        return self.steps_per_epoch

    def __getitem__(self, index):
        if not 0 <= index < self.steps_per_epoch:
            raise IndexError(index)
        return self.x, self.y


def toy_regression_data(num_examples, num_features, steps_per_epoch, seed=0):
    """A noisy linear regression set, as a `FullBatchSequence`.

    Example:

    >>> import kdpemb
    >>> x, y = kdpemb.testing.toy_regression_data(16, 2, steps_per_epoch=1)[0]
    >>> x.shape, y.shape
    ((16, 2), (16,))
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, num_features)).astype("float32")
    w = rng.normal(size=(num_features,)).astype("float32")
    y = (x @ w + 0.1 * rng.normal(size=num_examples)).astype("float32")
    return FullBatchSequence(x, y, steps_per_epoch)

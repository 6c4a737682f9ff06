"""Restoring a custom-loss model's optimizer when it is loaded."""

import keras


class RestoresOptimizer:
    """Mixin for models whose `compile` takes an optimizer and no loss.

    Keras saves the `compile` arguments; on loading it calls
    `compile_from_config`, whose default would pass the (absent) loss back.
    This one re-compiles with the saved optimizer alone and builds it on the
    model's variables, so that its slots can receive the saved values.
    """

    def compile_from_config(self, config):
        """Restores the optimizer when a saved model is loaded."""
        config = keras.saving.deserialize_keras_object(config)
        config.pop("loss", None)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

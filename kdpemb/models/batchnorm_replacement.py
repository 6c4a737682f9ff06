"""Makes a backbone with BatchNormalization trainable under DP.

A trainable BatchNormalization mixes the examples of a batch (which breaks
per-example clipping) and updates its moving statistics from private
batches without clipping or noise, so `check_backbone` refuses it.
`replace_batchnorm` fixes such a model: it rebuilds it with
GroupNormalization (per-example, no statistics), or freezes the
BatchNormalization layers when their statistics come from public data.
"""

import math

import keras

# The class `keras.models.clone_model` itself dispatches on; Keras does not
# export it, and `keras.Model(inputs, outputs)` instances are of this class.
from keras.src.models.functional import Functional

from kdpemb._validation import check_positive_int
from kdpemb.models._shared.layer_taps import all_layers

MODES = ("group_norm", "freeze")


def replace_batchnorm(model, mode="group_norm", groups=32):
    """Replaces or freezes every BatchNormalization layer of `model`.

    `mode="group_norm"` returns a new model (`model` is left unchanged) in
    which every `keras.layers.BatchNormalization`, nested models included
    (e.g. a `keras.applications` backbone used as a layer), becomes a
    `keras.layers.GroupNormalization` with the same name, axis, epsilon,
    center, scale, regularizers, constraints, dtype and `trainable` flag,
    and the BatchNormalization's gamma and beta; its moving statistics are
    dropped. The number of groups is the largest divisor of the layer's
    channel count that is <= `groups` (GroupNormalization needs a divisor):
    48 channels with `groups=32` give 24 groups, 7 channels give 7. Every
    other layer is a copy with the original's weights. Only Sequential and
    functional models can be rebuilt so, subclasses of `keras.Model` built
    functionally included (keras-hub and keras-cv backbones: they come back
    as plain functional models with the same layers); a subclassed model
    (or a layer holding BatchNormalization inside one, such as keras-hub's
    MobileNet blocks) raises `TypeError`: build it with GroupNormalization,
    or freeze its BatchNormalization. A model without any
    BatchNormalization is returned as is: there is nothing to replace.

    `mode="freeze"` changes `model` in place and returns it: every
    BatchNormalization gets `trainable = False`, so Keras normalises with
    the stored moving statistics, in training too, and never updates them.
    This is sound only if those statistics came from public data (e.g.
    ImageNet-pretrained weights), never from the private data.

    Either way, `check_backbone` accepts the result.

    Args:
        model: `keras.Model` (built: it needs the channel counts).
        mode: `"group_norm"` (the default) or `"freeze"`.
        groups: int >= 1. The most groups per GroupNormalization. Defaults
            to 32.

    Returns:
        The new model (`"group_norm"`) or `model` itself (`"freeze"`).

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(6, 3),
    ...                           keras.layers.BatchNormalization()])
    >>> private = replace_batchnorm(model, groups=4)
    >>> [type(layer).__name__ for layer in private.layers]
    ['Conv2D', 'GroupNormalization']
    >>> private.layers[1].groups  # the largest divisor of 6 that is <= 4
    3
    >>> type(model.layers[1]).__name__  # the input is unchanged
    'BatchNormalization'
    """
    if mode not in MODES:
        raise ValueError(
            f"mode must be one of {MODES}, got {mode!r}: 'group_norm' rebuilds "
            "the model with GroupNormalization, 'freeze' freezes the "
            "BatchNormalization layers (public statistics only)."
        )
    groups = check_positive_int(
        groups, "groups", "It is the most groups per GroupNormalization, e.g. 32."
    )
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"model must be a keras.Model (or layer), got {type(model).__name__}."
        )
    if mode == "freeze":
        for layer in all_layers(model):
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False
        return model
    if not any(
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in all_layers(model)
    ):
        return model
    if not _rebuildable(model):
        raise TypeError(_cannot_rebuild(model))
    return _Rebuild(groups).run(model)


def group_count(channels, groups):
    """The largest divisor of `channels` that is <= `groups`.

    >>> group_count(48, 32), group_count(7, 32), group_count(64, 32)
    (24, 7, 32)
    """
    return max(d for d in range(1, min(channels, groups) + 1) if channels % d == 0)


def _rebuildable(model):
    return isinstance(model, (keras.Sequential, Functional))


def _cannot_rebuild(layer, inside=None):
    where = f" (it holds BatchNormalization inside {inside!r})" if inside else ""
    return (
        f"replace_batchnorm cannot rebuild {type(layer).__name__} "
        f"{layer.name!r} automatically{where}: only Sequential and functional "
        "models, nested ones included, can be rebuilt layer by layer. Build "
        "it with keras.layers.GroupNormalization instead of "
        "BatchNormalization, or, if the BatchNormalization statistics come "
        "from public data (e.g. ImageNet-pretrained weights), use "
        "replace_batchnorm(model, mode='freeze')."
    )


def _copy_of(layer):
    """A new layer from `layer`'s config, or an error naming the layer."""
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as error:
        raise TypeError(
            f"replace_batchnorm cannot copy {type(layer).__name__} "
            f"{layer.name!r}: {type(layer).__name__}.from_config(layer."
            f"get_config()) fails ({type(error).__name__}: {error}). Fix the "
            "layer's get_config (or from_config), or build the model with "
            "keras.layers.GroupNormalization instead of BatchNormalization."
        ) from error


def _inputs_like(model):
    # New inputs with the names of the model's input layers: left to itself,
    # clone_model names an unnamed input after its tensor ("keras_tensor_3"
    # in place of "input_layer_3").
    input_layers = {
        id(layer.output): layer
        for layer in model.layers
        if isinstance(layer, keras.layers.InputLayer)
    }

    def new_input(tensor):
        layer = input_layers[id(tensor)]
        return keras.layers.InputLayer.from_config(layer.get_config()).output

    return keras.tree.map_structure(new_input, model.input)


class _Rebuild:
    """One rebuild: clones models level by level, then copies the weights.

    `keras.models.clone_model` calls `clone` on each layer of one level;
    nested Sequential and functional models are cloned by calling it again.
    Layers are memoised by identity, so a layer shared across levels stays
    shared. Weights are copied once the whole graph is built.
    """

    def __init__(self, groups):
        self.groups = groups
        self.clones = {}
        self.pairs = []

    def run(self, model):
        new = self.clone(model)
        for old_layer, new_layer in self.pairs:
            if isinstance(old_layer, keras.layers.BatchNormalization):
                if old_layer.scale:
                    new_layer.gamma.assign(old_layer.gamma)
                if old_layer.center:
                    new_layer.beta.assign(old_layer.beta)
            elif old_layer.weights:
                new_layer.set_weights(old_layer.get_weights())
        return new

    def clone(self, layer):
        if id(layer) in self.clones:
            return self.clones[id(layer)]
        if isinstance(layer, keras.Sequential):
            new = keras.models.clone_model(layer, clone_function=self.clone)
        elif isinstance(layer, Functional):
            new = keras.models.clone_model(
                layer,
                input_tensors=_inputs_like(layer),
                clone_function=self.clone,
                call_function=self.call,
            )
            if not layer.trainable:
                new.trainable = False  # clone_model keeps it for Sequential only
        elif isinstance(layer, keras.layers.BatchNormalization):
            new = self.group_norm(layer)
            self.pairs.append((layer, new))
        elif not isinstance(layer, keras.layers.Layer):
            # An operation of the graph without weights (`x + y`,
            # `keras.ops.pad` on a symbolic tensor).
            new = layer.__class__.from_config(layer.get_config())
        else:
            for inner in all_layers(layer):
                if isinstance(inner, keras.layers.BatchNormalization):
                    raise TypeError(_cannot_rebuild(layer, inside=inner.name))
            new = _copy_of(layer)
            self.pairs.append((layer, new))
        self.clones[id(layer)] = new
        return new

    def call(self, layer, *args, **kwargs):
        # A functional model records the call of a layer fed by another
        # layer with `mask=None`; BatchNormalization.call takes a mask,
        # GroupNormalization.call does not (it passes masks on unchanged).
        if isinstance(layer, keras.layers.GroupNormalization):
            kwargs.pop("mask", None)
        return layer(*args, **kwargs)

    def group_norm(self, layer):
        if not layer.built:
            raise ValueError(
                f"BatchNormalization {layer.name!r} is not built, so its channel "
                "count is unknown: give the model a keras.Input (or call it on "
                "a batch) before replace_batchnorm."
            )
        config = layer.get_config()
        keep = (
            "name",
            "trainable",
            "dtype",
            "axis",
            "epsilon",
            "center",
            "scale",
            "beta_initializer",
            "gamma_initializer",
            "beta_regularizer",
            "gamma_regularizer",
            "beta_constraint",
            "gamma_constraint",
        )
        channels = math.prod(layer.moving_mean.shape)
        return keras.layers.GroupNormalization.from_config(
            {key: config[key] for key in keep}
            | {"groups": group_count(channels, self.groups)}
        )

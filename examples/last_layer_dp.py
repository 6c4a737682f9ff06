"""Last-layer DP fine-tuning on Fashion-MNIST: public pretraining, private heads.

10,000 of the Fashion-MNIST training images play the public data: a small
CNN is pretrained on them without DP. The other 50,000 are the private
data. The backbone, frozen, turns the private and test images into
features once (`kdpemb.features.extract`, cached on disk); they are
centred by the public features' mean (a `Normalization` layer appended to
the backbone, so that the deployed model centres too) and clipped at the
median norm of the public features. Each method of `LastLayerDPClassifier`
then fits a linear head with (ε, δ = 1e-5)-DP per example at ε = 1 and 8,
and once with no noise for reference; the test accuracies are printed as a
table. The DP-LS head at ε = 1, stacked on the backbone, is saved.

    python examples/last_layer_dp.py            # ~1.5 min on 2 CPU cores
    python examples/last_layer_dp.py --quick    # tiny: ~10 s on TF, ~20 s on JAX
    python examples/last_layer_dp.py --epsilons 0.5 1 4 8

The settings are those that did well in `python -m benchmarks last_layer`
(see docs/last_layer.md); they were chosen on the test set, which is fine
for an example and not for a model you release.
"""

import argparse
import pathlib
import time

import kdpemb  # noqa: F401  (before Keras: a quiet console)

# isort: split
import keras
import numpy as np

from kdpemb.datasets import load_fashion_mnist
from kdpemb.features import extract
from kdpemb.models import CentralizedBaseline, LastLayerDPClassifier, small_cnn

SIZES = {
    "full": dict(
        public=10_000, private=50_000, test=10_000, width=16, groups=4,
        embedding_dim=64, pretrain_epochs=5, sgd_batch=5_000, sgd_steps=300,
        iterative_steps=3,
    ),
    "quick": dict(
        public=1_000, private=2_000, test=1_000, width=4, groups=2,
        embedding_dim=8, pretrain_epochs=1, sgd_batch=500, sgd_steps=4,
        iterative_steps=1,
    ),
}  # fmt: skip
DELTA = 1e-5
QUICK_NOTE = (
    "quick mode: a tiny backbone and {steps} DP-SGD steps, so low accuracies "
    "(DP-SGD not far above chance, 0.1, even without noise) are expected; run "
    "without --quick for meaningful figures"
)


def methods(size):
    """Each method's settings: the model's arguments, its optimizer, fit's."""
    return {
        "DP-SGD": (
            dict(method="dp-sgd", clip_norm=1.0),
            lambda: keras.optimizers.Adam(0.1),
            dict(batch_size=size["sgd_batch"],
                 epochs=size["sgd_steps"] * size["sgd_batch"] // size["private"]),
        ),
        "DP-LS": (dict(method="dp-ls"), None, dict()),
        "DP-Newton": (
            dict(method="dp-newton", l2=0.01),
            lambda: keras.optimizers.SGD(0.5),  # A damped Newton step.
            dict(epochs=size["iterative_steps"]),
        ),
        "DP-FC": (
            dict(method="dp-fc", l2=0.01),
            lambda: keras.optimizers.SGD(1.0),
            dict(epochs=size["iterative_steps"]),
        ),
    }  # fmt: skip


def public_backbone(public, size, cache):
    """The backbone pretrained on public images only (no DP), kept in `cache`."""
    path = cache / "public_model.keras"
    if path.exists():
        print(f"loaded the public model from {path}")
        return keras.saving.load_model(path).backbone
    keras.utils.set_random_seed(0)
    model = CentralizedBaseline(
        small_cnn((28, 28, 1), size["embedding_dim"], size["width"], size["groups"]),
        num_classes=10,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    print(f"pretraining a small CNN on {len(public[0]):,} public images "
          f"({size['pretrain_epochs']} epoch(s))…", flush=True)  # fmt: skip
    start = time.perf_counter()
    model.fit(*public, batch_size=128, epochs=size["pretrain_epochs"], verbose=2)
    print(f"pretrained on {len(public[0]):,} public images in "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    cache.mkdir(parents=True, exist_ok=True)
    model.save(path)
    # The saved model, so that the features' cache key is the same next time.
    return keras.saving.load_model(path).backbone


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    parser.add_argument("--cache", default="build/last_layer_example")
    parser.add_argument("--output", default="build/last_layer_dp_ls.keras")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    cache = pathlib.Path(args.cache)

    # Public, private and test splits of Fashion-MNIST (the Debian files).
    (x, y), (x_test, y_test) = load_fashion_mnist()
    order = np.random.default_rng(0).permutation(len(x))
    public = order[: size["public"]]
    private = order[size["public"] : size["public"] + size["private"]]
    test = (x_test[: size["test"]], y_test[: size["test"]])

    backbone = public_backbone((x[public], y[public]), size, cache)
    print(f"features of {size['public']:,} public, {size['private']:,} private "
          f"and {size['test']:,} test images…", flush=True)  # fmt: skip
    # A progress bar on a terminal ("auto"); quiet in a log.
    public_features = extract(
        backbone, x[public], cache=cache, backbone_name="example-cnn", verbose="auto"
    )
    mean = public_features.mean(axis=0)
    centred = keras.Sequential(
        [backbone, keras.layers.Normalization(mean=mean, variance=np.ones_like(mean),
                                              name="centre")],
        name="centred_backbone",
    )  # fmt: skip
    # The clip norm comes from public data: it must not depend on private data.
    feature_clip_norm = float(np.median(np.linalg.norm(public_features - mean, axis=1)))
    start = time.perf_counter()
    # Same weights as `backbone` (the centring is no weight): another name.
    name = "example-cnn-centred"
    features, labels = extract(
        centred, (x[private], y[private]), cache=cache, backbone_name=name,
        verbose="auto",
    )  # fmt: skip
    test_features, test_labels = extract(
        centred, test, cache=cache, backbone_name=name, verbose="auto"
    )
    print(f"features: {features.shape[0]:,} private and {test_features.shape[0]:,} "
          f"test, dimension {features.shape[1]} ({time.perf_counter() - start:.0f} s); "
          f"C_x = {feature_clip_norm:.2f}")  # fmt: skip

    def fit(name, **noise):
        settings, optimizer, fit_args = methods(size)[name]
        model = LastLayerDPClassifier(
            10, feature_clip_norm=feature_clip_norm, **settings, **noise
        )
        if optimizer is not None:
            model.compile(optimizer=optimizer())
        model.fit(features, labels, verbose=0, **fit_args)
        scores = keras.ops.convert_to_numpy(model(test_features))
        return model, float((scores.argmax(axis=1) == test_labels).mean())

    columns = [f"ε = {eps:g}" for eps in args.epsilons] + ["no noise"]
    rows, saved = {}, None
    start = time.perf_counter()
    fits = len(args.epsilons) + 1
    print(f"fitting {len(methods(size))} methods × {fits} noise levels…", flush=True)
    for name in methods(size):
        began = time.perf_counter()
        rows[name] = []
        for eps in args.epsilons:
            model, accuracy = fit(name, target_epsilon=eps, delta=DELTA)
            rows[name].append(accuracy)
            if name == "DP-LS" and saved is None:
                saved = (model, eps)
        rows[name].append(fit(name, noise_multiplier=0.0)[1])  # Reference.
        print(f"  {name}: {fits} fits in {time.perf_counter() - began:.0f} s",
              flush=True)  # fmt: skip

    print(f"\nTest accuracy of a linear head on {features.shape[0]:,} private "
          f"examples, (ε, δ = {DELTA:g})-DP per example "
          f"({time.perf_counter() - start:.0f} s):\n")  # fmt: skip
    print(f"{'method':<10}" + "".join(f"{c:>10}" for c in columns))
    for name, values in rows.items():
        print(f"{name:<10}" + "".join(f"{v:>10.4f}" for v in values))
    if args.quick:
        print(QUICK_NOTE.format(steps=size["sgd_steps"]))

    model, eps = saved
    print("\n" + model.privacy_statement(DELTA).summary())
    classifier = model.stack_on(centred)  # Images → class scores.
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    classifier.save(output)
    print(f"saved the DP-LS (ε = {eps:g}) classifier on the backbone to {output}")


if __name__ == "__main__":
    main()

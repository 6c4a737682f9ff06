"""Full DP-SGD fine-tuning against last-layer DP, on the same pretrained backbone.

A small CNN is pretrained without DP on *public* synthetic identities.
The private task is to classify K other identities from N private images
with (ε, δ = 1/N²)-DP per example, two ways at the same ε:

- **last layer**: the backbone is frozen, its features of the private
  images are extracted once, and `LastLayerDPClassifier` trains a linear
  head on them with DP-SGD;
- **full fine-tuning**: `DPModel` trains the whole network (backbone and
  a linear head) with DP-SGD: per-example clipping by ghost norms,
  Poisson batches split into physical batches.

Both calibrate their noise for the target ε over their whole run. The
script prints each one's test accuracy, ε and time, per seed.

    python examples/dp_sgd_finetune.py                 # a few minutes on 2 CPU cores
    python examples/dp_sgd_finetune.py --quick         # tiny sizes (below)
    python examples/dp_sgd_finetune.py --epsilon 2 --seeds 0,1,2

`--quick` takes about 12 s on TensorFlow and 40 s on JAX (2 idle CPU
cores; a busy machine takes several times longer), most of it starting
the backend and compiling the DP step, for figures that mean nothing at
that size (it says so).

The hyperparameters were set by hand on this synthetic task (its test
split included): fine for an example, not for a model you release.
"""

import argparse
import time

import kdpemb  # noqa: F401  (before Keras: a quiet console)

# isort: split
import keras
import numpy as np

from kdpemb.callbacks import RichProgress
from kdpemb.datasets import synthetic_identities
from kdpemb.features import extract
from kdpemb.models import DPModel, LastLayerDPClassifier, pretrain, small_cnn

SIZES = {
    "full": dict(
        image_size=32, width=16, groups=4, embedding_dim=64, public_identities=500,
        public_images=10, pretrain_epochs=5, classes=20, train_images=200,
        test_images=20, batch_size=250, epochs=15, physical_batch_size=125,
        head_lr=0.2, full_lr=5e-3,
    ),
    "quick": dict(
        image_size=16, width=4, groups=2, embedding_dim=8, public_identities=16,
        public_images=4, pretrain_epochs=1, classes=4, train_images=12,
        test_images=4, batch_size=16, epochs=2, physical_batch_size=8,
        head_lr=0.2, full_lr=2e-3,
    ),
}  # fmt: skip
# Quick: 16 x 4 public images are one pretraining batch (of 64), so JAX
# compiles one pretraining step, not a second one for a partial batch.
QUICK_NOTE = (
    "quick mode: a tiny backbone, a few private images and 2 epochs, so "
    "accuracies near chance (1 / {classes}) are expected; run without --quick "
    "for meaningful figures"
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument(
        "--train-images",
        type=int,
        default=None,
        help="private training images per identity",
    )
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument(
        "--full-lr",
        type=float,
        default=None,
        help="Adam learning rate of full fine-tuning",
    )
    return parser.parse_args(argv)


def private_task(size, seed):
    """Train and test images (float32) of `classes` private identities."""
    per_identity = size["train_images"] + size["test_images"]
    data = synthetic_identities(
        size["classes"], per_identity, image_size=size["image_size"], seed=seed
    )
    images = np.asarray(data.images, dtype="float32")
    labels = np.asarray(data.labels)
    position = np.arange(len(labels)) % per_identity
    train = position < size["train_images"]
    return (images[train], labels[train]), (images[~train], labels[~train])


def pretrained_backbone(size, seed):
    keras.utils.set_random_seed(seed)
    public = synthetic_identities(
        size["public_identities"], size["public_images"],
        image_size=size["image_size"], seed=seed, domain="public",
    )  # fmt: skip
    shape = (size["image_size"], size["image_size"], 3)
    backbone = small_cnn(shape, size["embedding_dim"], size["width"], size["groups"])
    backbone, _ = pretrain(backbone, public, epochs=size["pretrain_epochs"], verbose=0)
    return backbone


def last_layer(backbone, train, test, size, args, delta):
    features = extract(backbone, train[0], verbose=0)
    test_features = extract(backbone, test[0], verbose=0)
    head = LastLayerDPClassifier(
        size["classes"], "dp-sgd", clip_norm=args.clip_norm,
        target_epsilon=args.epsilon, delta=delta,
    )  # fmt: skip
    head.compile(keras.optimizers.Adam(size["head_lr"]))
    head.fit(features, train[1], batch_size=size["batch_size"],
             epochs=size["epochs"], verbose=0)  # fmt: skip
    accuracy = float(
        np.mean(head.predict(test_features, verbose=0).argmax(1) == test[1])
    )
    return accuracy, head.privacy_statement().epsilon


def full_fine_tuning(backbone, train, test, size, args, delta):
    network = keras.Sequential([backbone, keras.layers.Dense(size["classes"])])
    model = DPModel(
        network, clip_norm=args.clip_norm, target_epsilon=args.epsilon, delta=delta,
        physical_batch_size=size["physical_batch_size"],
    )  # fmt: skip
    model.compile(
        keras.optimizers.Adam(size["full_lr"]),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    # The whole network's DP step compiles at the first step (JAX: a minute
    # or two on a CPU), then one line per epoch.
    if keras.backend.backend() == "jax":
        print("  the first step compiles the DP step (10 s to a minute on 2 "
              "CPU cores)…", flush=True)  # fmt: skip
    progress = RichProgress(unit="step", keys=("private_steps",))
    model.fit(*train, batch_size=size["batch_size"], epochs=size["epochs"],
              verbose=0, callbacks=[progress])  # fmt: skip
    accuracy = model.evaluate(*test, verbose=0, return_dict=True)["accuracy"]
    return float(accuracy), model.privacy_statement().epsilon


def main(argv=None):
    args = parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "full"])
    for name in ("train_images", "epochs", "full_lr"):
        if getattr(args, name) is not None:
            size[name] = getattr(args, name)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        train, test = private_task(size, seed)
        delta = 1.0 / len(train[0]) ** 2
        for name, method in (("last layer", last_layer),
                             ("full fine-tuning", full_fine_tuning)):  # fmt: skip
            print(
                f"seed {seed}, {name}: pretraining a backbone on public "
                f"identities, then DP-SGD at ε = {args.epsilon:g}…",
                flush=True,
            )
            backbone = pretrained_backbone(size, seed)  # Fresh: one is trained.
            start = time.perf_counter()
            accuracy, epsilon = method(backbone, train, test, size, args, delta)
            rows.append((seed, name, accuracy, epsilon, time.perf_counter() - start))
    print(f"\n{'seed':>4}  {'method':<18} {'accuracy':>8}  {'ε':>6}  {'seconds':>7}")
    for seed, name, accuracy, epsilon, seconds in rows:
        print(f"{seed:>4}  {name:<18} {accuracy:>8.3f}  {epsilon:>6.3g}  "
              f"{seconds:>7.1f}")  # fmt: skip
    if args.quick:
        print(QUICK_NOTE.format(classes=size["classes"]))


if __name__ == "__main__":
    main()

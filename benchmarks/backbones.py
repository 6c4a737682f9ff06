"""Centralized training of the small backbones on synthetic identities (CPU).

`python -m benchmarks.backbones --backbone resnet_gn --head cosine` trains
`CentralizedBaseline` on 1,000 synthetic identities × 8 images (32×32×3)
and prints JSON: epochs, seconds, parameters and Recall@FAR=1e-3 and 1e-2
on 200 held-out identities × 8 images (identities 1,000,000 to 1,000,199,
which no run trains on), after each epoch.
"""

import argparse
import json
import time

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backbone", default="resnet_gn")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--head", default="cosine")
    parser.add_argument("--scale", type=float, default=16.0)
    parser.add_argument("--margin", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--identities", type=int, default=1000)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import keras

    from kdpemb.datasets import synthetic_identities
    from kdpemb.metrics import recall_at_far
    from kdpemb.models import CentralizedBaseline, resnet_gn, small_cnn

    keras.utils.set_random_seed(args.seed)
    train = synthetic_identities(args.identities, args.images, seed=args.seed)
    held = synthetic_identities(200, 8, seed=args.seed, first_identity=1_000_000)
    x, y = np.asarray(train.images), train.labels
    held_images = np.asarray(held.images)
    build = {"resnet_gn": resnet_gn, "small_cnn": small_cnn}[args.backbone]
    kwargs = {} if args.width is None else {"width": args.width}
    backbone = build((32, 32, 3), embedding_dim=64, **kwargs)
    kwargs = {"head_scale": args.scale} if args.head == "cosine" else {}
    if args.margin:
        kwargs["head_margin"] = args.margin
    model = CentralizedBaseline(backbone, args.identities, head=args.head, **kwargs)
    steps = args.epochs * -(-len(x) // args.batch)
    schedule = keras.optimizers.schedules.CosineDecay(args.lr, steps)
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    def recall():
        embeddings = backbone.predict(held_images, batch_size=256, verbose=0)
        r = recall_at_far(embeddings, held.labels, far=[1e-3, 1e-2])
        return [round(float(v), 3) for v in r]

    result = {
        "args": vars(args),
        "params": backbone.count_params(),
        "untrained": recall(),
        "epochs": [],
    }
    train_seconds = 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
        train_seconds += time.perf_counter() - start
        result["epochs"].append(
            {
                "epoch": epoch + 1,
                "seconds": round(train_seconds, 1),
                "loss": round(float(history.history["loss"][-1]), 3),
                "recall": recall(),
            }
        )
        print(json.dumps(result["epochs"][-1]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

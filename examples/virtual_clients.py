"""Prints the structure of a DP-FedEmb training round.

Builds users from synthetic identities (the default) or from Fashion-MNIST
with simulated, skewed users (`--fashion-mnist`), groups them into virtual
clients, samples one round and shows what a `train_step` receives, then
what privacy 200 such rounds give.

    python examples/virtual_clients.py
    python examples/virtual_clients.py --fashion-mnist --users-per-client 1
"""

import argparse

import numpy as np

from kdpemb import privacy
from kdpemb.data import VirtualClients
from kdpemb.datasets import (
    UserImages,
    load_fashion_mnist,
    simulate_users,
    synthetic_identities,
)


def synthetic_users():
    # 600 users, one identity each, 12 images per identity.
    return synthetic_identities(600, 12, image_size=32, channels=3)


def fashion_mnist_users():
    (images, labels), _ = load_fashion_mnist()
    # 2,000 handwriting-like users who each hold 2 of the 10 classes.
    users = simulate_users(labels, num_users=2_000, classes_per_user=2, seed=0)
    return UserImages(images, labels, users)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fashion-mnist", action="store_true")
    parser.add_argument("--users-per-client", type=int, default=4)
    parser.add_argument("--clients-per-round", type=float, default=16)
    args = parser.parse_args(argv)

    data = fashion_mnist_users() if args.fashion_mnist else synthetic_users()
    clients = VirtualClients(
        data,
        clients_per_round=args.clients_per_round,
        users_per_client=args.users_per_client,
        local_steps=4,
        batch_size=8,
    )
    print(clients.describe())

    element = clients.round(0)
    sampled = np.flatnonzero(element["client_mask"])
    print(f"\nround 0: {sampled.size} virtual clients sampled")
    for row in sampled[:5]:
        used = element["example_mask"][row]
        per_step = used.sum(axis=1).tolist()
        print(
            f"  client {row}: {used.sum()} example slots {per_step} per step, "
            f"{element['num_local_classes'][row]} local classes "
            f"(global {sorted(set(element['global_labels'][row][used].tolist()))})"
        )

    mechanism = clients.schedule.privacy_mechanism(noise_multiplier=1.0, clip_norm=1.0)
    delta = 0.1 / clients.num_users
    statement = privacy.PrivacyStatement.compute(mechanism, steps=200, delta=delta)
    print(f"\n200 rounds with noise multiplier 1.0: {statement.summary()}")
    print(
        f"(User-level DP needs many users: with {clients.num_users} users each "
        f"round samples {clients.sampling_rate:.1%} of them.)"
    )


if __name__ == "__main__":
    main()

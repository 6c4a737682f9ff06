"""The privacy calculator: what (ε, δ) a training schedule gives.

It states the privacy of three documented schedules and calibrates the
noise for a target ε (no training; `make demo` runs the main job,
`examples/train_dp_fedemb.py`):

1. Example-level DP-SGD, TensorFlow Privacy's MNIST tutorial: 60,000
   examples, expected batch 256, noise multiplier 1.1, 60 epochs, δ = 1e-5
   (the tutorial reported ε = 3.01 with the RDP accountant of its time).
2. User-level DP-FedEmb: 100,000 users, 100 virtual clients per round,
   noise multiplier 1.0, 2,000 rounds, δ = 1e-6, with one user per virtual
   client (add/remove) and with four (replace-one: sensitivity 2C).
3. The noise multiplier that gives ε = 4 for the four-user schedule.

Run: python examples/privacy_calculator.py [--json]
The same numbers come from the CLI, e.g.:
    kdpemb privacy epsilon --num-examples 60000 --batch-size 256 \\
        --epochs 60 --noise-multiplier 1.1 --delta 1e-5
"""

import argparse
import json

from rich.console import Console

from kdpemb import privacy


def schedules():
    mnist = privacy.dp_sgd(1.1, batch_size=256, num_examples=60_000, clip_norm=1.0)
    yield "DP-SGD, MNIST tutorial", mnist, mnist.steps_for_epochs(60), 1e-5
    for users_per_client in (1, 4):
        fedemb = privacy.virtual_clients(
            1.0,
            clients_per_round=100,
            num_users=100_000,
            users_per_client=users_per_client,
            clip_norm=0.1,
        )
        name = f"DP-FedEmb, {users_per_client} user(s) per virtual client"
        yield name, fedemb, 2_000, 1e-6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args()
    console = Console()
    statements = []
    for name, mechanism, steps, delta in schedules():
        statement = privacy.PrivacyStatement.compute(mechanism, steps, delta)
        rdp = (
            privacy.epsilon(mechanism, steps, delta, accountant="rdp")
            if (mechanism.relation_name == "add_or_remove_one")
            else None
        )
        statements.append((name, statement, rdp))
        if not args.json:
            console.rule(name)
            console.print(statement)
            if rdp is not None:
                console.print(f"(RDP accountant, looser: ε = {rdp:.3f})")

    template = privacy.virtual_clients(
        1.0, clients_per_round=100, num_users=100_000, users_per_client=4
    )
    noise = privacy.calibrate_noise_multiplier(
        template, 2_000, 1e-6, target_epsilon=4.0
    )
    calibrated = privacy.PrivacyStatement.compute(
        template.with_noise_multiplier(noise), 2_000, 1e-6
    )
    if args.json:
        for name, statement, rdp in statements:
            print(
                json.dumps(
                    {"schedule": name, **statement.to_dict(), "rdp_epsilon": rdp}
                )
            )
        print(json.dumps({"schedule": "calibrated for ε = 4", **calibrated.to_dict()}))
        return
    console.rule("Calibration")
    console.print(
        "Smallest noise multiplier for ε <= 4 (δ = 1e-6, 2,000 rounds, 4 users per "
        f"virtual client): [bold]{noise:.4f}[/bold] "
        f"(gives ε = {calibrated.epsilon:.3f})"
    )
    console.rule("Summary")
    for name, statement, _ in statements:
        console.print(f"[bold]{name}[/bold]: {statement.summary()}", highlight=False)


if __name__ == "__main__":
    main()

"""kdpemb's command line: `kdpemb privacy epsilon` and `kdpemb privacy calibrate`.

Examples:

    kdpemb privacy epsilon --num-examples 60000 --batch-size 256 \\
        --epochs 60 --noise-multiplier 1.1 --delta 1e-5
    kdpemb privacy calibrate --num-users 100000 --clients-per-round 100 \\
        --users-per-client 4 --steps 2000 --target-epsilon 4 --delta 1e-6 --json
    kdpemb privacy epsilon --num-users 160000 --clients-per-round 2048 \\
        --steps 3200 --noise-multiplier 0.02 --delta 1e-8 \\
        --deployment-scale 64 --deployment-users 10000000
    kdpemb privacy epsilon --mechanism tree --num-users 10000000 \\
        --clients-per-round 131072 --epochs 10 --noise-multiplier 16.64 \\
        --delta 1e-8 --accountant rdp

The third one states a *simulated deployment* (64 times the noise and the
clients per round, over 10M users), not the run's own guarantee; it also
shows the run's own ε (RDP, where the run's relation allows). With
--epochs the steps come from the run's pool: the deployment keeps the
run's number of rounds.

It does not import Keras, so it answers in about two seconds.
"""

import argparse
import json
import math
import re
import sys

from kdpemb import _validation as validation
from kdpemb.errors import CalibrationError, UnsupportedMechanismError
from kdpemb.privacy import calibration, mechanism_builders
from kdpemb.privacy.accountant import ACCOUNTANTS, Accountant
from kdpemb.privacy.deployment import simulated_deployment
from kdpemb.privacy.schedule import Schedule, rounds_per_epoch_for
from kdpemb.privacy.statement import PrivacyStatement
from kdpemb.version import __version__

_SAMPLINGS = {
    "poisson": "poisson",
    "full-batch": "full_batch",
    "fixed": "fixed",
    "epochs": "epochs",
}
_MECHANISMS = {"gaussian": "independent", "tree": "tree"}


def _add_schedule_arguments(parser):
    population = parser.add_argument_group("population (one of)")
    who = population.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--num-examples",
        type=int,
        metavar="N",
        help="example-level DP: number of training examples",
    )
    who.add_argument(
        "--num-users",
        type=int,
        metavar="N",
        help="user-level DP (DP-FedEmb): number of users",
    )
    step = parser.add_argument_group("one step")
    step.add_argument(
        "--batch-size",
        type=float,
        metavar="B",
        help="expected examples per step (with --num-examples)",
    )
    step.add_argument(
        "--clients-per-round",
        type=float,
        metavar="M",
        help="expected virtual clients per round (with --num-users)",
    )
    step.add_argument(
        "--users-per-client",
        type=int,
        default=1,
        metavar="K",
        help="users per virtual client (default 1)",
    )
    step.add_argument(
        "--sampling",
        choices=sorted(_SAMPLINGS),
        default=None,
        help="how each step's sample is drawn (default poisson; epochs with "
        "--mechanism tree): epochs = no sampling, each example or virtual "
        "client in at most one step per epoch",
    )
    step.add_argument(
        "--mechanism",
        choices=sorted(_MECHANISMS),
        default="gaussian",
        help="gaussian (default): fresh noise each step; tree: DP-FTRL's tree "
        "aggregation, restarted every epoch (needs --sampling epochs)",
    )
    step.add_argument(
        "--steps-per-epoch",
        type=int,
        metavar="R",
        help="with --sampling epochs: steps (rounds) per epoch (default "
        "ceil(pool / batch), the pool being examples or virtual clients)",
    )
    step.add_argument(
        "--clip-norm", type=float, metavar="C", help="clip norm, shown in the statement"
    )
    length = parser.add_argument_group("length (one of)")
    how_long = length.add_mutually_exclusive_group(required=True)
    how_long.add_argument(
        "--epochs",
        type=float,
        help="passes over the data, each example or virtual client once in "
        "expectation: ceil(epochs / q) steps, q = batch / pool (Keras-style "
        "shuffled epochs are not what the accountant assumes)",
    )
    how_long.add_argument("--steps", type=int, help="private steps (rounds)")
    parser.add_argument(
        "--delta", type=float, required=True, help="δ; must be below 1/population"
    )
    parser.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default=None,
        help="pld (tight) or rdp (fast); default: pld where it models the "
        "schedule, else rdp (fixed-size sampling)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )


def build_parser():
    parser = argparse.ArgumentParser(
        prog="kdpemb", description="kdpemb: differentially private embeddings."
    )
    parser.add_argument("--version", action="version", version=f"kdpemb {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    privacy = commands.add_parser("privacy", help="privacy accounting")
    actions = privacy.add_subparsers(dest="action", required=True)

    epsilon = actions.add_parser(
        "epsilon",
        help="ε of a training schedule",
        description="Compute ε (at --delta) of a DP training schedule.",
    )
    _add_schedule_arguments(epsilon)
    epsilon.add_argument(
        "--noise-multiplier",
        type=float,
        required=True,
        metavar="Z",
        help="noise std / clip norm",
    )
    deployment = epsilon.add_argument_group(
        "simulated deployment (both flags; shown next to the run's own ε)",
        "State the ε of a deployment with S times the noise multiplier and "
        "the clients per round over --deployment-users users: the same "
        "mean-update noise as this run, never this run's own guarantee. The "
        "deployment keeps the run's number of rounds: with --epochs they "
        "are the run's (ceil(epochs / q) for the run's q), not the "
        "deployment's epochs.",
    )
    deployment.add_argument(
        "--deployment-scale",
        type=float,
        metavar="S",
        help="s >= 1: the deployment's noise multiplier and clients per round "
        "are s times the run's",
    )
    deployment.add_argument(
        "--deployment-users",
        type=int,
        metavar="N",
        help="users in the deployment (at least --num-users)",
    )
    deployment.add_argument(
        "--deployment-clients",
        type=int,
        metavar="P",
        help="virtual clients in the deployment, if fixed from a public count: "
        "in [ceil(N / users-per-client), N] (default ceil(N / "
        "users-per-client); exactly N with one user per client)",
    )

    calibrate = actions.add_parser(
        "calibrate",
        help="smallest noise multiplier for a target ε",
        description="Find the smallest noise multiplier that meets "
        "--target-epsilon. The ε stated is the one the search met: at most the "
        "target, and at least what `kdpemb privacy epsilon` gives for that "
        "multiplier (equal to it with --accountant rdp or full batches; with "
        "sampled steps on PLD, a bound from a coarser grid, above it by less "
        "than 0.25 % of the target).",
    )
    _add_schedule_arguments(calibrate)
    calibrate.add_argument(
        "--target-epsilon",
        type=float,
        required=True,
        metavar="EPS",
        help="the ε to meet",
    )
    return parser


# Every numeric flag, with the values it takes. Checked before anything is
# built, so an error names the flag (not the library's argument).
_NUMERIC_FLAGS = (
    ("num_examples", "count"),
    ("num_users", "count"),
    ("batch_size", "positive"),
    ("clients_per_round", "positive"),
    ("users_per_client", "count"),
    ("steps_per_epoch", "count"),
    ("clip_norm", "positive"),
    ("epochs", "positive"),
    ("steps", "count"),
    ("delta", "probability"),
    ("noise_multiplier", "non_negative"),
    ("target_epsilon", "positive"),
    ("deployment_scale", "scale"),
    ("deployment_users", "count"),
    ("deployment_clients", "count"),
)
_RULES = {
    "count": (lambda v: v >= 1, "must be at least 1"),
    "positive": (lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0"),
    "non_negative": (
        lambda v: math.isfinite(v) and v >= 0,
        "must be a finite number >= 0 (0 is no noise: ε = ∞)",
    ),
    "probability": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "scale": (
        lambda v: math.isfinite(v) and v >= 1,
        "must be a finite number >= 1 (1 is the run itself)",
    ),
}
# The library's names of arguments that the flags set, as the flags, for
# the checks left to the library (a deployment's, a calibration's).
_LIBRARY_NAMES = (
    (r"\bdeployment_users\b", "--deployment-users"),
    (r"\bdeployment_clients\b", "--deployment-clients"),
    (r"\busers_per_client\b", "--users-per-client"),
    (r"\bscale (?=<=|>=|must)", "--deployment-scale "),
    (r"\btarget_epsilon=", "--target-epsilon="),
    (r"\bdelta=", "--delta="),
    (r"\bdelta(?= well below)", "--delta"),
)


def _in_flags(error):
    """`error`'s message with the library's argument names as flags."""
    message = str(error)
    for name, flag in _LIBRARY_NAMES:
        message = re.sub(name, flag, message)
    return message


def _flag(name):
    return "--" + name.replace("_", "-")


def check_flags(args):
    """Refuses bad numeric flags and combinations, naming the flags."""
    for name, rule in _NUMERIC_FLAGS:
        value = getattr(args, name, None)
        ok, text = _RULES[rule]
        if value is not None and not ok(value):
            shown = value if isinstance(value, int) else f"{value:g}"
            raise ValueError(f"{_flag(name)} {text}, got {shown}.")
    if args.num_examples is not None:
        population, who, unit = args.num_examples, "--num-examples", "example"
    else:
        population, who, unit = args.num_users, "--num-users", "user"
    if args.delta >= 1 / population:
        raise ValueError(
            f"--delta {args.delta:g} is not below 1/population = 1/{population} "
            f"({who} {population}): a δ that large allows publishing one "
            f"{unit}'s data outright. Choose --delta well below 1/{population}, "
            f"e.g. {validation.suggest_delta(population):.0e}."
        )
    batch, sampling = args.batch_size, _sampling_of(args)
    if args.num_examples is not None and batch is not None:
        if sampling in ("poisson", "fixed") and batch > population:
            raise ValueError(
                f"--batch-size {batch:g} is more than --num-examples "
                f"{population}: a step samples at most every example. Use at "
                "most that many, or --sampling full-batch."
            )
        if sampling == "fixed" and batch != int(batch):
            raise ValueError(
                f"--batch-size {batch:g} with --sampling fixed must be a whole "
                "number: every step draws exactly that many examples."
            )
    if args.num_users is not None:
        k = args.users_per_client
        if k > population:
            raise ValueError(
                f"--users-per-client {k} is more than --num-users {population}: "
                f"use at most {population}."
            )
        pool = -(-population // k)
        where = (
            f"the {pool} virtual clients that --num-users {population} make "
            f"with --users-per-client {k}"
        )
        clients, steps_per_epoch = args.clients_per_round, args.steps_per_epoch
        if clients is not None and clients > pool:
            raise ValueError(
                f"--clients-per-round {clients:g} is more than {where}. Use at "
                f"most {pool} clients per round, or fewer users per client."
            )
        if sampling == "epochs" and steps_per_epoch is not None:
            if steps_per_epoch > pool:
                raise ValueError(
                    f"--steps-per-epoch {steps_per_epoch} is more than {where}: "
                    f"some steps would always be empty. Use at most {pool}."
                )
            if clients is not None and (
                rounds_per_epoch_for(pool, clients) != steps_per_epoch
            ):
                raise ValueError(
                    f"--clients-per-round {clients:g} and --steps-per-epoch "
                    f"{steps_per_epoch} disagree: {pool} virtual clients in "
                    f"{steps_per_epoch} steps are {pool / steps_per_epoch:.4g} "
                    "per step. Pass only one."
                )


def _sampling_of(args):
    noise = _MECHANISMS[args.mechanism]
    if args.sampling is None:
        return "epochs" if noise == "tree" else "poisson"
    sampling = _SAMPLINGS[args.sampling]
    if noise == "tree" and sampling != "epochs":
        raise ValueError(
            f"--mechanism tree (DP-FTRL) needs steps without sampling: use "
            f"--sampling epochs, not {args.sampling}."
        )
    return sampling


def _epochs_mechanism(args, noise_multiplier):
    """The mechanism of steps without sampling (`--sampling epochs`)."""
    noise = _MECHANISMS[args.mechanism]
    if args.num_examples is not None:
        if args.users_per_client != 1 or args.clients_per_round is not None:
            raise ValueError(
                "--users-per-client and --clients-per-round need --num-users."
            )
        steps_per_epoch = args.steps_per_epoch
        if steps_per_epoch is None:
            if args.batch_size is None:
                raise ValueError(
                    "--sampling epochs needs --steps-per-epoch or --batch-size."
                )
            steps_per_epoch = rounds_per_epoch_for(args.num_examples, args.batch_size)
        return mechanism_builders.tree_aggregation(
            noise_multiplier,
            steps_per_epoch,
            args.num_examples,
            leaves_per_tree=None if noise == "tree" else 1,
            clip_norm=args.clip_norm,
        )
    if args.batch_size is not None:
        raise ValueError(
            "--batch-size is for example-level DP; with --num-users give "
            "--clients-per-round or --steps-per-epoch."
        )
    if args.clients_per_round is None and args.steps_per_epoch is None:
        raise ValueError(
            "--sampling epochs needs --steps-per-epoch or --clients-per-round."
        )
    schedule = Schedule.virtual_clients(
        args.num_users,
        args.clients_per_round,
        users_per_client=args.users_per_client,
        sampling="epochs",
        rounds_per_epoch=args.steps_per_epoch,
    )
    return schedule.privacy_mechanism(noise_multiplier, args.clip_norm, noise=noise)


def mechanism_from_args(args, noise_multiplier):
    """The mechanism and step count that the schedule flags describe."""
    sampling = _sampling_of(args)
    if sampling == "epochs":
        mechanism = _epochs_mechanism(args, noise_multiplier)
    elif args.steps_per_epoch is not None:
        raise ValueError(
            "--steps-per-epoch is for --sampling epochs; with sampling an "
            "epoch is ceil(1 / q) steps."
        )
    elif args.num_examples is not None:
        if args.clients_per_round is not None:
            raise ValueError(
                "--clients-per-round is for user-level DP; with --num-examples "
                "give --batch-size."
            )
        if args.users_per_client != 1:
            raise ValueError("--users-per-client needs --num-users.")
        if sampling == "full_batch":
            if args.batch_size is not None:
                raise ValueError("--batch-size does not apply to full-batch steps.")
            mechanism = mechanism_builders.full_batch(
                noise_multiplier, args.num_examples, clip_norm=args.clip_norm
            )
        else:
            if args.batch_size is None:
                raise ValueError("--num-examples needs --batch-size.")
            mechanism = mechanism_builders.dp_sgd(
                noise_multiplier,
                args.batch_size,
                args.num_examples,
                sampling=sampling,
                clip_norm=args.clip_norm,
            )
    else:
        if args.batch_size is not None:
            raise ValueError(
                "--batch-size is for example-level DP; with --num-users give "
                "--clients-per-round (virtual clients per round)."
            )
        clients = args.clients_per_round
        if clients is None and sampling != "full_batch":
            raise ValueError("--num-users needs --clients-per-round.")
        mechanism = mechanism_builders.virtual_clients(
            noise_multiplier,
            clients,
            args.num_users,
            users_per_client=args.users_per_client,
            sampling=sampling,
            clip_norm=args.clip_norm,
        )
    if args.steps is not None:
        steps = args.steps
    else:
        steps = mechanism.steps_for_epochs(args.epochs)
    return mechanism, steps


def _deployment_from_args(args):
    """The simulated deployment's statement, or None without its flags."""
    flags = (args.deployment_scale, args.deployment_users, args.deployment_clients)
    if all(flag is None for flag in flags):
        return None
    if args.deployment_scale is None or args.deployment_users is None:
        raise ValueError(
            "A simulated deployment needs both --deployment-scale and "
            "--deployment-users."
        )
    if args.num_users is None:
        raise ValueError(
            "--deployment-scale is for user-level runs: give --num-users and "
            "--clients-per-round."
        )
    _, steps = mechanism_from_args(args, args.noise_multiplier)  # Checks flags.
    schedule = Schedule.virtual_clients(
        args.num_users,
        args.clients_per_round,
        users_per_client=args.users_per_client,
        sampling=_sampling_of(args),
    )
    try:
        return simulated_deployment(
            schedule,
            args.noise_multiplier,
            steps,
            scale=args.deployment_scale,
            deployment_users=args.deployment_users,
            deployment_clients=args.deployment_clients,
            delta=args.delta,
            clip_norm=args.clip_norm,
            accountant=args.accountant or "pld",
        )
    except ValueError as error:  # Its arguments are these flags.
        raise ValueError(_in_flags(error)) from None


def _run(args):
    check_flags(args)
    if args.action == "epsilon":
        deployment = _deployment_from_args(args)
        if deployment is not None:
            return deployment, {}
        mechanism, steps = mechanism_from_args(args, args.noise_multiplier)
        Accountant(mechanism, args.accountant)  # Clear error if unsupported.
        return PrivacyStatement.compute(
            mechanism, steps, args.delta, args.accountant
        ), {}
    template, steps = mechanism_from_args(args, 1.0)
    try:
        found = calibration.calibrate(
            template,
            steps,
            args.delta,
            target_epsilon=args.target_epsilon,
            accountant=args.accountant,
        )
    except CalibrationError as error:
        raise CalibrationError(_in_flags(error)) from None
    # The bound the search met, at least the accountant's ε at this z:
    # accounting the multiplier again on the accountant's own grid would
    # take seconds to minutes at small multipliers (large targets).
    statement = PrivacyStatement.from_epsilon(
        template.with_noise_multiplier(found.noise_multiplier),
        steps,
        args.delta,
        found.epsilon,
        found.accountant,
    )
    return statement, {"target_epsilon": args.target_epsilon}


def main(argv=None):
    """Runs the CLI; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        statement, extra = _run(args)
    except (
        ValueError,
        TypeError,
        UnsupportedMechanismError,
        CalibrationError,
    ) as error:
        parser.exit(2, f"kdpemb: error: {error}\n")
    if args.json:
        print(json.dumps({**statement.to_dict(), **extra}, indent=2, allow_nan=False))
        return 0
    from rich.console import Console

    console = Console()
    if extra:
        console.print(
            f"Smallest noise multiplier with ε <= {extra['target_epsilon']:g}: "
            # Rounded up: training with the printed value never spends more.
            f"[bold]{math.ceil(statement.noise_multiplier * 1e4) / 1e4:.4f}[/bold]"
        )
    console.print(statement)
    console.print(statement.summary(), highlight=False)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``fedax privacy epsilon|noise``: DP accounting from the command line (dp-accounting, through
``fedax.privacy``), assuming what a run does by default: fixed-size sampling of m = floor(q*N)
of N clients without replacement, replace-one neighbours (``--sampling poisson`` for Poisson
sampling, add-or-remove-one). Each prints the sampling and neighbouring relation it assumes
on a line of its own; printed numbers are rounded up."""

from __future__ import annotations

import argparse
import math
import sys

from fedax.spec.errors import CommandError

_PRIVACY_FLAGS = {"sampling_probability": "--q", "target_epsilon": "--epsilon",
                  "noise_multiplier": "--z", "extra_releases_per_round": "--extra-releases",
                  "population": "--population", "rounds": "--rounds", "delta": "--delta"}


def _privacy_error(err: ValueError) -> CommandError:
    """The library's message, naming the command's flags instead of its arguments."""
    name, _, rest = str(err).partition(" ")
    text = f"{_PRIVACY_FLAGS.get(name, name)} {rest}".replace("accountant='rdp'",
                                                               "--accountant rdp")
    return CommandError(text, 2)


def _privacy_setting(args) -> tuple[float, dict]:
    """q and the accounting options of ``fedax privacy epsilon|noise``. Fixed-size sampling
    (the default, as in ``fedax run``) draws m = floor(q*N) of the N clients each round, as a
    run with ``client_fraction`` q does (``fedax.data.sample_clients``), so q becomes m/N."""
    sampling = args.sampling or "fixed"
    if sampling == "fixed" and args.population is None:
        default = " (the default, as in fedax run)" if args.sampling is None else ""
        raise CommandError(f"fixed-size sampling{default} needs the number of clients N: "
                           "give --population N, or --sampling poisson", 2)
    if sampling == "fixed" and args.accountant == "pld":
        raise CommandError("--accountant pld has no event for fixed-size sampling without "
                           "replacement (the default, as in fedax run); use --accountant rdp, "
                           "or --sampling poisson", 2)
    q = args.q
    if sampling == "fixed" and 0 < q <= 1 and args.population >= 1:
        n = args.population
        q = min(max(math.floor(q * n + 1e-9), 1), n) / n  # sample_clients' m, over N
    return q, {"accountant": args.accountant, "sampling": sampling,
               "population": args.population, "extra_releases_per_round": args.extra_releases}


def _sampling_line(args, q: float, options: dict) -> str:
    """The sampling and the neighbouring relation an ε assumes, in one line."""
    n = options["population"]
    if options["sampling"] == "poisson":
        of = f" of N = {n}" if n is not None else ""
        return (f"sampling: Poisson (each client with probability q = {q:g} per round{of}), "
                "neighbours: add-or-remove-one client")
    m = round(q * n)
    drawn = (f"; q*N = {args.q * n:g} is not whole: m = {m}, as a run with client_fraction "
             f"{args.q:g} draws" if abs(args.q * n - m) > 1e-9 * n else "")
    return (f"sampling: fixed-size (m = {m} of N = {n} without replacement{drawn}), "
            "neighbours: replace-one client")


def cmd_privacy_epsilon(args) -> int:
    from fedax.privacy import describe, epsilon, round_up

    q, options = _privacy_setting(args)
    try:
        eps = epsilon(args.z, q, args.rounds, args.delta, **options)
        assumes = describe(args.z, q, **options)
    except ValueError as err:
        raise _privacy_error(err) from err
    print(f"epsilon = {round_up(eps)} at delta = {args.delta:g} after {args.rounds} rounds")
    print(_sampling_line(args, q, options))
    print(f"assumes: {assumes}")
    return 0


def cmd_privacy_noise(args) -> int:
    """z for a target ε. The search's trouble (its upper bound of z hit, or the accountant's
    floor) is a one-line warning; the status is 0 only if the printed z (rounded up) has
    ε <= the target, else 1 with a one-line error."""
    from fedax.privacy import describe, epsilon, round_up, search_noise_multiplier

    q, options = _privacy_setting(args)
    try:
        found = search_noise_multiplier(args.epsilon, q, args.rounds, args.delta, **options)
        if found.warning is not None:
            print(f"fedax: warning: {found.warning}", file=sys.stderr)
        if not found.reached:
            raise CommandError(f"{found.error}; raise --epsilon or --delta, or lower --rounds")
        z = float(round_up(found.noise_multiplier))
        eps = epsilon(z, q, args.rounds, args.delta, **options)
        assumes = describe(z, q, **options)
    except ValueError as err:
        raise _privacy_error(err) from err
    if not eps <= args.epsilon:
        raise CommandError(f"the noise multiplier found, z = {round_up(z)} (rounded up), has "
                           f"epsilon {round_up(eps)} > {args.epsilon:g}: the accountant's "
                           "epsilon does not fall steadily with z here; raise --epsilon or "
                           "--delta")
    print(f"noise multiplier z = {round_up(z)} (epsilon = {round_up(eps)} <= "
          f"{args.epsilon:g} at delta = {args.delta:g} after {args.rounds} rounds)")
    print(_sampling_line(args, q, options))
    print(f"assumes: {assumes}")
    return 0


def add_command(sub, common: argparse.ArgumentParser) -> None:
    """Adds ``fedax privacy epsilon|noise`` to the ``fedax`` command's subparsers."""
    privacy = sub.add_parser("privacy", help="differential privacy accounting (dp-accounting)",
                             parents=[common])
    privacy_sub = privacy.add_subparsers(dest="privacy_command", required=True)
    accounting = argparse.ArgumentParser(add_help=False)
    accounting.add_argument("--q", type=float, required=True,
                            help="sampling probability: the fraction of clients per round")
    accounting.add_argument("--rounds", type=int, required=True, metavar="T",
                            help="number of rounds")
    accounting.add_argument("--delta", type=float, required=True,
                            help="the delta of (epsilon, delta)-DP; well below 1/N")
    accounting.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                            help="RDP (default, conservative) or PLD (tighter, slower)")
    accounting.add_argument("--sampling", choices=("fixed", "poisson"),
                            help="fixed (the default, as in fedax run: m = floor(q*N) of the N "
                                 "clients each round without replacement; RDP, replace-one "
                                 "neighbours; needs --population) or poisson (each client "
                                 "with probability q; add-or-remove-one neighbours)")
    accounting.add_argument("--population", type=int, metavar="N",
                            help="number of clients: needed by fixed sampling; with poisson "
                                 "it checks delta < 1/N")
    accounting.add_argument("--extra-releases", type=int, default=0, metavar="K",
                            help="more Gaussian releases per round on the same cohort, at the "
                                 "same z (e.g. a hypergradient's noised sum)")
    eps = privacy_sub.add_parser("epsilon", help="epsilon of T rounds of DP-FedAvg",
                                 parents=[common, accounting])
    eps.add_argument("--z", type=float, required=True,
                     help="noise multiplier: noise stddev over the clip norm")
    eps.set_defaults(func=cmd_privacy_epsilon)
    noise = privacy_sub.add_parser("noise", help="the noise multiplier z for a target epsilon",
                                   parents=[common, accounting])
    noise.add_argument("--epsilon", type=float, required=True,
                       help="the target epsilon after T rounds")
    noise.set_defaults(func=cmd_privacy_noise)

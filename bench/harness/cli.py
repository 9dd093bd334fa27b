"""The command-line options the checked and timed benchmarks share."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence


def add_run_args(ap: argparse.ArgumentParser, *, time_failed: bool = False) -> None:
    """--out, --smoke, --shapes, the checks' and the timing's options, --budget-s, --paired."""
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder of the results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU-friendly")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 3)")
    ap.add_argument("--timed", type=int, default=None, help="timed samples (default 10)")
    ap.add_argument("--repeats", type=int, default=3, help="runs compared bitwise")
    ap.add_argument("--sample-s", type=float, default=None, help="least time of one sample")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no candidate after this many seconds (skipped ones are recorded)",
    )
    ap.add_argument(
        "--paired",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time candidates in alternation with the yardstick (default: on)",
    )
    ap.add_argument(
        "--time-failed",
        action=argparse.BooleanOptionalAction,
        default=time_failed,
        help=f"time a candidate that failed its check, flagged (default: {time_failed})",
    )


def check_run_args(ap: argparse.ArgumentParser, args: argparse.Namespace, shapes: Sequence):
    """Fills the smoke-dependent defaults and picks `args.shape_list` from `shapes` (objects
    with a `name`) by --shapes; errors name what is wrong."""
    args.warmup = (0 if args.smoke else 3) if args.warmup is None else args.warmup
    args.timed = (2 if args.smoke else 10) if args.timed is None else args.timed
    args.sample_s = (0.0 if args.smoke else 0.005) if args.sample_s is None else args.sample_s
    if args.repeats < 1 or args.timed < 1 or args.warmup < 0:
        ap.error(f"{args.repeats=} and {args.timed=} must be >= 1, {args.warmup=} >= 0")
    if not args.smoke and (args.repeats < 3 or args.timed < 10):
        ap.error("outside --smoke: --repeats >= 3 and --timed >= 10")
    args.shape_list = pick(ap, args.shapes, shapes, "shape")


def pick(ap: argparse.ArgumentParser, text: str, known: Sequence, what: str) -> list:
    """The entries of `known` (objects with a `name`, or strings) named in comma-separated
    `text`, in that order; all of them, in `known`'s order, for an empty `text`."""
    names = [n for n in text.split(",") if n]
    name_of = {getattr(k, "name", k): k for k in known}
    unknown = sorted(set(names) - set(name_of))
    if unknown:
        ap.error(f"unknown {what}s {unknown}; known: {list(name_of)}")
    return [name_of[n] for n in names] if names else list(known)

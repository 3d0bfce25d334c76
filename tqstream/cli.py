"""``tqstream COMMAND``: the command-line entry.

``status`` watches a running cluster (``tqstream.observe.status``); ``demo`` runs the reference
pipeline (``tqstream.reference.demo``), imported only when asked for: it loads the tiny model,
the trainer and the rollout engines. ``tqstream-launch`` (starting a cluster) is a command of its
own.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from tqstream.observe import status

    p = argparse.ArgumentParser(
        prog="tqstream",
        description="tqstream: the experience data plane for async RL.",
        epilog="To start a cluster (a controller and storage units as processes), run "
        "tqstream-launch (tqstream-launch --help).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser(
        "status",
        help="watch a running cluster: a live view, or JSON for scripts",
        description=status.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status.add_arguments(s)
    s.set_defaults(parser=s)  # its errors print its usage
    # the demo parses its own options (tqstream demo --help lists them)
    sub.add_parser("demo", help="run the reference pipeline (tqstream demo --help)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from tqstream.reference.demo import main as demo

        return demo(rest)
    if rest:
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from tqstream.observe import status

    return status.run(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())

"""`soma-runtime` entry point: one subcommand per job, logs to stderr, results to stdout."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from soma_runtime import __version__


def cmd_backends(args) -> int:
    from soma_runtime.backends import detect_all
    report = detect_all()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, info in report.items():
        state = "available" if info.get("available") else "unavailable"
        details = ", ".join(f"{k}={' '.join(v) if isinstance(v, list) else v}" for k, v in info.items() if k != "available")
        print(f"{name:10s} {state:12s} {details}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="soma-runtime", description="Load any model format and run inference on any hardware.")
    p.add_argument("--version", action="version", version=f"soma-runtime {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("backends", help="list the backends found on this machine and what each detected")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.set_defaults(run=cmd_backends)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

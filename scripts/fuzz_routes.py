"""Fuzz every route of a real server for a long while: the harness of tests/test_fuzz_routes.py,
round after round (each round a new seed) until the case count is reached.

    python scripts/fuzz_routes.py --cases 50000

Prints the cases and statuses per route and, for any answer >= 500 (or none), the request as a
curl command and the server's traceback; exits 1 if there was any.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from checkpoints import KINDS, write_checkpoint
from route_fuzz import MODEL, FuzzReport, fuzz_round, fuzz_server


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=50_000, help="stop after this many cases")
    parser.add_argument("--per-round", type=int, default=100, help="cases of each kind per route in a round")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first round (round k: seed + k)")
    parser.add_argument("--checkpoint", choices=KINDS, default="nemotron", help="tiny random checkpoint served")
    parser.add_argument("--max-minutes", type=float, default=None, help="also stop after this long")
    return parser.parse_args()


def print_failures(report: FuzzReport) -> None:
    for f in report.failures:
        print(f"\n{f.route} -> {f.status}\n  {f.curl}\n  response: {f.response[:2000]}\n{f.server_traceback}")


def main() -> int:
    args = parse_args()
    report = FuzzReport()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model_path = write_checkpoint(args.checkpoint, Path(tmp) / "model")
        with fuzz_server(model_path, str(Path(tmp) / "snapshots")) as server:
            round_ = 0
            while report.total < args.cases and (args.max_minutes is None or time.monotonic() - start < 60 * args.max_minutes):
                fuzz_round(server.url, MODEL, args.per_round, args.seed + round_, report)
                round_ += 1
                print(f"round {round_}: {report.total} cases, {len(report.failures)} failures, {time.monotonic() - start:.0f} s", flush=True)
    print(report.summary())
    print_failures(report)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The `engram` command (also `python -m engram`)."""

from __future__ import annotations

import argparse

from engram import bench, chat, launch_server, plan


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(prog="engram", description="Serving engine for state-space and hybrid language models")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the HTTP server (default model: the embedded demo)")
    launch_server.add_server_args(serve)
    serve.set_defaults(run=launch_server.run)

    plan_parser = commands.add_parser("plan", help="print the memory budget of a configuration")
    plan.add_plan_arguments(plan_parser)
    plan_parser.set_defaults(run=plan.run_plan)

    bench_parser = commands.add_parser("bench", help="measure offline prefill and decode throughput")
    bench.add_bench_args(bench_parser)
    bench_parser.set_defaults(run=bench.run)

    chat_parser = commands.add_parser("chat", help="chat in the terminal with a running server")
    chat.add_chat_args(chat_parser)
    chat_parser.set_defaults(run=chat.run)

    ns = parser.parse_args(argv)
    return ns.run(ns)

"""The `engram` command (also `python -m engram`)."""

from __future__ import annotations

import argparse

from engram import bench, chat, import_snapshots, launch_server, plan

# name, help, the function that adds its flags, the function that runs it
COMMANDS = (
    ("serve", "start the HTTP server (default model: the embedded demo)", launch_server.add_server_args, launch_server.run),
    ("plan", "print the memory budget of a configuration", plan.add_plan_arguments, plan.run_plan),
    ("bench", "measure offline prefill and decode throughput", bench.add_bench_args, bench.run),
    ("chat", "chat in the terminal with a running server", chat.add_chat_args, chat.run),
    ("import-snapshots", "import the SGLang-based predecessor's snapshot folder (offline)", import_snapshots.add_import_args, import_snapshots.run),
)


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(prog="engram", description="Serving engine for state-space and hybrid language models")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_args, run in COMMANDS:
        sub = commands.add_parser(name, help=help_text)
        add_args(sub)
        sub.set_defaults(run=run)
    ns = parser.parse_args(argv)
    return ns.run(ns)

"""Start-up: the banner logged before ready, and the warm-up that `/health` waits for."""

from __future__ import annotations

import logging

from engram.args import ServerArgs
from engram.server.serving import Serving
from engram.state.snapshot import reason_without_paths

log = logging.getLogger("engram.server")


def banner(serving: Serving, args: ServerArgs, url: str) -> str:
    """One block of what the server runs with: model, dtype, device and kernels, the memory plan,
    limits, the snapshots and tiers, the URL."""
    manager = serving.conversations.manager
    snapshots = (
        f"{manager.root}, policy {args.snapshot_trigger_policy}, durability {args.snapshot_durability}" if manager.root else "off (not persisted)"
    )
    tiers = (
        f"ACTIVE slots (idle {args.conversation_active_timeout:g} s), WARM host memory ({args.max_warm_memory_gb:g} GiB, "
        f"{args.max_warm_conversations} conversations), COLD snapshots"
        if args.enable_memory_tiers
        else "off (every turn restores its snapshot)"
    )
    rows = {
        "served as": serving.model_name,
        **serving.engine.engine.describe(),
        "snapshots": snapshots,
        "tiers": tiers,
        "resent histories": "encoded past the last added token a recent prompt shares"
        if serving.prompt_encoder.enabled
        else "encoded whole (the tokenizer's pieces depend on what precedes them)",
        "cold loads read into": f"{manager.host_arena.capacity / (1 << 30):g} GiB page-locked at start-up"
        if manager.host_arena is not None
        else "memory allocated for each load",
        "warm-up": "on" if args.enable_warmup else "off",
        "url": url,
    }
    width = max(map(len, rows))
    return "Engram server\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items())


async def warm_up(serving: Serving, enabled: bool) -> None:
    """Warm the engine up (a log line per stage), then let `/health` answer 200."""
    state = serving.startup

    def on_stage(name: str, number: int, count: int) -> None:
        state.stage = f"{number}/{count} {name}"
        log.info("warm-up %d/%d: %s", number, count, name)

    try:
        report = await serving.engine.warm_up(on_stage, enabled)
    except Exception as e:
        log.exception("warm-up failed: the server stays unready")
        state.status, state.stage = "failed", f"warm-up failed: {type(e).__name__}: {reason_without_paths(e)}"  # /health is open: no paths
        return
    state.status, state.stage = "ready", "ready"
    if report is not None:
        log.info(
            "ready: warm-up took %.1f s (%d CUDA graphs captured, %d kernels compiled)",
            report.seconds,
            report.graph_captures,
            report.kernel_compilations,
        )
    else:
        log.info("ready (warm-up off)")

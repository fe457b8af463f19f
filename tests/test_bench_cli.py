"""`engram bench` runs the engine offline on a checkpoint and reports what it measured."""

from __future__ import annotations

import re

from engram import cli


def test_bench_command_reports_prefill_and_decode(checkpoint_dir, capsys):
    cli.main(
        ["bench", "--model-path", checkpoint_dir("nemotron"), "--batch", "2", "--prompt-len", "8", "--output-len", "4", "--max-total-tokens", "1024"]
    )
    out = capsys.readouterr().out
    assert "NemotronHForCausalLM" in out
    assert re.search(r"batch 2 x 8 prompt tokens: prefill [\d.]+ ms \([\d,]+ tok/s\)", out)
    assert re.search(r"decode 3 steps: [\d.]+ ms \([\d,]+ tok/s, [\d.]+ ms/step\)", out)

"""`<think>...</think>` reasoning. Qwen3 writes both tags itself (with `enable_thinking: false` its
template closes an empty block in the prompt, and the reply is all content); DeepSeek-R1's
template opens the block in the prompt, so its reply has only the closing tag; Nemotron's does
either, and with `enable_thinking: false` its reply is all content."""

from __future__ import annotations

from engram.server.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    starts, ends = ("<think>",), ("</think>",)


class DeepSeekR1ReasoningParser(Qwen3ReasoningParser):
    implicit_start = True


class NemotronReasoningParser(DeepSeekR1ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str, str]:
        if self.template_kwargs.get("enable_thinking") is False:
            return "", text
        return super().split(text, final)

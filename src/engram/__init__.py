"""Engram: a serving engine for state-space and hybrid language models with exact, durable state."""

from engram.engine.request import RequestOutput, SamplingParams
from engram.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput"]

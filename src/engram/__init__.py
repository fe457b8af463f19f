"""Engram: a serving engine for state-space and hybrid language models with exact, durable state."""

from engram.client import SnapshotManager
from engram.engine.request import RequestOutput, SamplingParams
from engram.llm import LLM
from engram.runtime import Runtime

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Runtime", "SnapshotManager"]

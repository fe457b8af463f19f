"""Offline API in vLLM's shape: `LLM(model_path).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, cast

from engram.args import EngineArgs
from engram.engine.engine import LLMEngine
from engram.engine.request import RequestOutput, SamplingParams
from engram.models.builtin import resolve_model

Prompt = str | dict[str, Any] | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs(model_path=resolve_model(model).path, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, list):
            return list(prompt)
        if self.engine.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: pass {'prompt_token_ids': [...]}")
        return self.engine.tokenizer.encode(prompt, add_special_tokens=False)

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        batch = _as_batch(prompts)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(batch)
        order = []
        for prompt, p in zip(batch, params_list):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, self._prompt_ids(prompt), dataclasses.replace(p))
            order.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[r] for r in order]


def _as_batch(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """One prompt (text, {"prompt_token_ids": [...]} or a list of ids) or a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return cast(list[Prompt], prompts)

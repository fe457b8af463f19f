"""`--speculative-config`: vLLM's JSON object, checked once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_METHODS = ("ngram", "mtp")
_DEFAULT_LOOKUP = 5
_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


class SpeculativeConfigError(ValueError):
    """A --speculative-config the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def parse(cls, raw: str | dict[str, Any]) -> SpeculativeConfig:
        """A JSON string or a dict (the offline API), as vLLM takes it."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - _FIELDS)
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
        method = raw.get("method")
        if method not in _METHODS:
            raise SpeculativeConfigError(f"--speculative-config: method must be one of {list(_METHODS)}, got {method!r}")
        if method == "mtp":
            raise SpeculativeConfigError(
                "--speculative-config: method 'mtp' needs a checkpoint with MTP layers (mtp.* weights); "
                "no supported architecture has them yet: use method 'ngram'"
            )
        k = _int(raw, "num_speculative_tokens", required=True)
        # As vLLM: one bound given stands for both; neither: 5.
        lookup_max = _int(raw, "prompt_lookup_max") or _int(raw, "prompt_lookup_min") or _DEFAULT_LOOKUP
        lookup_min = _int(raw, "prompt_lookup_min") or _int(raw, "prompt_lookup_max") or _DEFAULT_LOOKUP
        if lookup_min > lookup_max:
            raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min ({lookup_min}) exceeds prompt_lookup_max ({lookup_max})")
        return cls(str(method), k, lookup_max, lookup_min)


def speculative_tokens(raw: str | dict[str, Any] | None) -> int:
    """k of a --speculative-config (0: none), for the memory plan."""
    return 0 if raw is None else SpeculativeConfig.parse(raw).num_speculative_tokens


def _int(raw: dict[str, Any], name: str, required: bool = False) -> int:
    """A positive integer field; 0 when absent and not required."""
    if name not in raw:
        if required:
            raise SpeculativeConfigError(f"--speculative-config: {name} is required")
        return 0
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpeculativeConfigError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
    return value

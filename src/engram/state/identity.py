"""Fingerprints that say which model and tokenizer a snapshot belongs to.

A snapshot resumes exactly only under the model (architecture, config, weights) and tokenizer that
made it. These fingerprints are computed once at startup and stored in every snapshot manifest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engram.models.spec import ModelSpec

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
FULL_HASH_LIMIT = 256 << 20  # below this total, weights are hashed in full
SAMPLE_SIZE = 1 << 20
SAMPLES_PER_FILE = 16
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelIdentity:
    architecture: str
    config_sha256: str
    weights_fingerprint: str

    @classmethod
    def of(cls, spec: ModelSpec, model_path: str | Path) -> ModelIdentity:
        return cls(spec.architecture, spec.config_sha256, weights_fingerprint(model_path))


def safetensors_header(f: BinaryIO) -> bytes:
    """The JSON header bytes of an open safetensors file (8-byte little-endian length, then JSON)."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise ValueError(f"truncated: {len(prefix)} bytes, shorter than the 8-byte header length")
    length = int.from_bytes(prefix, "little")
    if length > _MAX_HEADER:
        raise ValueError(f"header length {length} exceeds {_MAX_HEADER}")
    raw = f.read(length)
    if len(raw) < length:
        raise ValueError(f"truncated: header needs {length} bytes, only {len(raw)} present")
    return raw


def tokenizer_fingerprint(model_path: str | Path) -> str:
    """sha256 over the tokenizer files and chat templates present, in sorted name order, names included."""
    root = Path(model_path)
    names = [n for n in TOKENIZER_FILES if (root / n).is_file()]
    names += [p.relative_to(root).as_posix() for p in (root / "additional_chat_templates").glob("*.jinja")]
    h = hashlib.sha256()
    for name in sorted(names):
        data = (root / name).read_bytes()
        # Name and length frame each file, so no two different file sets hash alike.
        h.update(f"{name}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def _sample_offsets(length: int) -> list[int]:
    if length <= SAMPLE_SIZE * SAMPLES_PER_FILE:
        return list(range(0, length, SAMPLE_SIZE))
    step = (length - SAMPLE_SIZE) / (SAMPLES_PER_FILE - 1)
    return [round(i * step) for i in range(SAMPLES_PER_FILE)]


def weights_fingerprint(model_path: str | Path) -> str:
    """sha256 over every `*.safetensors` file of the checkpoint: name, size, header JSON, tensor data.

    When the files total less than FULL_HASH_LIMIT (256 MiB) all tensor data is hashed. Above
    that, hashing tens of GiB at every startup is too slow, so only SAMPLES_PER_FILE evenly spaced
    SAMPLE_SIZE (1 MiB) samples of each file's data are hashed; with the header (every tensor's
    name, dtype, shape and offsets) and the size this tells checkpoints apart in practice, but a
    change that touches no sampled byte goes unnoticed.
    """
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    full = sum(p.stat().st_size for p in files) < FULL_HASH_LIMIT
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = safetensors_header(f)
            h.update(f"{path.name}\0{size}\0{len(header)}\0".encode() + header)
            data_start = 8 + len(header)
            offsets = range(data_start, size, _CHUNK) if full else [data_start + o for o in _sample_offsets(size - data_start)]
            for offset in offsets:
                f.seek(offset)
                h.update(f.read(_CHUNK if full else SAMPLE_SIZE))
    return h.hexdigest()

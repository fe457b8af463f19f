"""One conversation as one self-contained file, to move it between servers: an uncompressed tar of

    engram-export.json            {"format": "engram-export/1", "record": <the conversation record>}
    turns/<branch>/<turn:06d>.json    each snapshotted turn's v2 manifest (or .safetensors: a v1 file)
    store/kv/<key>.safetensors    every store file those manifests name, once
    store/ckpt/<key>.safetensors

Nothing in an imported file becomes a path unless it matches these names (ids checked, keys 64
hex digits); an import is checked like a snapshot (every turn's state loads and verifies) before
the conversation is listed, and refused whole otherwise.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from engram.state.snapshot import SnapshotCorruptError

FORMAT = "engram-export/1"
INDEX_NAME = "engram-export.json"
_TURN_RE = re.compile(r"turns/([A-Za-z0-9_-][A-Za-z0-9_.-]{0,127})/([0-9]{6})\.(json|safetensors)")
_STORE_RE = re.compile(r"store/(kv|ckpt)/([0-9a-f]{64})\.safetensors")
MAX_INDEX_BYTES = 1 << 30  # the record: every token and message of the conversation


@dataclass
class Export:
    """What an export holds, gathered under the manager's lock; the files are read afterwards
    (immutable store files; manifests are copied into `turns`)."""

    record: dict[str, Any]
    turns: dict[str, bytes] = field(default_factory=dict)  # member name -> manifest or v1 file bytes
    store_files: dict[str, str] = field(default_factory=dict)  # member name -> path on disk


def write_export(export: Export, out: IO[bytes]) -> None:
    with tarfile.open(fileobj=out, mode="w|") as tar:
        _add_bytes(tar, INDEX_NAME, json.dumps({"format": FORMAT, "record": export.record}).encode())
        for name, data in export.turns.items():
            _add_bytes(tar, name, data)
        for name, path in export.store_files.items():
            tar.add(path, arcname=name, recursive=False)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def read_export(src: IO[bytes]) -> Iterator[tuple[str, object]]:
    """The members of an export in order, checked by name: ("index", record), ("turn",
    (branch, turn, suffix, bytes)), ("store", (kind, key, stream)). Anything else is refused."""
    try:
        with tarfile.open(fileobj=src, mode="r|") as tar:
            for member in tar:
                if not member.isfile():
                    raise SnapshotCorruptError(f"the export holds {member.name!r:.80}, which is not a file")
                stream = tar.extractfile(member)
                assert stream is not None
                if member.name == INDEX_NAME:
                    if member.size > MAX_INDEX_BYTES:
                        raise SnapshotCorruptError("the export's record is too large")
                    index = json.loads(stream.read())
                    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("record"), dict):
                        raise SnapshotCorruptError(f"not an export of format {FORMAT!r}")
                    yield "index", index["record"]
                elif match := _TURN_RE.fullmatch(member.name):
                    yield "turn", (match.group(1), int(match.group(2)), match.group(3), stream.read())
                elif match := _STORE_RE.fullmatch(member.name):
                    yield "store", (match.group(1), match.group(2), stream)
                else:
                    raise SnapshotCorruptError(f"the export holds an unexpected member {member.name!r:.80}")
    except (tarfile.TarError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotCorruptError(f"the export is not a readable tar of format {FORMAT!r}: {e}") from e

"""Snapshot format v1 (DESIGN.md): one safetensors file per conversation turn.

    <root>/<conversation_id>/<branch>/<turn:06d>.safetensors

The file holds `tokens` (int32 [n]) and the state tensors named by `expected_tensors`; its header
metadata key "engram" holds the JSON manifest. A save is one atomic commit (temp file, fsync,
rename, folder fsync); a load returns nothing unless every check passes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

from engram.models.spec import ModelSpec
from engram.state.identity import ModelIdentity, safetensors_header
from engram.state.sequence_state import SequenceState, StateDtypes, check_state

FORMAT = "engram-state/1"
MAX_TURN = 999_999  # turns are six digits in file names
# No leading dot: names that begin with one (temp files) are the folder's own.
_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_PARENT_RE = re.compile(_ID_RE.pattern + r"/[0-9]{6}")
_SNAPSHOT_NAME_RE = re.compile(r"[0-9]{6}\.(safetensors|json)")  # v1 files, v2 manifests (state/manifest.py)
# atomic_write's temp files are named .<name>.tmp-<writer>-<hex>, <writer> unique to this process
# (a PID is not: a container's server is PID 1 after every restart).
_WRITER = secrets.token_hex(6)
_TEMP_NAME_RE = re.compile(r"\..+\.tmp-([0-9a-f]{12})-[0-9a-f]{8}")

log = logging.getLogger(__name__)


class SnapshotError(Exception):
    """Base of every snapshot failure; the message says what failed."""


class SnapshotNotFoundError(SnapshotError):
    pass


class SnapshotCorruptError(SnapshotError):
    """The file is unreadable, incomplete or inconsistent with its own manifest."""


class SnapshotIncompatibleError(SnapshotError):
    """A sound snapshot made by another format, model, tokenizer, layout or state dtype."""


class InvalidIdError(SnapshotError, ValueError):
    pass


class SnapshotLinkError(SnapshotError, OSError):
    """A symbolic link under the snapshot folder where a folder or file of its own is expected: it
    is not ours, and is never followed nor deleted through (an OSError: the storage refused)."""


# The snapshot folder's own records (a conversation's, in its folder; the quarantine list, at the
# top), whose names no conversation or branch may take.
RECORD_NAME = "conversation.json"
QUARANTINE_NAME = "quarantine.json"
RESERVED_IDS = (RECORD_NAME, QUARANTINE_NAME)


def validate_id(value: str, what: str) -> str:
    """Return `value` if it is a safe path component: `[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}` (no
    leading dot, which rules out '.', '..' and temp file names) and not a name of the folder's own
    records."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value) or value in RESERVED_IDS:
        raise InvalidIdError(
            f"invalid {what} {value!r:.80}: ids are 1-128 characters of A-Z a-z 0-9 _ . -, not beginning with '.', "
            f"and not {' or '.join(RESERVED_IDS)}"
        )
    return value


def _validate_turn(turn: int) -> int:
    if not isinstance(turn, int) or isinstance(turn, bool) or not 1 <= turn <= MAX_TURN:
        raise InvalidIdError(f"invalid turn {turn!r:.80}: must be an integer in 1..{MAX_TURN}")
    return turn


@dataclass(kw_only=True)
class SnapshotMeta:
    conversation_id: str
    branch: str = "main"
    turn: int
    parent: str | None = None  # "<branch>/<turn:06d>" of the snapshot this one continues
    created_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_id(self.conversation_id, "conversation_id")
        validate_id(self.branch, "branch")
        _validate_turn(self.turn)
        if self.parent is not None and not (isinstance(self.parent, str) and _PARENT_RE.fullmatch(self.parent)):
            raise InvalidIdError(f"invalid parent {self.parent!r:.80}: expected '<branch>/<turn:06d>'")


def snapshot_label(path: str | Path) -> str:
    """A snapshot file as error messages name it: conversation/branch/turn file, the path below the
    snapshot folder. The messages reach API clients, which the server's own paths are not for."""
    return "/".join(Path(path).parts[-3:])


def reason_without_paths(e: Exception) -> str:
    """Why a read or write failed, for a message that reaches API clients: an OSError's text names
    the server's path, its strerror does not."""
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    return str(e)


def snapshot_path(root: str | Path, conversation_id: str, branch: str, turn: int) -> Path:
    """The snapshot's path, after checking that none of it below `root` is a link (`check_no_links`)."""
    path = Path(root) / validate_id(conversation_id, "conversation_id") / validate_id(branch, "branch") / f"{_validate_turn(turn):06d}.safetensors"
    return check_no_links(Path(root), path)


def check_no_links(root: Path, path: Path) -> Path:
    """`path`, after checking (lstat) that none of its components below `root` is a symbolic link;
    those that do not exist yet are fine. A link raises SnapshotLinkError (and is logged)."""
    below = root
    for part in path.relative_to(root).parts:
        below = below / part
        if not _exists_not_a_link(root, below):
            break
    return path


def check_no_links_under(root: Path, folder: Path) -> None:
    """`check_no_links` for `folder` and everything under it (links are listed, never entered)."""
    check_no_links(root, folder)
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            _exists_not_a_link(root, Path(parent) / name)


def _exists_not_a_link(root: Path, path: Path) -> bool:
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISLNK(mode):
        log.warning("refusing %s: a symbolic link under the snapshot folder is never followed", path)
        raise SnapshotLinkError(
            f"{path.relative_to(root).as_posix()} in the snapshot folder is a symbolic link, which the server never "
            "follows or deletes through; replace it with the folder or file itself"
        )
    return True


def read_no_follow(path: Path) -> bytearray:
    """The file's bytes (writable, so tensors can view them), refusing (ELOOP) to open it through a
    symbolic link."""
    with open(path, "rb", opener=_no_follow) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        if f.readinto(data) != len(data):
            raise OSError(5, "the file changed size while it was read")
        return data


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_names(dtypes: StateDtypes) -> dict[str, str]:
    return {f.name: _dtype_name(getattr(dtypes, f.name)) for f in fields(dtypes)}


def _tensor_digest(name: str, t: torch.Tensor) -> bytes:
    t = t.contiguous()
    h = hashlib.sha256(f"{name}\0{_dtype_name(t.dtype)}\0{','.join(map(str, t.shape))}\0".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def tensor_checksum(tensors: Mapping[str, torch.Tensor], threads: int = 8) -> str:
    """sha256 over the per-tensor sha256 digests in sorted name order. A tensor's digest covers the
    UTF-8 bytes of `f"{name}\\0{dtype}\\0{comma-joined shape}\\0"` (dtype as torch names it, e.g.
    "bfloat16") followed by its raw little-endian element bytes in row-major order, exactly as
    stored on disk. Tensors are hashed in parallel threads (hashlib releases the GIL), so a
    long history's gigabyte of KV is verified at several times one core's hashing speed.
    Tensors must be on the CPU. `threads`: at most this many (1: in the caller's thread, for
    callers that already hash several files in parallel)."""
    names = sorted(tensors)
    if threads <= 1:
        return hashlib.sha256(b"".join(_tensor_digest(name, tensors[name]) for name in names)).hexdigest()
    with ThreadPoolExecutor(max_workers=min(threads, os.cpu_count() or 1)) as pool:
        digests = pool.map(lambda name: _tensor_digest(name, tensors[name]), names)
        return hashlib.sha256(b"".join(digests)).hexdigest()


def _check_tokens(tokens: torch.Tensor | None, token_count: Any, state_len: Any, vocab_size: int) -> None:
    """Raise ValueError unless `tokens` is int32 [token_count] of in-vocabulary ids covering `state_len`."""
    if tokens is None:
        raise ValueError("the 'tokens' tensor is missing")
    if tokens.dtype != torch.int32 or tokens.dim() != 1:
        raise ValueError(f"tokens must be int32 [n], got {_dtype_name(tokens.dtype)} {tuple(tokens.shape)}")
    if tokens.numel() != token_count:
        raise ValueError(f"tokens holds {tokens.numel()} ids but token_count is {token_count!r}")
    if not isinstance(state_len, int) or not 0 <= state_len <= token_count:
        raise ValueError(f"state_len {state_len!r} outside 0..{token_count}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids outside the vocabulary 0..{vocab_size - 1}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(folder: Path) -> None:
    """mkdir -p, fsyncing each new folder's parent so the folders survive a crash too."""
    missing = []
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        _fsync_dir(d.parent)


def atomic_write(path: Path, data: bytes) -> None:
    """Readers see the old file or the complete new one, never a part; a failure leaves no temp file."""
    _make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{_WRITER}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def is_stale_temp_file(path: Path) -> bool:
    """Whether `path` is the temp file of a write by an earlier process (killed before it finished):
    a regular file (never a folder or a link) named as `atomic_write` names them."""
    match = _TEMP_NAME_RE.fullmatch(path.name)
    return match is not None and match.group(1) != _WRITER and stat.S_ISREG(os.lstat(path).st_mode)


def save_snapshot(
    root: str | Path,
    state: SequenceState,
    meta: SnapshotMeta,
    spec: ModelSpec,
    dtypes: StateDtypes,
    model: ModelIdentity,
    tokenizer_sha256: str,
) -> Path:
    """Write `state` as snapshot `meta.turn` of `meta.branch`, replacing any earlier file of that turn."""
    state.wait()
    try:
        check_state(spec, dtypes, state)
        tokens = torch.tensor(state.tokens, dtype=torch.int32)
        _check_tokens(tokens, len(state.tokens), state.state_len, spec.vocab_size)
    except (ValueError, RuntimeError) as e:  # RuntimeError: a token id overflows int32
        raise SnapshotError(f"refusing to save an invalid state: {e}") from e
    path = snapshot_path(root, meta.conversation_id, meta.branch, meta.turn)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.flat_tensors().items()}
    tensors["tokens"] = tokens
    manifest = manifest_fields(FORMAT, state, meta, spec, dtypes, model, tokenizer_sha256, tensor_checksum(tensors))
    metadata = {"engram": json.dumps(manifest, sort_keys=True, allow_nan=False)}
    atomic_write(path, safetensors.torch.save(tensors, metadata=metadata))
    return path


def manifest_fields(
    fmt: str,
    state: SequenceState,
    meta: SnapshotMeta,
    spec: ModelSpec,
    dtypes: StateDtypes,
    model: ModelIdentity,
    tokenizer_sha256: str,
    checksum: str,
) -> dict[str, Any]:
    """The manifest fields every snapshot format has (what the compatibility check and listings read)."""
    return {
        "format": fmt,
        "model": asdict(model),
        "tokenizer": {"sha256": tokenizer_sha256},
        "layout": spec.layout(),
        "dtypes": dtype_names(dtypes),
        "conversation_id": meta.conversation_id,
        "branch": meta.branch,
        "turn": meta.turn,
        "parent": meta.parent,
        "created_at": meta.created_at,
        "state_len": state.state_len,
        "token_count": len(state.tokens),
        "checksum": checksum,
        "extra": meta.extra,
    }


def _read_header(path: Path, where: str) -> dict[str, Any]:
    """The parsed safetensors header, after checking the file holds all the tensor data it describes
    (`where`: the file as error messages name it)."""
    try:
        with open(path, "rb", opener=_no_follow) as f:
            size = os.fstat(f.fileno()).st_size
            raw = safetensors_header(f)
    except FileNotFoundError:
        raise SnapshotNotFoundError(f"no snapshot at {where}") from None
    except (OSError, ValueError) as e:
        raise SnapshotCorruptError(f"{where}: unreadable header: {reason_without_paths(e)}") from e
    return check_header(raw, where, size)


def check_header(raw: bytes | bytearray, where: str, file_size: int) -> dict[str, Any]:
    """The parsed safetensors header (`raw`: its JSON bytes), after checking that the file's
    `file_size` is what it describes: the file holds all the tensor data, no more."""
    try:
        header: dict[str, Any] = json.loads(raw)  # any other JSON value fails `.items()` below
        data_len = max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)
        complete_size = 8 + len(raw) + data_len
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise SnapshotCorruptError(f"{where}: malformed header: {e!r}") from e
    if file_size != complete_size:
        raise SnapshotCorruptError(f"{where}: truncated or incomplete: header describes {complete_size} bytes, file has {file_size}")
    return header


def parse_manifest(metadata: Any, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads(metadata["engram"])
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotCorruptError(f"{where}: no readable 'engram' manifest in the header ({e!r})") from e
    if not isinstance(manifest, dict):
        raise SnapshotCorruptError(f"{where}: the 'engram' manifest is not a JSON object")
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest: a v2 manifest file (JSON, state/manifest.py) or, for a v1 file, its header
    alone (no tensor data), for fast listing."""
    path = Path(path)
    where = snapshot_label(path)
    if path.suffix != ".json":
        return parse_manifest(_read_header(path, where).get("__metadata__"), where)
    try:
        return parse_manifest({"engram": read_no_follow(path).decode()}, where)
    except FileNotFoundError:
        raise SnapshotNotFoundError(f"no snapshot at {where}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SnapshotCorruptError(f"{where}: unreadable: {reason_without_paths(e)}") from e


def _section(manifest: dict[str, Any], key: str) -> dict[str, Any]:
    value = manifest.get(key)
    return value if isinstance(value, dict) else {}


def check_compatible(
    manifest: dict[str, Any], where: str, spec: ModelSpec, dtypes: StateDtypes, model: ModelIdentity, tokenizer_sha256: str, fmt: str = FORMAT
) -> None:
    """Raise SnapshotIncompatibleError unless the manifest is of format `fmt` and was made by this
    model, tokenizer, layout and state dtypes."""
    if manifest.get("format") != fmt:
        raise SnapshotIncompatibleError(f"{where}: format {manifest.get('format')!r} is not supported here (expected {fmt!r})")
    saved_model = _section(manifest, "model")
    for key, ours in asdict(model).items():
        if saved_model.get(key) != ours:
            raise SnapshotIncompatibleError(f"{where}: made by a different model: {key} is {saved_model.get(key)!r} in the snapshot, {ours!r} here")
    saved_tokenizer = _section(manifest, "tokenizer").get("sha256")
    if saved_tokenizer != tokenizer_sha256:
        raise SnapshotIncompatibleError(
            f"{where}: made with a different tokenizer: sha256 {saved_tokenizer!r} in the snapshot, {tokenizer_sha256!r} here"
        )
    if manifest.get("layout") != spec.layout():
        raise SnapshotIncompatibleError(f"{where}: layer layout differs: {manifest.get('layout')} in the snapshot, {spec.layout()} here")
    saved_dtypes = _section(manifest, "dtypes")
    for key, ours in dtype_names(dtypes).items():
        if saved_dtypes.get(key) != ours:
            raise SnapshotIncompatibleError(f"{where}: state dtype differs: {key} is {saved_dtypes.get(key)!r} in the snapshot, {ours!r} here")


def load_snapshot(
    path: str | Path,
    spec: ModelSpec,
    dtypes: StateDtypes,
    model: ModelIdentity,
    tokenizer_sha256: str,
    device: str | torch.device = "cpu",
) -> tuple[SequenceState, dict[str, Any]]:
    """Load and verify a snapshot: completeness, format, model, tokenizer, layout, dtypes (manifest),
    then checksum, tokens, and every tensor's presence, shape, dtype and finiteness.

    The checksum comes before the per-tensor checks so that a flipped bit reads as corruption,
    not as, say, a non-finite value.
    """
    path = Path(path)
    where = snapshot_label(path)
    _read_header(path, where)  # clear 'not found' / 'truncated' messages before safetensors sees the file
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:
        raise SnapshotCorruptError(f"{where}: unreadable: {reason_without_paths(e)}") from e
    with f:
        manifest = parse_manifest(f.metadata(), where)
        check_compatible(manifest, where, spec, dtypes, model, tokenizer_sha256)
        try:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:
            raise SnapshotCorruptError(f"{where}: unreadable tensor data: {reason_without_paths(e)}") from e
    if tensor_checksum(tensors) != manifest.get("checksum"):
        raise SnapshotCorruptError(f"{where}: checksum mismatch: the tensor data is not what was saved")
    tokens = tensors.pop("tokens", None)
    try:
        _check_tokens(tokens, manifest.get("token_count"), manifest.get("state_len"), spec.vocab_size)
        state = SequenceState(tokens.tolist(), manifest["state_len"], tensors)
        check_state(spec, dtypes, state)
    except ValueError as e:
        raise SnapshotCorruptError(f"{where}: {e}") from e
    state.tensors = {name: t.to(device) for name, t in tensors.items()}
    return state, manifest


def read_tokens(path: str | Path) -> list[int]:
    """The `tokens` tensor of a snapshot (unverified: for listings; `load_snapshot` verifies)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tokens: list[int] = f.get_tensor("tokens").tolist()
            return tokens
    except Exception as e:
        raise SnapshotCorruptError(f"{snapshot_label(path)}: unreadable tokens: {reason_without_paths(e)}") from e


def list_snapshots(root: str | Path, conversation_id: str | None = None) -> list[dict[str, Any]]:
    """Manifest plus "path" of every readable snapshot under `root`, sorted by conversation, branch, turn.

    Temp files of unfinished writes are skipped; an unreadable file is logged and skipped.
    """
    conversations = "*" if conversation_id is None else validate_id(conversation_id, "conversation_id")
    paths = [p for p in Path(root).glob(f"{conversations}/*/*") if _SNAPSHOT_NAME_RE.fullmatch(p.name)]
    entries = []
    for path in sorted(paths, key=lambda p: p.parts[-3:]):
        try:
            entries.append({**read_manifest(path), "path": str(path)})
        except SnapshotError as e:
            log.warning("skipping snapshot: %s", e)
    return entries


def delete_snapshot(path: str | Path) -> None:
    path = Path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        raise SnapshotNotFoundError(f"no snapshot at {snapshot_label(path)}") from None
    _fsync_dir(path.parent)

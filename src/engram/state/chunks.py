"""State store v2 (DESIGN.md): content-addressed KV pieces and recurrent checkpoints.

    <snapshot-dir>/.store/kv/<ab>/<key>.safetensors    the KV of tokens [start, end) of every attention layer, and those tokens
    <snapshot-dir>/.store/ckpt/<ab>/<key>.safetensors  the recurrent tensors after a prefix

Addresses come from prefix hashes: the hash of position p covers the store's identity (model,
tokenizer, layout, dtypes) and every token before p, chained through the multiples of
`chunk_tokens` so that any position's hash costs at most one chunk of hashing past the chain. A
token's KV depends only on its prefix, so a piece's key is its start and its end's prefix hash,
and a checkpoint's key is its position's prefix hash: equal prefixes share their files, whichever
conversation or branch wrote them. Files are immutable; a save writes only the pieces missing
from the store, cut at multiples of `chunk_tokens` and where the stored state it continues ends.
What references a file is the caller's (turn manifests); `sweep` removes what nothing references.
"""

from __future__ import annotations

import array
import hashlib
import io
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import safetensors.torch
import torch

from engram.models.spec import ModelSpec
from engram.state.identity import safetensors_header
from engram.state.sequence_state import KVSegment, SequenceState, StateDtypes, check_state, has_non_finite, recurrent_tensors
from engram.state.snapshot import (
    SnapshotCorruptError,
    SnapshotIncompatibleError,
    atomic_write,
    check_header,
    check_no_links,
    parse_manifest,
    read_no_follow,
    reason_without_paths,
    tensor_checksum,
)
from engram.state.staging import DeviceStaging

STORE_NAME = ".store"  # a leading dot: no conversation id can take it
PIECE_FORMAT = "engram-kv/2"
CHECKPOINT_FORMAT = "engram-checkpoint/2"
DEFAULT_CHUNK_TOKENS = 256
ORPHAN_GRACE_S = 600.0  # a file younger than this may belong to a save whose manifest is not written yet

log = logging.getLogger(__name__)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array.array("i", tokens).tobytes()


class PrefixHasher:
    """Prefix hashes of token sequences under one store identity (see the module docstring)."""

    def __init__(self, identity: bytes, chunk_tokens: int):
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.seed = hashlib.sha256(b"engram-prefix/2\0" + identity + f"\0{chunk_tokens}".encode()).digest()

    def chain(self, tokens: Sequence[int], upto: int) -> list[bytes]:
        """The hashes of positions 0, C, 2C, ... up to `upto` (C: `chunk_tokens`)."""
        c = self.chunk_tokens
        out = [self.seed]
        for k in range(upto // c):
            out.append(hashlib.sha256(out[-1] + _token_bytes(tokens[k * c : (k + 1) * c])).digest())
        return out

    def at(self, tokens: Sequence[int], position: int, chain: list[bytes]) -> bytes:
        """The hash of `position`, from `chain` (which must reach position // C)."""
        k, rest = divmod(position, self.chunk_tokens)
        if not rest:
            return chain[k]
        return hashlib.sha256(chain[k] + b"\1" + _token_bytes(tokens[k * self.chunk_tokens : position])).digest()

    def piece_key(self, tokens: Sequence[int], start: int, end: int, chain: list[bytes]) -> str:
        return hashlib.sha256(self.at(tokens, end, chain) + start.to_bytes(8, "little")).hexdigest()


@dataclass(frozen=True)
class PieceRef:
    start: int
    end: int
    key: str
    checksum: str


@dataclass(frozen=True)
class StoredState:
    """Where a state lives in the store: the pieces of KV [0, state_len), in order, and the
    checkpoint of the recurrent tensors at state_len."""

    state_len: int
    pieces: tuple[PieceRef, ...]
    checkpoint: str
    checkpoint_checksum: str

    def to_json(self) -> dict[str, Any]:
        return {
            "state_len": self.state_len,
            "pieces": [[p.start, p.end, p.key, p.checksum] for p in self.pieces],
            "checkpoint": [self.checkpoint, self.checkpoint_checksum],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoredState:
        try:
            pieces = tuple(PieceRef(int(a), int(b), str(k), str(c)) for a, b, k, c in data["pieces"])
            key, checksum = data["checkpoint"]
            return cls(int(data["state_len"]), pieces, str(key), str(checksum))
        except (KeyError, TypeError, ValueError) as e:
            raise SnapshotCorruptError(f"malformed store references: {e!r}") from e

    @property
    def keys(self) -> set[str]:
        return {p.key for p in self.pieces} | {self.checkpoint}

    @property
    def digest(self) -> str:
        """One checksum over every file's checksum, in order (the manifest's `checksum`)."""
        parts = [p.checksum for p in self.pieces] + [self.checkpoint_checksum]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@dataclass
class StoreStats:
    bytes_written: int = 0
    files_written: int = 0
    files_reused: int = 0  # a piece or checkpoint already stored (another turn, branch or conversation wrote it)
    files_swept: int = 0
    pieces_read: int = 0  # by loads
    pieces_resident: int = 0  # by loads: copied from a state in memory instead
    bytes_read: int = 0  # by loads: the pieces' and checkpoints' files


def kv_tensor_names(spec: ModelSpec) -> list[str]:
    """The names of a state's KV tensors (the rest are recurrent)."""
    return [f"layers.{i}.{kv}" for i in spec.attention_layers for kv in "kv"] if spec.attention is not None else []


class ChunkStore:
    """The files of state store v2 under `<root>/.store` (thread-safe: files are immutable)."""

    def __init__(self, root: Path, spec: ModelSpec, dtypes: StateDtypes, hasher: PrefixHasher):
        self.root = root
        self.dir = root / STORE_NAME
        self.spec, self.dtypes = spec, dtypes
        self.hasher = hasher
        self.identity = hasher.seed.hex()
        self.stats = StoreStats()
        self._kv = kv_tensor_names(spec)

    # ---- paths -------------------------------------------------------------------------------

    def _path(self, kind: str, key: str) -> Path:
        if len(key) != 64 or any(ch not in "0123456789abcdef" for ch in key):
            raise SnapshotCorruptError(f"malformed store key {key!r:.80}")
        return check_no_links(self.root, self.dir / kind / key[:2] / f"{key}.safetensors")

    def piece_path(self, key: str) -> Path:
        return self._path("kv", key)

    def checkpoint_path(self, key: str) -> Path:
        return self._path("ckpt", key)

    # ---- save --------------------------------------------------------------------------------

    def save(self, state: SequenceState, base: StoredState | None = None) -> StoredState:
        """Store `state` (KV of its whole history and its recurrent tensors), writing only the
        pieces and checkpoint not stored yet. `base`, a stored state whose tokens begin this one's,
        lends its pieces; one that does not match these tokens is not used."""
        state.wait()
        check_state(self.spec, self.dtypes, state, check_finite=False)  # values: each new file's, below
        tokens, n = state.tokens, state.state_len
        chain = self.hasher.chain(tokens, n)
        kept: list[PieceRef] = []
        if (
            base is not None
            and base.state_len <= n
            and all(0 <= p.start < p.end <= base.state_len and p.key == self.hasher.piece_key(tokens, p.start, p.end, chain) for p in base.pieces)
        ):
            kept = [self._keep_piece(state, p) for p in base.pieces]
        start = kept[-1].end if kept else 0
        c = self.hasher.chunk_tokens
        cuts = [start, *range((start // c + 1) * c, n, c), n] if start < n else [start]
        new = [self._save_piece(state, a, b, self.hasher.piece_key(tokens, a, b, chain)) for a, b in zip(cuts, cuts[1:])]
        key = self.hasher.at(tokens, n, chain).hex()
        recurrent = {name: t for name, t in state.tensors.items() if name not in self._kv}
        checksum = self._save_file(self.checkpoint_path(key), recurrent, {"format": CHECKPOINT_FORMAT, "position": n})
        return StoredState(n, tuple(kept + new), key, checksum)

    def _keep_piece(self, state: SequenceState, piece: PieceRef) -> PieceRef:
        """A base's piece as stored now (touched, with the checksum its file names), or written
        again from `state` if it is gone."""
        checksum = self._stored_checksum(self.piece_path(piece.key))
        if checksum is None:
            return self._save_piece(state, piece.start, piece.end, piece.key)
        return PieceRef(piece.start, piece.end, piece.key, checksum)

    def _save_piece(self, state: SequenceState, start: int, end: int, key: str) -> PieceRef:
        tensors = {name: state.kv_rows(name, start, end) for name in self._kv}
        tensors["tokens"] = torch.tensor(state.tokens[start:end], dtype=torch.int32)
        checksum = self._save_file(self.piece_path(key), tensors, {"format": PIECE_FORMAT, "start": start, "end": end})
        return PieceRef(start, end, key, checksum)

    def _save_file(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
        """Write one immutable file unless it is stored already (then refreshed, so that a sweep
        running meanwhile keeps it); returns its checksum."""
        stored = self._stored_checksum(path)
        if stored is not None:
            self.stats.files_reused += 1
            return stored
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        for name, t in tensors.items():  # loads trust the values (the checksum proves them unchanged): checked here
            if has_non_finite(t):
                raise ValueError(f"tensor {name} holds non-finite values")
        checksum = tensor_checksum(tensors)
        header = {**meta, "identity": self.identity, "checksum": checksum}
        data = safetensors.torch.save(tensors, metadata={"engram": json.dumps(header, sort_keys=True)})
        atomic_write(path, data)
        self.stats.bytes_written += len(data)
        self.stats.files_written += 1
        return checksum

    @staticmethod
    def _refresh(path: Path) -> bool:
        """Touch a stored file (a sweep spares what was used lately); False if it is not there
        (swept, or set aside as damaged)."""
        try:
            os.utime(path, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _stored_checksum(self, path: Path) -> str | None:
        """The checksum a stored file's header names, after touching it; None if it is not stored
        (or unreadable: it is then written again, replacing it)."""
        if not self._refresh(path):
            return None
        try:
            with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
                size = os.fstat(f.fileno()).st_size
                header = parse_manifest(check_header(safetensors_header(f), path.name, size).get("__metadata__"), path.name)
        except (OSError, ValueError, SnapshotCorruptError):
            return None
        checksum = header.get("checksum")
        return checksum if isinstance(checksum, str) and header.get("identity") == self.identity else None

    def adopt_file(self, kind: str, key: str, stream: IO[bytes]) -> None:
        """Store a file brought from elsewhere (an import) under its key, unless it is stored
        already; it is verified when a manifest that names it is loaded."""
        path = self._path(kind, key)
        if not path.exists():
            atomic_write(path, stream.read())

    # ---- load --------------------------------------------------------------------------------

    def load(
        self,
        stored: StoredState,
        tail_tokens: Sequence[int] = (),
        resident: SequenceState | None = None,
        staging: DeviceStaging | None = None,
    ) -> SequenceState:
        """The state `stored` names, every file verified: complete, this store's identity, its
        checksum, tokens whose prefix hashes are the keys, shapes and dtypes. `resident`: a state
        in memory; the leading pieces whose prefix it holds are not read: the state shares that
        state's KV of their positions (host memory, immutable) and holds the rest as one segment.
        `staging`: also copy the state to a device while reading (see state/staging.py): each
        piece's copy is issued once it is read and verified; `staging.state` is set only when the
        whole state has been verified. The host tensors are then its `host_empty`'s (pinned on
        CUDA), else pageable."""
        pieces = stored.pieces
        if [p.start for p in pieces] != [0, *(p.end for p in pieces[:-1])] or (pieces[-1].end if pieces else 0) != stored.state_len:
            raise SnapshotCorruptError(f"the pieces {[(p.start, p.end) for p in pieces]} do not cover 0..{stored.state_len} in order")
        # Each piece's file is read straight into its rows [start, end) of one tensor per layer, in
        # the readers' threads, and hashed there: one read and one hash per byte, no copy.
        held = self.resident_pieces(pieces, resident)
        rows = pieces[held - 1].end if held else 0
        shared = resident.kv_pieces(0, rows) if resident is not None and held and self._kv else []
        stage = staging if staging is not None and staging.reserve(self._kv_shapes(stored.state_len), self._recurrent_bytes()) else None
        host = staging.host_empty if staging is not None else _pageable  # pinned on CUDA even when nothing is staged: the WARM copy
        kv = {name: host((stored.state_len - rows, *self._kv_row), self.dtypes.kv) for name in self._kv}  # positions rows..state_len-1
        if stage is not None:
            for segment in shared:  # in memory already: its copy goes first
                stage.kv(segment.start, segment.tensors)
        self.stats.pieces_resident += held
        self.stats.pieces_read += len(pieces) - held
        piece_tokens: dict[int, list[int]] = {}
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            checkpoint = pool.submit(self._read, self.checkpoint_path(stored.checkpoint), stored.checkpoint_checksum, CHECKPOINT_FORMAT)
            reads = {pool.submit(self._read_piece, p, kv, rows): p for p in pieces[held:]}
            for done in as_completed(reads):
                p = reads[done]
                piece_tokens[p.start], nbytes = done.result()
                self.stats.bytes_read += nbytes
                if stage is not None:  # read and verified: its copy starts while the others are read
                    stage.kv(p.start, {name: t[p.start - rows : p.end - rows] for name, t in kv.items()})
            tensors, nbytes = checkpoint.result()
            self.stats.bytes_read += nbytes
            recurrent = {name: host(tuple(t.shape), t.dtype).copy_(t) for name, t in tensors.items()}  # the file's buffer can go
            if stage is not None:
                stage.recurrent(recurrent)
        tokens = list(resident.tokens[:rows]) if resident is not None else []
        tokens += [t for start in sorted(piece_tokens) for t in piece_tokens[start]]
        chain = self.hasher.chain(tokens, stored.state_len)
        for p in pieces:
            if self.hasher.piece_key(tokens, p.start, p.end, chain) != p.key:
                raise SnapshotCorruptError(f"store piece {p.key[:12]}: its tokens are not the prefix its key names")
        if self.hasher.at(tokens, stored.state_len, chain).hex() != stored.checkpoint:
            raise SnapshotCorruptError(f"store checkpoint {stored.checkpoint[:12]}: not the checkpoint of these tokens")
        if shared:
            tail = [KVSegment(rows, stored.state_len, kv)] if rows < stored.state_len else []
            state = SequenceState(tokens + list(tail_tokens), stored.state_len, recurrent, kv_segments=(*shared, *tail))
        else:
            state = SequenceState(tokens + list(tail_tokens), stored.state_len, {**recurrent, **kv})
        try:  # values were checked finite when saved, and the checksums say they are what was saved
            check_state(self.spec, self.dtypes, state, check_finite=False)
        except ValueError as e:
            raise SnapshotCorruptError(f"stored state: {e}") from e
        if stage is not None:
            stage.finish(state.tokens, state.state_len)
        return state

    def resident_pieces(self, pieces: Sequence[PieceRef], resident: SequenceState | None) -> int:
        """How many leading pieces `resident` holds: the prefix their keys name is its tokens' (a
        piece's KV depends only on its prefix) and its KV tensors are this store's shapes."""
        if resident is None or not pieces or pieces[0].end > resident.state_len:
            return 0
        resident.wait()
        try:
            segments = resident.kv_pieces()
        except (KeyError, ValueError):  # a resident whose KV does not cover its positions
            return 0
        if any(
            set(s.tensors) != set(self._kv) or any(t.dtype != self.dtypes.kv or tuple(t.shape[1:]) != self._kv_row for t in s.tensors.values())
            for s in segments
        ):
            return 0
        chain = self.hasher.chain(resident.tokens, resident.state_len)
        held = 0
        for p in pieces:
            if p.end > resident.state_len or self.hasher.piece_key(resident.tokens, p.start, p.end, chain) != p.key:
                break
            held += 1
        return held

    @property
    def _kv_row(self) -> tuple[int, ...]:
        """The shape of one position's KV in one tensor (heads, dim)."""
        attention = self.spec.attention
        return (attention.num_kv_heads, attention.head_dim) if attention is not None else ()

    def _kv_shapes(self, state_len: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: ((state_len, *self._kv_row), self.dtypes.kv) for name in self._kv}

    def _recurrent_bytes(self) -> int:
        return sum(dtype.itemsize * math.prod(shape) for shape, dtype in recurrent_tensors(self.spec, self.dtypes).values())

    def _read_piece(self, piece: PieceRef, kv: dict[str, torch.Tensor], offset: int) -> tuple[list[int], int]:
        """Read and verify one piece straight into rows [start, end) - offset of `kv` (no file
        buffer, no copy: the hash runs over the rows just read, in this reader's thread); its
        tokens and the bytes read."""
        rows = piece.end - piece.start
        targets = {name: t[piece.start - offset : piece.end - offset] for name, t in kv.items()}
        targets["tokens"] = torch.empty(rows, dtype=torch.int32)
        path = self.piece_path(piece.key)
        where = f"store file {path.name[:12]}"
        with self._open(path, where) as f:
            size = os.fstat(f.fileno()).st_size
            try:
                try:
                    raw = safetensors_header(f)
                except ValueError as e:
                    raise SnapshotCorruptError(f"{where}: {e}") from e
                header = check_header(raw, where, size)
                parse_manifest(header.get("__metadata__"), where)
            except SnapshotCorruptError:
                self._set_aside(path)
                raise
            self._check_meta(header, where, PIECE_FORMAT)
            entries = {name: e for name, e in header.items() if name != "__metadata__"}
            if set(entries) != set(targets):
                raise SnapshotCorruptError(f"store piece {piece.key[:12]}: holds {sorted(entries)}, expected {sorted(targets)}")
            base = 8 + len(raw)
            for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
                target, (begin, end) = targets[name], entry["data_offsets"]
                if _DTYPES.get(entry["dtype"]) != target.dtype or list(entry["shape"]) != list(target.shape) or end - begin != target.nbytes:
                    raise SnapshotCorruptError(
                        f"store piece {piece.key[:12]}: {name} is {entry['dtype']} {entry['shape']}, expected {target.dtype} {tuple(target.shape)}"
                    )
                if target.nbytes and os.preadv(f.fileno(), [target.reshape(-1).view(torch.uint8).numpy().data], base + begin) != target.nbytes:
                    raise SnapshotCorruptError(f"{where}: the file changed size while it was read")
        if tensor_checksum(targets, threads=1) != piece.checksum:
            self._set_aside(path)
            raise SnapshotCorruptError(f"{where}: checksum mismatch: the data is not what was saved")
        return targets["tokens"].tolist(), size

    def _open(self, path: Path, where: str) -> io.BufferedReader:
        """A stored file opened for reading (never through a link); a missing one is damage."""
        try:
            return open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW))
        except FileNotFoundError:  # a referenced file is gone: damage, not a turn without a snapshot
            found = "was found damaged and set aside" if (self.dir / "damaged" / path.name).exists() else "is missing"
            raise SnapshotCorruptError(f"{where} {found}") from None
        except OSError as e:
            raise SnapshotCorruptError(f"{where}: unreadable: {reason_without_paths(e)}") from e

    def _check_meta(self, header: dict[str, Any], where: str, fmt: str) -> None:
        """A stored file's manifest names `fmt` and this store's identity."""
        meta = parse_manifest(header.get("__metadata__"), where)
        if meta.get("format") != fmt:
            raise SnapshotIncompatibleError(f"{where}: format {meta.get('format')!r}, expected {fmt!r}")
        if meta.get("identity") != self.identity:
            raise SnapshotIncompatibleError(f"{where}: made by another model, tokenizer, layout or state dtype")

    def _read(self, path: Path, checksum: str, fmt: str) -> tuple[dict[str, torch.Tensor], int]:
        """A stored file's tensors, after every check, as views of the file's bytes (read once);
        and how many bytes were read."""
        where = f"store file {path.name[:12]}"
        with self._open(path, where) as f:
            try:
                data = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(data) != len(data):
                    raise OSError(5, "the file changed size while it was read")
            except OSError as e:
                raise SnapshotCorruptError(f"{where}: unreadable: {reason_without_paths(e)}") from e
        try:
            header = _complete_header(data, where)
            parse_manifest(header.get("__metadata__"), where)
        except SnapshotCorruptError:
            self._set_aside(path)
            raise
        self._check_meta(header, where, fmt)
        try:
            tensors = _tensor_views(data, header)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise SnapshotCorruptError(f"{where}: unreadable tensor data: {e}") from e
        if tensor_checksum(tensors, threads=1) != checksum:
            self._set_aside(path)
            raise SnapshotCorruptError(f"{where}: checksum mismatch: the data is not what was saved")
        return tensors, len(data)

    def _set_aside(self, path: Path) -> None:
        """Move a damaged file out of the way (to `.store/damaged/`), so that the next save of the
        same prefix writes it again instead of reusing it."""
        target = self.dir / "damaged" / path.name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except OSError as e:
            log.warning("damaged store file %s could not be set aside: %s", path.name, e)
        else:
            log.warning("store file %s is damaged: moved to %s", path.name, target.relative_to(self.root))

    def read_tokens(self, stored: StoredState) -> list[int]:
        """The tokens of the pieces (unverified beyond their files' completeness: for listings)."""
        out: list[int] = []
        for p in stored.pieces:
            data = read_no_follow(self.piece_path(p.key))
            out += _tensor_views(data, _complete_header(data, p.key[:12]))["tokens"].tolist()
        return out

    # ---- garbage -----------------------------------------------------------------------------

    def sweep(self, referenced: Iterable[str], grace_s: float = ORPHAN_GRACE_S) -> int:
        """Delete every file that no key in `referenced` names and that was not written or reused in
        the last `grace_s` seconds (a save whose manifest is not committed yet). Returns the count."""
        keep = set(referenced)
        cutoff = time.time() - grace_s
        removed = 0
        for kind in ("kv", "ckpt"):
            folder = self.dir / kind
            if not folder.is_dir():
                continue
            for path in folder.glob("*/*"):
                key = path.name.split(".")[0]
                if key in keep:
                    continue
                try:
                    info = os.lstat(path)
                    if info.st_mtime < cutoff:
                        path.unlink()
                        removed += 1
                except FileNotFoundError:
                    continue
        self.stats.files_swept += removed
        return removed


_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I32": torch.int32,
    "I64": torch.int64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _tensor_views(data: bytearray, header: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a complete safetensors file's bytes (`header`: its parsed header), as views
    of them (no copy)."""
    base, out = 8 + int.from_bytes(data[:8], "little"), {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        if end > begin:
            flat = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=base + begin)
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).view(shape)
    return out


def _complete_header(data: bytes | bytearray, where: str) -> dict[str, Any]:
    """The parsed header of a whole safetensors file's bytes, checked to describe all of them."""
    length = int.from_bytes(data[:8], "little")
    if len(data) < 8 + length:
        raise SnapshotCorruptError(f"{where}: truncated header")
    return check_header(data[8 : 8 + length], where, len(data))


def _pageable(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)

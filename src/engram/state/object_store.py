"""The COLD tier in an object store (S3 and S3-compatible, GCS, Azure) through obstore, shared by
replicas behind one router (docs/DEPLOYMENT.md).

The local snapshot folder is a cache in front of the bucket: store files (KV pieces, checkpoints)
are immutable and addressed by hash, so one found there is used without asking the bucket; turn
manifests and conversation records change, so they are always read from the bucket. What is
written goes to the folder and then to the bucket: store files first, then the manifest naming
them, each whole (an object is never seen in part).

Records are the point where replicas meet. Each is written conditionally: a new one only if none
exists (If-None-Match), a changed one only if the bucket still holds the version this process
last read or wrote (If-Match on its ETag). Two replicas that both hold turn n-1 of a conversation
cannot both record turn n: the loser gets `StaleViewError` (409), and its next request for that
conversation reads the record again (`record_current`). A manifest is created the same way, so a
racing replica never overwrites the winner's.

The prefix cache's entries and the quarantine list stay per replica, in the folder. A sweep
clears the folder and then the bucket (state/bucket_gc.py): a store file there goes when no
manifest in the bucket names it and the bucket got it more than the grace period ago. So that a
save whose manifest is not written yet never loses a file it names, every save makes sure the
bucket got each of them within `refresh_s` (half the grace): one it lacks is uploaded, one it got
longer ago is refreshed (copied away and back, server side: same bytes, a new time).
"""

from __future__ import annotations

import errno
import json
import os
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from engram.models.spec import ModelSpec
from engram.state.bucket_gc import REFRESH_PREFIX, BucketSweeper
from engram.state.chunks import ORPHAN_GRACE_S, PrefixHasher, StoredState
from engram.state.cold import FilesystemColdStore
from engram.state.identity import ModelIdentity
from engram.state.manifest import stored_state
from engram.state.sequence_state import SequenceState, StateDtypes
from engram.state.snapshot import (
    RECORD_NAME,
    SnapshotError,
    SnapshotMeta,
    SnapshotNotFoundError,
    atomic_write,
    read_manifest,
    snapshot_label,
    validate_id,
)
from engram.state.staging import DeviceStaging
from engram.state.turns import StaleViewError

if TYPE_CHECKING:
    from obstore import ObjectMeta
    from obstore.store import ClientConfig, ObjectStore, RetryConfig, S3Config

REMOTE_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "memory")
T = TypeVar("T")


class StoreConfigError(ValueError):
    """A --snapshot-store this server cannot use (the message says why)."""


class StoreUnavailableError(OSError):
    """The object store did not answer, or refused for a reason other than a missing object or a
    failed condition (answered 503 with this reason)."""


def remote_url(url: str | None) -> str | None:
    """The object store URL of a --snapshot-store value, None for a local folder (a path or file://)."""
    if url is None or urlsplit(url).scheme in ("", "file"):
        return None
    if urlsplit(url).scheme not in REMOTE_SCHEMES:
        raise StoreConfigError(f"--snapshot-store {url!r}: the scheme is not one of file, {', '.join(REMOTE_SCHEMES)}")
    return url


def local_folder(url: str) -> Path:
    """The folder of a local --snapshot-store value (a path or file:// URL)."""
    parts = urlsplit(url)
    return Path(parts.path) if parts.scheme == "file" else Path(url)


def open_remote(url: str) -> ObjectStore:
    """The obstore store of `url`; credentials and endpoint from the usual environment (AWS_*,
    GOOGLE_*, AZURE_*), short timeouts so that an unreachable store is answered, not waited on."""
    try:
        from obstore.store import from_url
    except ImportError:
        raise StoreConfigError(f"--snapshot-store {url!r} needs obstore: pip install 'engram[s3]'") from None
    config: S3Config | None = {"conditional_put": "etag"} if urlsplit(url).scheme in ("s3", "s3a") else None
    # Client options given here replace the environment's: AWS_ALLOW_HTTP is read again (an http:// endpoint implies it).
    allow_http = os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true" or os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://")
    client: ClientConfig = {"connect_timeout": "2s", "timeout": "30s", "allow_http": allow_http}
    retry: RetryConfig = {
        "max_retries": 2,
        "retry_timeout": timedelta(seconds=10),
        "backoff": {"init_backoff": timedelta(seconds=0.1), "max_backoff": timedelta(seconds=1), "base": 2.0},
    }
    try:
        return from_url(url, config=config, client_options=client, retry_config=retry)
    except Exception as e:  # obstore's configuration errors have no common base of their own
        raise StoreConfigError(f"--snapshot-store {url!r}: {first_line(e)}") from e


def first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


class ObjectColdStore(FilesystemColdStore):
    """Turn states and conversation records in an object store, `cache` (a folder) in front."""

    def __init__(
        self,
        remote: ObjectStore,
        url: str,
        cache: Path,
        spec: ModelSpec,
        dtypes: StateDtypes,
        hasher: PrefixHasher,
        model: ModelIdentity,
        tokenizer_sha256: str,
    ):
        super().__init__(cache, spec, dtypes, hasher, model, tokenizer_sha256)
        self.remote, self.url = remote, url
        self._versions: dict[str, str | None] = {}  # conversation -> its record's ETag as last read or written here (None: it had none)
        self._in_bucket: dict[str, float] = {}  # store file -> when the bucket last got it, as far as this process knows
        self.refresh_s = ORPHAN_GRACE_S / 2  # a file the bucket got longer ago is refreshed before a new manifest names it
        self.sweeper = BucketSweeper(self)

    # ---- the bucket --------------------------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One obstore call; a failure other than a missing object or a failed condition is
        StoreUnavailableError naming the store and the reason."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            return fn(self.remote, *args, **kwargs)
        except (FileNotFoundError, AlreadyExistsError, PreconditionError):
            raise
        except Exception as e:
            raise StoreUnavailableError(errno.EIO, f"the object store {self.url} failed: {first_line(e)}") from e

    def _key(self, path: str | Path) -> str:
        return Path(path).relative_to(self.root).as_posix()

    def get_object(self, key: str) -> tuple[bytes, ObjectMeta]:
        import obstore

        result = self.call(obstore.get, key)
        return bytes(result.bytes()), result.meta

    def put_object(self, key: str, data: bytes, mode: Any = "overwrite") -> str | None:
        """Its ETag; `mode` "create" (If-None-Match) or {"e_tag": ...} (If-Match) for a conditional write."""
        import obstore

        return self.call(obstore.put, key, data, mode=mode)["e_tag"]

    def head_object(self, key: str) -> ObjectMeta:
        import obstore

        return self.call(obstore.head, key)

    def delete_object(self, key: str) -> None:
        import obstore

        self.call(obstore.delete, key)

    def listing(self, prefix: str) -> list[ObjectMeta]:
        """Every object under `prefix`."""
        import obstore

        return self.call(lambda store: [entry for batch in obstore.list(store, prefix) for entry in batch])

    def _exists(self, key: str) -> bool:
        try:
            self.head_object(key)
        except FileNotFoundError:
            return False
        return True

    def _pull(self, location: str) -> Path:
        """The bucket's copy of a manifest, written over the folder's (which goes if the bucket has none)."""
        path = Path(location)
        try:
            data, _ = self.get_object(self._key(path))
        except FileNotFoundError:
            path.unlink(missing_ok=True)
            raise SnapshotNotFoundError(f"{snapshot_label(location)}: not in the store") from None
        atomic_write(path, data)
        return path

    def _push_files(self, stored: StoredState) -> None:
        """Make sure the bucket got every store file `stored` names within `refresh_s`: upload one
        it lacks (an existing one is kept: same key, same content), refresh one it got longer ago
        (a sweep spares what the bucket got within its grace, state/bucket_gc.py)."""
        from obstore.exceptions import AlreadyExistsError

        for path in self._store_files(stored):
            now, known = time.time(), self._in_bucket.get(path.name)
            if known is not None and now - known < self.refresh_s:
                continue
            key = self._key(path)
            try:
                if known is None:  # most likely new: uploaded
                    self.put_object(key, path.read_bytes(), mode="create")
                else:
                    self._refresh(key)
            except AlreadyExistsError:  # another turn, branch or replica uploaded it
                self._refresh(key)
                self.stats.files_reused += 1
            except FileNotFoundError:  # swept since this process knew it
                self.put_object(key, path.read_bytes(), mode="create")
            self._in_bucket[path.name] = now

    def _refresh(self, key: str) -> None:
        """Give an object a new time without changing its bytes: copied away and back, server side
        (S3 refuses a copy onto itself); FileNotFoundError if it is not there."""
        import obstore

        temp = f"{REFRESH_PREFIX}{uuid.uuid4().hex}"
        self.call(obstore.copy, key, temp)
        try:
            self.call(obstore.copy, temp, key)
        finally:
            self.delete_object(temp)

    def forget_uploaded(self, name: str) -> None:
        """A store file the sweep deleted from the bucket: the next save that names it uploads it."""
        self._in_bucket.pop(name, None)

    def _store_files(self, stored: StoredState, skip: int = 0) -> list[Path]:
        """The files `stored` names (past its first `skip` pieces)."""
        return [self.chunks.piece_path(p.key) for p in stored.pieces[skip:]] + [self.chunks.checkpoint_path(stored.checkpoint)]

    def _fetch_files(self, stored: StoredState, resident: SequenceState | None = None) -> None:
        """Download the store files `stored` names that the folder lacks, but for the pieces
        `resident` holds (a load takes those from memory); one the bucket lacks too is left for
        the load to report as missing."""
        for path in self._store_files(stored, self.chunks.resident_pieces(stored.pieces, resident)):
            if not path.is_file():
                try:
                    data, meta = self.get_object(self._key(path))
                except FileNotFoundError:
                    continue
                atomic_write(path, data)
                self._in_bucket[path.name] = meta["last_modified"].timestamp()

    def _fetch_referenced(self, location: str, resident: SequenceState | None = None) -> Path:
        path = self._pull(location)
        stored = stored_state(read_manifest(path), snapshot_label(location))
        if stored is not None:
            self._fetch_files(stored, resident)
        return path

    # ---- turn states ---------------------------------------------------------------------------

    def locate(self, conversation_id: str, branch: str, turn: int, fmt: str | None = None) -> str:
        return super().locate(conversation_id, branch, turn, fmt or "json")  # the bucket holds v2 manifests only

    def exists(self, location: str) -> bool:
        return self._exists(self._key(location))

    def save(self, state: SequenceState, meta: SnapshotMeta, base: StoredState | None) -> StoredState:
        from obstore.exceptions import AlreadyExistsError

        stored = super().save(state, meta, base)
        self._push_files(stored)
        location = self.locate(meta.conversation_id, meta.branch, meta.turn)
        try:
            self.put_object(self._key(location), Path(location).read_bytes(), mode="create")
        except AlreadyExistsError:
            Path(location).unlink(missing_ok=True)
            raise SnapshotError(f"{snapshot_label(location)}: another replica stored this turn first") from None
        return stored

    def load(
        self, location: str, resident: SequenceState | None = None, staging: DeviceStaging | None = None
    ) -> tuple[SequenceState, dict[str, Any]]:
        self._fetch_referenced(location, resident)
        return super().load(location, resident, staging)

    def manifest(self, location: str) -> dict[str, Any]:
        return read_manifest(self._pull(location))

    def references(self, location: str) -> StoredState | None:
        return stored_state(self.manifest(location), snapshot_label(location))

    def tokens(self, manifest: dict[str, Any]) -> list[int]:
        self._fetch_referenced(manifest["path"])
        return super().tokens(manifest)

    def delete(self, location: str) -> None:
        if not self.exists(location):
            raise SnapshotNotFoundError(f"{snapshot_label(location)}: not in the store")
        self.delete_object(self._key(location))
        Path(location).unlink(missing_ok=True)

    def snapshots(self, conversation_id: str) -> list[dict[str, Any]]:
        folder = self.root / validate_id(conversation_id, "conversation_id")
        manifests = {self.root / key for key in self.manifest_keys(conversation_id)}
        for stale in set(folder.glob("*/*.json")) - manifests:
            stale.unlink(missing_ok=True)
        for path in manifests:
            try:
                self._pull(str(path))
            except SnapshotNotFoundError:  # deleted since the listing
                continue
        return super().snapshots(conversation_id)

    def manifest_keys(self, conversation_id: str) -> list[str]:
        """The keys of the conversation's turn manifests in the bucket."""
        return [e["path"] for e in self.listing(f"{conversation_id}/") if e["path"].count("/") == 2 and e["path"].endswith(".json")]

    def written_within(self, location: str, seconds: float) -> bool:
        """By the bucket's time of the object (replicas write records after their manifests)."""
        try:
            modified = self.head_object(self._key(location))["last_modified"]
        except FileNotFoundError:
            return False
        return (datetime.now(timezone.utc) - modified).total_seconds() < seconds

    def store_members(self, stored: StoredState) -> dict[str, str]:
        self._fetch_files(stored)  # an export reads them from the folder
        return super().store_members(stored)

    def sweep(self, referenced: set[str], grace_s: float) -> int:
        """The folder's files no key in `referenced` names, then the bucket's that no manifest there names."""
        return super().sweep(referenced, grace_s) + self.sweeper.sweep(referenced, grace_s)

    def read(self, location: str) -> bytes:
        return self.get_object(self._key(location))[0]

    def write(self, location: str, data: bytes) -> None:
        """An imported manifest (the store files it names adopted before it), or v1 file; created
        only where none is, so that two replicas importing one conversation id never replace (and
        the loser, undoing its import, never deletes) the other's."""
        from obstore.exceptions import AlreadyExistsError

        super().write(location, data)
        stored = stored_state(json.loads(data), snapshot_label(location)) if location.endswith(".json") else None
        if stored is not None:
            self._push_files(stored)
        try:
            self.put_object(self._key(location), data, mode="create")
        except AlreadyExistsError:
            Path(location).unlink(missing_ok=True)
            raise StaleViewError(f"{snapshot_label(location)}: another replica stored this turn first") from None

    # ---- conversation records --------------------------------------------------------------------

    def _record_key(self, conversation_id: str) -> str:
        return f"{validate_id(conversation_id, 'conversation_id')}/{RECORD_NAME}"

    def read_record(self, conversation_id: str) -> bytes | None:
        try:
            data, meta = self.get_object(self._record_key(conversation_id))
        except FileNotFoundError:
            self._versions[conversation_id] = None
            super().delete_record(conversation_id)
            return None
        self._versions[conversation_id] = meta["e_tag"]
        super().write_record(conversation_id, data)  # the folder's copy: its time is the conversation's last use
        return data

    def write_record(self, conversation_id: str, data: bytes) -> None:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        known = self._versions.get(conversation_id)
        try:
            version = self.put_object(self._record_key(conversation_id), data, mode="create" if known is None else {"e_tag": known})
        except (AlreadyExistsError, PreconditionError):
            self._versions.pop(conversation_id, None)
            raise StaleViewError(
                f"conversation {conversation_id!r} was changed by another replica since this one read it: "
                "this turn is not recorded; send it again (the next request reads the conversation afresh)"
            ) from None
        self._versions[conversation_id] = version
        super().write_record(conversation_id, data)

    def delete_record(self, conversation_id: str) -> None:
        self.delete_object(self._record_key(conversation_id))
        self._versions[conversation_id] = None
        super().delete_record(conversation_id)

    def record_ids(self) -> list[str]:
        import obstore

        listing = self.call(obstore.list_with_delimiter, None)
        return sorted(p.rstrip("/") for p in listing["common_prefixes"] if not p.startswith("."))

    def record_current(self, conversation_id: str) -> bool:
        if conversation_id not in self._versions:
            return False
        try:
            version = self.head_object(self._record_key(conversation_id))["e_tag"]
        except FileNotFoundError:
            version = None
        return version == self._versions[conversation_id]


def open_cold_store(
    url: str | None, folder: Path, spec: ModelSpec, dtypes: StateDtypes, hasher: PrefixHasher, model: ModelIdentity, tokenizer_sha256: str
) -> FilesystemColdStore:
    """The COLD tier: `folder` alone (url None), or the object store at `url` with `folder` as its cache."""
    if url is None:
        return FilesystemColdStore(folder, spec, dtypes, hasher, model, tokenizer_sha256)
    return ObjectColdStore(open_remote(url), url, folder, spec, dtypes, hasher, model, tokenizer_sha256)

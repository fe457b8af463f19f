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

The prefix cache's entries, the quarantine list and sweeps stay per replica, in the folder: the
bucket's unreferenced objects are left to its lifecycle rules (docs/DEPLOYMENT.md).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from engram.models.spec import ModelSpec
from engram.state.chunks import PrefixHasher, StoredState
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
from engram.state.turns import StaleViewError

if TYPE_CHECKING:
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
        self._in_bucket: set[str] = set()  # store files known to be in the bucket (uploaded or downloaded here)

    # ---- the bucket --------------------------------------------------------------------------

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
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

    def _get(self, key: str) -> tuple[bytes, str | None]:
        import obstore

        result = self._call(obstore.get, key)
        return bytes(result.bytes()), result.meta["e_tag"]

    def _put(self, key: str, data: bytes, mode: Any = "overwrite") -> str | None:
        import obstore

        return self._call(obstore.put, key, data, mode=mode)["e_tag"]

    def _exists(self, key: str) -> bool:
        import obstore

        try:
            self._call(obstore.head, key)
        except FileNotFoundError:
            return False
        return True

    def _pull(self, location: str) -> Path:
        """The bucket's copy of a manifest, written over the folder's (which goes if the bucket has none)."""
        path = Path(location)
        try:
            data, _ = self._get(self._key(path))
        except FileNotFoundError:
            path.unlink(missing_ok=True)
            raise SnapshotNotFoundError(f"{snapshot_label(location)}: not in the store") from None
        atomic_write(path, data)
        return path

    def _push_files(self, stored: StoredState) -> None:
        """Upload the store files `stored` names that the bucket may lack (an existing one is kept:
        same key, same content)."""
        from obstore.exceptions import AlreadyExistsError

        for path in self._store_files(stored):
            if path.name in self._in_bucket:
                continue
            try:
                self._put(self._key(path), path.read_bytes(), mode="create")
            except AlreadyExistsError:
                self.stats.files_reused += 1
            self._in_bucket.add(path.name)

    def _store_files(self, stored: StoredState) -> list[Path]:
        return [self.chunks.piece_path(p.key) for p in stored.pieces] + [self.chunks.checkpoint_path(stored.checkpoint)]

    def _fetch_files(self, stored: StoredState) -> None:
        """Download the store files `stored` names that the folder lacks (one the bucket lacks too
        is left for the load to report as missing)."""
        for path in self._store_files(stored):
            if not path.is_file():
                try:
                    atomic_write(path, self._get(self._key(path))[0])
                except FileNotFoundError:
                    continue
                self._in_bucket.add(path.name)

    def _fetch_referenced(self, location: str) -> Path:
        path = self._pull(location)
        stored = stored_state(read_manifest(path), snapshot_label(location))
        if stored is not None:
            self._fetch_files(stored)
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
            self._put(self._key(location), Path(location).read_bytes(), mode="create")
        except AlreadyExistsError:
            Path(location).unlink(missing_ok=True)
            raise SnapshotError(f"{snapshot_label(location)}: another replica stored this turn first") from None
        return stored

    def load(self, location: str, resident: SequenceState | None = None) -> tuple[SequenceState, dict[str, Any]]:
        self._fetch_referenced(location)
        return super().load(location, resident)

    def manifest(self, location: str) -> dict[str, Any]:
        return read_manifest(self._pull(location))

    def references(self, location: str) -> StoredState | None:
        return stored_state(self.manifest(location), snapshot_label(location))

    def tokens(self, manifest: dict[str, Any]) -> list[int]:
        self._fetch_referenced(manifest["path"])
        return super().tokens(manifest)

    def delete(self, location: str) -> None:
        import obstore

        if not self.exists(location):
            raise SnapshotNotFoundError(f"{snapshot_label(location)}: not in the store")
        self._call(obstore.delete, self._key(location))
        Path(location).unlink(missing_ok=True)

    def snapshots(self, conversation_id: str) -> list[dict[str, Any]]:
        import obstore

        folder = self.root / validate_id(conversation_id, "conversation_id")
        listed = {
            entry["path"] for entry in self._call(lambda store, prefix: [e for b in obstore.list(store, prefix) for e in b], f"{conversation_id}/")
        }
        manifests = {self.root / key for key in listed if key.count("/") == 2 and key.endswith(".json")}
        for stale in set(folder.glob("*/*.json")) - manifests:
            stale.unlink(missing_ok=True)
        for path in manifests:
            try:
                self._pull(str(path))
            except SnapshotNotFoundError:  # deleted since the listing
                continue
        return super().snapshots(conversation_id)

    def written_within(self, location: str, seconds: float) -> bool:
        """By the bucket's time of the object (replicas write records after their manifests)."""
        import obstore

        try:
            modified = self._call(obstore.head, self._key(location))["last_modified"]
        except FileNotFoundError:
            return False
        return (datetime.now(timezone.utc) - modified).total_seconds() < seconds

    def store_members(self, stored: StoredState) -> dict[str, str]:
        self._fetch_files(stored)  # an export reads them from the folder
        return super().store_members(stored)

    def read(self, location: str) -> bytes:
        return self._get(self._key(location))[0]

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
            self._put(self._key(location), data, mode="create")
        except AlreadyExistsError:
            Path(location).unlink(missing_ok=True)
            raise StaleViewError(f"{snapshot_label(location)}: another replica stored this turn first") from None

    # ---- conversation records --------------------------------------------------------------------

    def _record_key(self, conversation_id: str) -> str:
        return f"{validate_id(conversation_id, 'conversation_id')}/{RECORD_NAME}"

    def read_record(self, conversation_id: str) -> bytes | None:
        try:
            data, version = self._get(self._record_key(conversation_id))
        except FileNotFoundError:
            self._versions[conversation_id] = None
            super().delete_record(conversation_id)
            return None
        self._versions[conversation_id] = version
        super().write_record(conversation_id, data)  # the folder's copy: its time is the conversation's last use
        return data

    def write_record(self, conversation_id: str, data: bytes) -> None:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        known = self._versions.get(conversation_id)
        try:
            version = self._put(self._record_key(conversation_id), data, mode="create" if known is None else {"e_tag": known})
        except (AlreadyExistsError, PreconditionError):
            self._versions.pop(conversation_id, None)
            raise StaleViewError(
                f"conversation {conversation_id!r} was changed by another replica since this one read it: "
                "this turn is not recorded; send it again (the next request reads the conversation afresh)"
            ) from None
        self._versions[conversation_id] = version
        super().write_record(conversation_id, data)

    def delete_record(self, conversation_id: str) -> None:
        import obstore

        self._call(obstore.delete, self._record_key(conversation_id))
        self._versions[conversation_id] = None
        super().delete_record(conversation_id)

    def record_ids(self) -> list[str]:
        import obstore

        listing = self._call(obstore.list_with_delimiter, None)
        return sorted(p.rstrip("/") for p in listing["common_prefixes"] if not p.startswith("."))

    def record_current(self, conversation_id: str) -> bool:
        import obstore

        if conversation_id not in self._versions:
            return False
        try:
            version = self._call(obstore.head, self._record_key(conversation_id))["e_tag"]
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

"""Garbage collection of an object store's store files by reference (docs/DEPLOYMENT.md, "Garbage").

A KV piece or checkpoint in the bucket (`.store/kv/..`, `.store/ckpt/..`) is deleted when no turn
manifest in the bucket names it, none that this replica's memory knows of does either, and the
bucket got it more than the grace period before the sweep began. The manifests are listed from
the bucket, so a replica sweeps for every replica's conversations.

Why a save in flight loses nothing: its manifest may be written after the sweep listed the
manifests, but every store file it names the bucket got within half the grace before the save
(uploaded, or refreshed by `ObjectColdStore._push_files`), and a save writes its manifest within
the other half; each file is looked at again (HEAD) just before it is deleted, so a refresh since
the listing spares it. What this assumes: a save takes less than half the grace (5 minutes) from
its start to its manifest, the replicas' clocks agree with the bucket's to well within that, and
no refresh lands between a file's last look and its delete (one round trip). A file lost all the
same costs the turns naming it a restore from an earlier state or a recomputation from the
record's tokens (a load verifies every file), never a turn.

At most one replica sweeps at a time: it holds the lease, an object created with If-None-Match
and taken over with If-Match once older than `lease_s` (its holder died). Concurrent sweeps would
be safe all the same (each delete is justified on its own); the lease only saves repeated work.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from engram.state.chunks import ORPHAN_GRACE_S, STORE_NAME
from engram.state.manifest import stored_state
from engram.state.snapshot import SnapshotCorruptError

if TYPE_CHECKING:
    from engram.state.object_store import ObjectColdStore

LEASE_KEY = f"{STORE_NAME}/sweep-lease.json"
REFRESH_PREFIX = f"{STORE_NAME}/refresh/"  # the temporary copies of a refresh (a crash may leave one: swept by age)
SWEPT_PREFIXES = (f"{STORE_NAME}/kv/", f"{STORE_NAME}/ckpt/", REFRESH_PREFIX)

log = logging.getLogger(__name__)


class BucketSweeper:
    """The bucket's side of `ObjectColdStore.sweep`."""

    def __init__(self, store: ObjectColdStore, lease_s: float = ORPHAN_GRACE_S):
        self.store = store
        self.lease_s = lease_s
        self.holder = uuid.uuid4().hex
        self._named: dict[tuple[str, str | None], frozenset[str]] = {}  # (manifest key, its ETag) -> the store keys it names

    def sweep(self, referenced: set[str], grace_s: float) -> int:
        """Delete the bucket's store files no manifest names (nor `referenced`) that it got more
        than `grace_s` before now; how many went (0, deleting nothing, while another replica holds
        the lease)."""
        started = time.time()
        if not self._take_lease(started):
            return 0
        try:
            cutoff = started - grace_s
            old = [entry["path"] for prefix in SWEPT_PREFIXES for entry in self.store.listing(prefix) if entry["last_modified"].timestamp() < cutoff]
            if not old:
                return 0
            keep = referenced | self._named_by_manifests()
            removed = 0
            for key in old:
                name = key.rsplit("/", 1)[-1]
                if name.split(".")[0] in keep or not self._still_older(key, cutoff):
                    continue
                self.store.delete_object(key)
                self.store.forget_uploaded(name)
                removed += 1
            if removed:
                log.info("bucket sweep: %d unreferenced store files removed from %s", removed, self.store.url)
            return removed
        finally:
            self._release_lease()

    def _named_by_manifests(self) -> set[str]:
        """The store keys every turn manifest in the bucket names (each manifest read once per ETag)."""
        named: dict[tuple[str, str | None], frozenset[str]] = {}
        for conversation_id in self.store.record_ids():
            for entry in self.store.listing(f"{conversation_id}/"):
                key = entry["path"]
                if key.count("/") != 2 or not key.endswith(".json"):
                    continue
                version = (key, entry["e_tag"])
                keys = self._named.get(version)
                if keys is None:
                    try:
                        keys = self._keys_of(key)
                    except FileNotFoundError:  # deleted since the listing
                        continue
                named[version] = keys
        self._named = named
        return set().union(*named.values())

    def _keys_of(self, key: str) -> frozenset[str]:
        data, _ = self.store.get_object(key)
        try:
            stored = stored_state(json.loads(data), key)
        except (ValueError, AttributeError, SnapshotCorruptError) as e:  # it cannot be loaded: what it names is no one's
            log.warning("bucket sweep: manifest %s is unreadable (%s); it keeps nothing", key, e)
            return frozenset()
        return frozenset(stored.keys) if stored is not None else frozenset()

    def _still_older(self, key: str, cutoff: float) -> bool:
        """Whether the object is there and the bucket got it before `cutoff` (not refreshed since the listing)."""
        try:
            return self.store.head_object(key)["last_modified"].timestamp() < cutoff
        except FileNotFoundError:
            return False

    def _take_lease(self, now: float) -> bool:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        body = json.dumps({"holder": self.holder, "taken": now}).encode()
        try:
            self.store.put_object(LEASE_KEY, body, mode="create")
            return True
        except AlreadyExistsError:
            pass
        try:
            held = self.store.head_object(LEASE_KEY)
        except FileNotFoundError:  # released meanwhile: the next sweep takes it
            return False
        if now - held["last_modified"].timestamp() < self.lease_s:
            return False
        try:  # its holder died sweeping: taken over, by one replica only
            self.store.put_object(LEASE_KEY, body, mode={"e_tag": held["e_tag"]})
            return True
        except PreconditionError:
            return False

    def _release_lease(self) -> None:
        try:
            data, _ = self.store.get_object(LEASE_KEY)
        except FileNotFoundError:
            return
        if json.loads(data).get("holder") == self.holder:  # not another's, which took over an expired one
            self.store.delete_object(LEASE_KEY)

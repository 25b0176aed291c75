"""What this controller just did but its informers have not shown yet.

After creating a pod the pod informer needs a moment to see it; a reconcile in between would count one
pod too few and create a duplicate (and one deleting too many after a delete). client-go calls this
ControllerExpectations. Entries expire so a write that silently never lands cannot block forever; a
restarted controller starts empty, which is safe because it reconciles only after its caches synced.
"""

from __future__ import annotations

from collections.abc import Hashable

from cachetools import TTLCache


class Expectations:
    def __init__(self, ttl: float = 30.0) -> None:
        self.ttl = ttl
        self._creates: dict[Hashable, TTLCache[str, None]] = {}
        self._deletes: dict[Hashable, TTLCache[str, None]] = {}

    def _bucket(self, table: dict[Hashable, TTLCache[str, None]], owner: Hashable) -> TTLCache[str, None]:
        bucket = table.get(owner)
        if bucket is None:
            bucket = table[owner] = TTLCache(maxsize=10_000, ttl=self.ttl)
        return bucket

    def expect_create(self, owner: Hashable, name: str) -> None:
        self._bucket(self._creates, owner)[name] = None

    def expect_delete(self, owner: Hashable, name: str) -> None:
        self._bucket(self._deletes, owner)[name] = None

    def observed(self, owner: Hashable, name: str, *, deleted: bool = False) -> None:
        for table in (self._creates, self._deletes) if deleted else (self._creates,):
            bucket = table.get(owner)
            if bucket is not None:
                bucket.pop(name, None)
                if not bucket:
                    del table[owner]

    def pending_creates(self, owner: Hashable, seen: set[str]) -> set[str]:
        """Names created for `owner` that are not among `seen` yet."""
        bucket = self._creates.get(owner)
        return {n for n in list(bucket.keys()) if n not in seen} if bucket else set()

    def pending_delete(self, owner: Hashable, name: str) -> bool:
        bucket = self._deletes.get(owner)
        return bucket is not None and name in bucket

"""Eviction policies of the offload tiers: LRU and ARC. Pure Python, no torch.

A policy orders the *resident, visible* keys of one tier. The tier (see `host_index.py`) tells it
about every insert, hit and removal, and asks it for a victim when it needs room. Keys that must
not be evicted right now (being loaded, a disk write in flight) are skipped through the
`is_evictable` predicate, so a policy never returns a pinned key.

ARC (Megiddo & Modha, FAST '03) keeps two resident lists, T1 (seen once recently) and T2 (seen at
least twice), and two ghost lists of recently evicted keys, B1 and B2. A hit in a ghost list means
the policy evicted from the wrong side: a B1 ghost hit grows the target size `p` of T1, a B2 ghost
hit shrinks it. Ghost keys hold no data. This makes ARC resistant to scans (one pass over many
blocks evicts only T1 entries), where LRU would flush its whole working set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from kvbridge.errors import ConfigError

Key = Hashable
Predicate = Callable[[Key], bool]


def _pop_lru(entries: OrderedDict, is_evictable: Predicate) -> Key | None:
    """Remove and return the least recently used evictable key of `entries`, or None."""
    for key in entries:  # oldest first
        if is_evictable(key):
            del entries[key]
            return key
    return None


class EvictionPolicy(ABC):
    """Orders the resident keys of one tier of `capacity` entries."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"eviction policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key) -> None:
        """`key` became resident (the tier has already made room)."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A resident `key` was hit."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """A resident `key` left the tier for a reason other than eviction (failure, reset)."""

    @abstractmethod
    def pop_victim(self, is_evictable: Predicate, incoming: Key | None = None) -> Key | None:
        """Choose an evictable resident key, forget it as resident and return it (None: all pinned).

        `incoming` is the key the room is made for, if known (ARC uses it).
        """

    @abstractmethod
    def __contains__(self, key: Key) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def keys(self) -> Iterator[Key]:
        """Resident keys, in no particular order."""

    def check_integrity(self) -> None:
        if len(self) > self.capacity:
            raise AssertionError(f"{type(self).__name__}: {len(self)} resident keys > capacity {self.capacity}")


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._entries: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def insert(self, key: Key) -> None:
        self._entries[key] = None
        self._entries.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._entries.pop(key, None)

    def pop_victim(self, is_evictable: Predicate, incoming: Key | None = None) -> Key | None:
        return _pop_lru(self._entries, is_evictable)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[Key]:
        return iter(list(self._entries))


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache: recency (T1) vs frequency (T2), tuned online by ghost hits."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Key, None] = OrderedDict()  # resident, seen once
        self.t2: OrderedDict[Key, None] = OrderedDict()  # resident, seen at least twice
        self.b1: OrderedDict[Key, None] = OrderedDict()  # ghosts evicted from t1
        self.b2: OrderedDict[Key, None] = OrderedDict()  # ghosts evicted from t2
        self.p = 0.0  # target size of t1

    def insert(self, key: Key) -> None:
        c = self.capacity
        if key in self.b1:  # we evicted it too early from the recency side: favour t1
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
            return
        if key in self.b2:  # we evicted it too early from the frequency side: favour t2
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
            return
        # A brand-new key: keep the ghost directories bounded (|T1|+|B1| <= c, total <= 2c).
        if len(self.t1) + len(self.b1) >= c and self.b1:
            self.b1.popitem(last=False)
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
            self.b2.popitem(last=False)
        self.t1[key] = None

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def pop_victim(self, is_evictable: Predicate, incoming: Key | None = None) -> Key | None:
        # ARC's REPLACE: evict from t1 when it is above its target p, else from t2;
        # fall back to the other list when every key of the preferred one is pinned.
        prefer_t1 = bool(self.t1) and (len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) >= self.p))
        order = [(self.t1, self.b1), (self.t2, self.b2)]
        if not prefer_t1:
            order.reverse()
        for resident, ghosts in order:
            key = _pop_lru(resident, is_evictable)
            if key is not None:
                ghosts[key] = None
                self._trim_ghosts()
                return key
        return None

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.b2) > c:
            self.b2.popitem(last=False)

    def __contains__(self, key: Key) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def keys(self) -> Iterator[Key]:
        return iter(list(self.t1) + list(self.t2))

    def check_integrity(self) -> None:
        super().check_integrity()
        lists = (self.t1, self.t2, self.b1, self.b2)
        total = sum(len(x) for x in lists)
        if len(set().union(*lists)) != total:
            raise AssertionError("ARCPolicy: a key is in more than one of T1, T2, B1, B2")
        if not 0.0 <= self.p <= self.capacity:
            raise AssertionError(f"ARCPolicy: target p={self.p} outside [0, {self.capacity}]")
        if len(self.b1) > self.capacity or len(self.b2) > self.capacity:
            raise AssertionError("ARCPolicy: a ghost list outgrew the capacity")


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy called `name` ("lru" or "arc")."""
    try:
        return POLICIES[name.lower()](capacity)
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}") from None

"""Which node of a role gets a request: the proxy's routing policies. Pure bookkeeping, no I/O.

    --routing load-prefix (default)   prefill: PrefixAffinity       decode: LeastLoaded
    --routing round-robin             prefill: RoundRobin           decode: RoundRobin

A policy chooses among the candidates the node pool offers (the healthy nodes the request has not
tried yet, with their requests in flight) and is told which node served a prompt (`remember`).

Prefix affinity. The proxy does not tokenize, so a prompt is cut into fixed-size chunks of its own
units (PREFIX_CHUNK_CHARS characters of a text prompt, PREFIX_CHUNK_TOKENS ids of a token-id
prompt) and each chunk gets a chained hash (`hash(parent, chunk)`), so one hash names the whole
prefix up to its chunk, as a block hash does in the engine. A bounded LRU maps hashes to the
prefill node that last computed that prefix. A prompt goes to the candidate that holds its longest
remembered prefix, unless that node is overloaded: under the bounded-load rule (consistent hashing
with bounded loads, Mirrokni et al.) a node may take a request only while its requests in flight,
this one included, stay within LOAD_FACTOR times the candidates' average. Otherwise, and for
prompts nobody has seen, the least-loaded candidate gets it. A stale or colliding entry (the node
evicted the prefix, or restarted) costs a prefix-cache miss, never a wrong answer: routing never
decides which KV a node uses.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvbridge.errors import ConfigError

ROUTINGS = ("load-prefix", "round-robin")
PREFIX_CHUNK_CHARS = 64  # about one 16-token KV block of English text
PREFIX_CHUNK_TOKENS = 16
MAX_REMEMBERED_CHUNKS = 1 << 16  # prefix hashes remembered (an int and a URL each), least recent dropped
LOAD_FACTOR = 1.25  # bounded load: at most this times the average requests in flight per node


class NodeLoad(NamedTuple):
    """A candidate node: its base URL and its requests in flight through this proxy."""

    url: str
    num_in_flight: int


PromptKey = tuple[int, ...]  # chained hashes of a prompt's whole chunks


def prompt_key(prompt_text: str | None, prompt_token_ids: Sequence[int] | None) -> PromptKey:
    """The chained chunk hashes of a prompt (text or token ids); a partial last chunk is left out."""
    if prompt_text is not None:
        chunks = [prompt_text[i : i + PREFIX_CHUNK_CHARS] for i in _chunk_starts(len(prompt_text), PREFIX_CHUNK_CHARS)]
    else:
        ids = prompt_token_ids or ()
        chunks = [tuple(ids[i : i + PREFIX_CHUNK_TOKENS]) for i in _chunk_starts(len(ids), PREFIX_CHUNK_TOKENS)]
    hashes, parent = [], 0
    for chunk in chunks:
        parent = hash((parent, chunk))  # per-process hashing is enough: the map lives in this process
        hashes.append(parent)
    return tuple(hashes)


def _chunk_starts(length: int, size: int) -> range:
    return range(0, length - size + 1, size)


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[NodeLoad], prompt: PromptKey) -> str:
        """The URL of one of `candidates` (never empty) for a request with this prompt."""

    def remember(self, url: str, prompt: PromptKey) -> None:
        """`url` computed this prompt (it now holds its KV in its prefix cache)."""


class RoundRobin:
    """Cycles over the nodes in the order given, skipping those that are not candidates."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._order = list(urls)
        self._next = 0

    def choose(self, candidates: Sequence[NodeLoad], prompt: PromptKey) -> str:
        offered = {c.url for c in candidates}
        url = next(u for u in [*self._order[self._next :], *self._order[: self._next]] if u in offered)
        self._next = (self._order.index(url) + 1) % len(self._order)
        return url

    def remember(self, url: str, prompt: PromptKey) -> None:
        pass


class LeastLoaded:
    """The candidate with the fewest requests in flight; ties go round in turn, so that an idle
    cluster still spreads its requests."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[NodeLoad], prompt: PromptKey) -> str:
        first = next(self._turn) % len(candidates)
        rotated = [*candidates[first:], *candidates[:first]]
        return min(rotated, key=lambda c: c.num_in_flight).url

    def remember(self, url: str, prompt: PromptKey) -> None:
        pass


def is_overloaded(node: NodeLoad, candidates: Sequence[NodeLoad], load_factor: float = LOAD_FACTOR) -> bool:
    """Whether one more request on `node` would take it past `load_factor` times the average."""
    total = sum(c.num_in_flight for c in candidates) + 1
    return node.num_in_flight + 1 > math.ceil(load_factor * total / len(candidates))


class PrefixAffinity:
    """The candidate holding the longest remembered prefix of the prompt, within the bounded load;
    else the least loaded."""

    def __init__(self, max_entries: int = MAX_REMEMBERED_CHUNKS, load_factor: float = LOAD_FACTOR) -> None:
        self._owner: OrderedDict[int, str] = OrderedDict()  # prefix hash -> node that last computed it
        self._max_entries = max_entries
        self._load_factor = load_factor
        self._fallback = LeastLoaded()

    def choose(self, candidates: Sequence[NodeLoad], prompt: PromptKey) -> str:
        by_url = {c.url: c for c in candidates}
        depth: dict[str, int] = {}  # candidate -> chunks of the prompt it is remembered to hold
        for i, prefix_hash in enumerate(prompt):
            url = self._owner.get(prefix_hash)
            if url is None:
                break  # chained: no longer prefix of this prompt is remembered either
            if url in by_url:
                depth[url] = i + 1
        for url in sorted(depth, key=lambda u: (-depth[u], by_url[u].num_in_flight)):
            if not is_overloaded(by_url[url], candidates, self._load_factor):
                return url
        return self._fallback.choose(candidates, prompt)

    def remember(self, url: str, prompt: PromptKey) -> None:
        for prefix_hash in prompt:
            self._owner[prefix_hash] = url
            self._owner.move_to_end(prefix_hash)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owner)


def make_policies(routing: str, prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> tuple[RoutingPolicy, RoutingPolicy]:
    """(prefill policy, decode policy) for `--routing`."""
    if routing == "load-prefix":
        return PrefixAffinity(), LeastLoaded()
    if routing == "round-robin":
        return RoundRobin(prefill_urls), RoundRobin(decode_urls)
    raise ConfigError(f"unknown routing {routing!r}; use one of {', '.join(ROUTINGS)}")

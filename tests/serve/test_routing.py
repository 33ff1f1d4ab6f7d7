"""The proxy's routing policies (serve/routing.py): prefix affinity, bounded load, least loaded, round-robin."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.serve.routing import (
    PREFIX_CHUNK_CHARS,
    PREFIX_CHUNK_TOKENS,
    LeastLoaded,
    NodeLoad,
    PrefixAffinity,
    RoundRobin,
    is_overloaded,
    make_policies,
    prompt_key,
)

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4  # 4+ whole chunks


def _nodes(*loads: int) -> list[NodeLoad]:
    return [NodeLoad(f"http://n{i}", load) for i, load in enumerate(loads)]


def test_prompt_key_chains_whole_chunks_of_text_or_token_ids():
    short = prompt_key("x" * (PREFIX_CHUNK_CHARS - 1), None)
    assert short == ()  # not one whole chunk: nothing to be affine to
    a = prompt_key(SYSTEM + "What is 2 + 2?", None)
    b = prompt_key(SYSTEM + "Name a colour.", None)
    assert len(a) == len(SYSTEM + "What is 2 + 2?") // PREFIX_CHUNK_CHARS
    common = len(SYSTEM) // PREFIX_CHUNK_CHARS
    assert a[:common] == b[:common]  # chained: equal hashes name equal prefixes
    assert prompt_key("y" + SYSTEM[1:], None)[0] != a[0]
    ids = list(range(3 * PREFIX_CHUNK_TOKENS + 5))
    assert len(prompt_key(None, ids)) == 3 and prompt_key(None, ids)[:2] == prompt_key(None, ids[: 2 * PREFIX_CHUNK_TOKENS])


def test_a_remembered_prefix_goes_back_to_its_node_while_it_is_not_overloaded():
    policy = PrefixAffinity()
    first = prompt_key(SYSTEM + "What is 2 + 2?", None)
    policy.remember("http://n1", first)
    follow_up = prompt_key(SYSTEM + "Name a colour.", None)
    assert policy.choose(_nodes(1, 1, 0), follow_up) == "http://n1"  # n2 is idler, but n1 holds the prefix
    assert policy.choose(_nodes(1, 1, 0), prompt_key("Another topic altogether. " * 5, None)) == "http://n2"


def test_the_longest_remembered_prefix_wins():
    policy = PrefixAffinity()
    shared = SYSTEM
    policy.remember("http://n0", prompt_key(shared, None))
    longer = shared + "Here is a long document that the user pasted in before their question. " * 3
    policy.remember("http://n2", prompt_key(longer, None))
    assert policy.choose(_nodes(0, 0, 0), prompt_key(longer + "Summarise it.", None)) == "http://n2"
    # n2 also computed the shared part, and was the last to: the shared prefix alone goes there too
    assert policy.choose(_nodes(0, 0, 0), prompt_key(shared + "Hi", None)) == "http://n2"


def test_an_overloaded_affine_node_is_passed_over_for_the_least_loaded():
    policy = PrefixAffinity(load_factor=1.25)
    key = prompt_key(SYSTEM, None)
    policy.remember("http://n0", key)
    # 2 nodes, 4 in flight on n0: one more would be 5 > ceil(1.25 * 5 / 2) = 4
    assert policy.choose(_nodes(4, 0), key) == "http://n1"
    assert policy.choose(_nodes(2, 1), key) == "http://n0"  # 3 <= ceil(1.25 * 4 / 2) = 3


def test_is_overloaded_is_relative_to_the_average():
    assert not is_overloaded(NodeLoad("a", 0), _nodes(0, 0))
    assert is_overloaded(NodeLoad("a", 4), _nodes(4, 0))
    assert not is_overloaded(NodeLoad("a", 40), _nodes(40))  # alone: never overloaded
    assert not is_overloaded(NodeLoad("a", 10), _nodes(10, 9, 9, 9))


def test_a_node_that_is_not_a_candidate_is_never_chosen():
    # Ejected nodes (and nodes this request already tried) are not offered: affinity to them is ignored.
    policy = PrefixAffinity()
    document = SYSTEM + "Here is a long document that the user pasted in before their question. " * 3
    policy.remember("http://n0", prompt_key(document, None))
    policy.remember("http://gone", prompt_key(SYSTEM, None))  # later, its first chunks, on a node since ejected
    key = prompt_key(document + "Summarise it.", None)
    assert policy.choose(_nodes(1, 0), key) == "http://n0"  # the longest prefix among the candidates
    assert policy.choose([NodeLoad("http://n1", 0)], prompt_key(SYSTEM, None)) == "http://n1"
    for routing in ("load-prefix", "round-robin"):
        prefill, decode = make_policies(routing, ["http://n0", "http://n1"], ["http://n0", "http://n1"])
        for policy in (prefill, decode):
            assert {policy.choose([NodeLoad("http://n1", 5)], key) for _ in range(4)} == {"http://n1"}


def test_the_remembered_prefixes_are_bounded():
    policy = PrefixAffinity(max_entries=8)
    for i in range(20):
        policy.remember(f"http://n{i % 2}", prompt_key(f"{i:04d}" + SYSTEM, None))
    assert len(policy) == 8
    oldest, newest = prompt_key("0000" + SYSTEM, None), prompt_key("0019" + SYSTEM, None)
    assert policy.choose(_nodes(0, 0), newest) == "http://n1"
    assert {policy.choose(_nodes(0, 0), oldest) for _ in range(4)} == {"http://n0", "http://n1"}  # forgotten


def test_least_loaded_picks_the_idlest_and_spreads_ties():
    policy = LeastLoaded()
    assert policy.choose(_nodes(3, 1, 2), ()) == "http://n1"
    assert [policy.choose(_nodes(0, 0, 5), ()) for _ in range(4)].count("http://n2") == 0
    assert {policy.choose(_nodes(0, 0), ()) for _ in range(4)} == {"http://n0", "http://n1"}


def test_round_robin_cycles_and_skips_what_is_not_offered():
    policy = RoundRobin(["http://n0", "http://n1", "http://n2"])
    assert [policy.choose(_nodes(0, 0, 0), ()) for _ in range(4)] == ["http://n0", "http://n1", "http://n2", "http://n0"]
    without_n2 = _nodes(0, 0)
    assert [policy.choose(without_n2, ()) for _ in range(3)] == ["http://n1", "http://n0", "http://n1"]


def test_an_unknown_routing_is_a_config_error():
    with pytest.raises(ConfigError, match="round-robin"):
        make_policies("random", ["http://a"], ["http://b"])

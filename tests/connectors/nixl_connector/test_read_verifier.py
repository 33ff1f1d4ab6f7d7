"""ReadVerifier with the digests a copy took as it wrote the blocks (a same-GPU read on the SMs,
transfer/cuda_ipc.py): they stand in for a second pass only when they can prove the same thing.

The copy that takes them runs only on a GPU (its GPU tests: tests/transfer/test_cuda_ipc.py and
tests/connectors/nixl_connector/test_pd_gpu.py); here the verifier's choice is checked against an
endpoint that records every digest it is asked to take, with real digests of real blocks."""

from __future__ import annotations

import torch

from kvbridge.connectors.nixl.metadata import RecvJob, RemoteEngine
from kvbridge.connectors.nixl.stats import TransferStats
from kvbridge.connectors.nixl.verify import ReadVerifier
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer import messages as m
from kvbridge.transfer.digest import WSUM, XXH3, DigestJob, block_digests, region_bytes

LAYOUT = KVCacheLayout(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


class _Endpoint:
    """What ReadVerifier reads of a KVEndpoint: its peers, its layout, and the digests of the blocks it
    read (of a real KV cache here), each request for them recorded."""

    def __init__(self, kv: torch.Tensor, alg: str, translated: bool = False) -> None:
        self.layout, self._region, self._translated = LAYOUT, region_bytes(kv, LAYOUT), translated
        self.peer = type("Peer", (), {"digest_alg": alg, "ranks": []})()
        self.peers = type("Peers", (), {"__contains__": lambda _, a: True, "get": lambda _, a: self.peer})()
        self.digests_taken: list[list[int]] = []

    def is_translated(self, peer) -> bool:
        return self._translated

    def start_read_digests(self, address, local_block_ids, remote_block_ids, alg):
        self.digests_taken.append(list(local_block_ids))
        return [[(None, DigestJob(alg, values=block_digests(self._region, LAYOUT, list(local_block_ids), alg).values))]]


def _job(local: list[int]) -> RecvJob:
    lease = m.LeaseRef(req_id="p-1", token="t", block_ids=list(range(10, 10 + len(local))), block_hash="00")
    return RecvJob("r-1", RemoteEngine("prefill", "127.0.0.1", 5600, "inc"), lease, tuple(local), tuple(lease.block_ids))


def _setup(alg: str = WSUM, translated: bool = False):
    kv = torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(3))
    endpoint = _Endpoint(kv, alg, translated)
    leased = m.KVDigest(alg=alg, values=block_digests(region_bytes(kv, LAYOUT), LAYOUT, [2, 5, 6], alg).values)
    return endpoint, ReadVerifier(endpoint, TransferStats(), clock=lambda: 0.0), leased


def test_the_copys_own_digests_verify_a_read_without_a_second_pass():
    endpoint, verifier, leased = _setup()
    verifier.start(_job([2, 5, 6]), DigestJob(WSUM, values=list(leased.values)))
    assert verifier.verify(_job([2, 5, 6]), leased) is None
    assert endpoint.digests_taken == []  # the blocks were not read again


def test_the_copys_digests_of_other_bytes_are_a_mismatch_never_a_pass():
    """A copy whose digests disagree with the lease's (a faulty kernel, bytes changed in flight) is a load
    error: what the copy says it wrote is checked, not trusted."""
    _, verifier, leased = _setup()
    wrong = list(leased.values)
    wrong[1] ^= 1
    verifier.start(_job([2, 5, 6]), DigestJob(WSUM, values=wrong))
    error = verifier.verify(_job([2, 5, 6]), leased)
    assert error is not None and "KV DIGEST MISMATCH" in error and "remote block 11" in error


def test_the_copys_digests_are_not_used_where_they_cannot_prove_the_read():
    """Another algorithm than the prefill's, or a peer read through a plan (whose digests are of its
    blocks, not of ours): the verifier digests the blocks it holds, as without them."""
    for alg, translated in ((XXH3, False), (WSUM, True)):
        endpoint, verifier, leased = _setup(alg, translated)
        other = XXH3 if alg == WSUM else WSUM
        verifier.start(_job([2, 5, 6]), DigestJob(other if not translated else WSUM, values=[0, 0, 0]))
        assert verifier.verify(_job([2, 5, 6]), leased) is None, (alg, translated)
        assert endpoint.digests_taken == [[2, 5, 6]], (alg, translated)


def test_without_the_copys_digests_the_landed_blocks_are_digested():
    endpoint, verifier, leased = _setup()
    verifier.start(_job([2, 5, 6]))
    assert endpoint.digests_taken == [[2, 5, 6]]
    assert verifier.verify(_job([2, 5, 6]), leased) is None
    assert endpoint.digests_taken == [[2, 5, 6]]  # once, when the read landed

"""The layout translator: random prefill and decode layouts against a one-element-at-a-time reference.

Each case draws a model (layers, KV heads, head_dim, dtype), a prefill TP size and a decode TP
size (1, 2 or 4; heads split or replicated), block sizes (8, 16, 32), page formats, placements
(block-major, layer-major, padded) and block ids (runs or scattered). The plan's reads are executed
as numpy byte copies between byte buffers (what NIXL would do), its gather by `apply_gather`; the
whole destination buffer must equal the reference's, so bytes outside the read tokens and heads stay
untouched, and no read may leave the pages of the blocks holding the prompt.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from kvbridge.errors import IncompatiblePeerError
from kvbridge.layout import K_TRANSPOSED_FORMATS, OPAQUE_FORMATS, PAGE_FORMATS, KVCacheLayout
from kvbridge.transfer.descriptors import coalesce_blocks
from kvbridge.transfer.layout_gather import apply_gather
from kvbridge.transfer.kv_shard import KVShard
from kvbridge.transfer.layout_plan import PlanKind, ReadPlan, plan_read

FORMATS = sorted(set(PAGE_FORMATS) - OPAQUE_FORMATS)  # opaque pages are never translated
PLACEMENTS = ("block-major", "layer-major", "padded")


# ---------------------------------------------------------------------------- random cases


def _layout(rng: random.Random, num_blocks, num_layers, block_size, heads, head_dim, dtype, page_format=None) -> KVCacheLayout:
    page_format = page_format or rng.choice(FORMATS)
    lay = KVCacheLayout(num_blocks, num_layers, block_size, heads, head_dim, dtype, page_format=page_format)
    placement = rng.choice(PLACEMENTS)
    if placement == "layer-major":  # vLLM's CPU placement
        return dataclasses.replace(lay, layer_stride=num_blocks * lay.page_nbytes, block_stride=lay.page_nbytes)
    if placement == "padded":
        pad = lay.element_size * rng.randint(1, 9)
        return dataclasses.replace(lay, layer_stride=lay.page_nbytes, block_stride=lay.block_nbytes + pad)
    return lay


def _shard_heads(rank: int, tp: int, total: int) -> tuple[int, int]:
    """(head_start, num_heads) of a TP rank, Megatron-style; replicated when tp > total."""
    if tp <= total:
        return rank * (total // tp), total // tp
    return rank // (tp // total), 1


def _block_ids(rng: random.Random, needed: int, num_blocks: int) -> list[int]:
    if rng.random() < 0.4:  # one run
        start = rng.randint(0, num_blocks - needed)
        return list(range(start, start + needed))
    return rng.sample(range(num_blocks), needed)


@dataclasses.dataclass
class Case:
    decode: KVShard
    dst_ids: list[int]
    prefills: list[KVShard]
    src_ids: list[list[int]]
    num_tokens: int

    def __str__(self) -> str:
        prefills = " | ".join(p.describe() for p in self.prefills)
        return f"{self.num_tokens} tokens: [{prefills}] -> [{self.decode.describe()}]"


def random_case(seed: int, page_format: str | None = None) -> Case:
    """A random case; `page_format`: every shard's (None: each its own, at random)."""
    rng = random.Random(seed)
    total = rng.choice((2, 4))
    num_layers, head_dim = rng.randint(1, 3), rng.choice((2, 4, 8))
    dtype = rng.choice(("float16", "bfloat16", "float32", "float8_e4m3fn"))
    p_size, d_size = rng.choice((8, 16, 32)), rng.choice((8, 16, 32))
    num_tokens = rng.randint(1, 3 * max(p_size, d_size))
    n, m = rng.choice((1, 2, 4)), rng.choice((1, 2, 4))

    def shard(rank, tp, block_size):
        start, heads = _shard_heads(rank, tp, total)
        needed = -(-num_tokens // block_size)
        num_blocks = needed + rng.randint(0, 6)
        lay = _layout(rng, num_blocks, num_layers, block_size, heads, head_dim, dtype, page_format)
        return KVShard(lay, start, total), _block_ids(rng, needed, num_blocks)

    decode, dst_ids = shard(rng.randrange(m), m, d_size)
    prefills, src_ids = zip(*(shard(rank, n, p_size) for rank in range(n)))
    return Case(decode, dst_ids, list(prefills), list(src_ids), num_tokens)


# ---------------------------------------------------------------------------- the reference and the executor


def _elements(buffer: np.ndarray, layout: KVCacheLayout) -> np.ndarray:
    """The [num_blocks, num_layers, *page_shape] element view of a byte buffer (numpy's own strides)."""
    elts = buffer.view(f"u{layout.element_size}")
    byte_strides = tuple(s * layout.element_size for s in layout.strides)
    return np.lib.stride_tricks.as_strided(elts, layout.shape, byte_strides)


def _index(layout: KVCacheLayout, block: int, layer: int, kv: int, slot: int, head: int, dim: int) -> tuple:
    if kv == 0 and layout.page_format in K_TRANSPOSED_FORMATS:  # K of a head is [head_dim, block_size]
        slot, dim = divmod(dim * layout.block_size + slot, layout.head_dim)
    coords = {"2": kv, "N": slot, "H": head, "D": dim}
    return (block, layer, *(coords[c] for c in layout.page_format[:4]))


def reference_read(case: Case, sources: list[np.ndarray], dst: np.ndarray) -> np.ndarray:
    """The destination after moving ONE ELEMENT AT A TIME, each needed head from the first rank holding it."""
    out = dst.copy()
    d_lay = case.decode.layout
    d_view = _elements(out, d_lay)
    for head in range(case.decode.head_start, case.decode.head_end):
        rank = next(i for i, p in enumerate(case.prefills) if p.head_start <= head < p.head_end)
        p_shard = case.prefills[rank]
        p_lay = p_shard.layout
        s_view = _elements(sources[rank], p_lay)
        for t in range(case.num_tokens):
            for layer in range(d_lay.num_layers):
                for kv in range(2):
                    for dim in range(d_lay.head_dim):
                        src = _index(p_lay, case.src_ids[rank][t // p_lay.block_size], layer, kv,
                                     t % p_lay.block_size, head - p_shard.head_start, dim)  # fmt: skip
                        dst_at = _index(d_lay, case.dst_ids[t // d_lay.block_size], layer, kv,
                                        t % d_lay.block_size, head - case.decode.head_start, dim)  # fmt: skip
                        d_view[dst_at] = s_view[src]
    return out


def execute(plan: ReadPlan, sources: list[np.ndarray], dst: np.ndarray) -> np.ndarray:
    """Run a plan over byte buffers: NIXL's reads as numpy byte copies, then the gather in torch."""
    out = dst.copy()
    r = plan.reads
    target = out if plan.kind is PlanKind.DIRECT else np.full(plan.staging_nbytes, 0xA5, dtype=np.uint8)
    for source, remote, local, nbytes in zip(r.source, r.remote_offsets, r.local_offsets, r.nbytes):
        target[local : local + nbytes] = sources[source][remote : remote + nbytes]
    if plan.kind is PlanKind.STAGED:
        apply_gather(plan.gather, torch.from_numpy(target), torch.from_numpy(out))
    return out


def _buffers(case: Case, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    gen = np.random.default_rng(seed)
    sources = [gen.integers(0, 256, p.layout.region_nbytes, dtype=np.uint8) for p in case.prefills]
    return sources, gen.integers(0, 256, case.decode.layout.region_nbytes, dtype=np.uint8)


def _plan(case: Case, kind: PlanKind | None, **kwargs) -> ReadPlan:
    return plan_read(case.decode, case.dst_ids, case.prefills, case.src_ids, case.num_tokens, kind=kind, **kwargs)


def _check_reads_stay_in_read_pages(case: Case, plan: ReadPlan) -> None:
    """No read touches a source byte outside the pages of the blocks holding the prompt's tokens."""
    for rank, shard in enumerate(case.prefills):
        lay = shard.layout
        allowed = np.zeros(lay.region_nbytes + 1, dtype=np.int64)  # +1 / -1 at page bounds, then cumsum
        used = case.src_ids[rank][: -(-case.num_tokens // lay.block_size)]
        for page in lay.page_offsets(used).reshape(-1):
            allowed[page] += 1
            allowed[page + lay.page_nbytes] -= 1
        inside = np.cumsum(allowed)[:-1] > 0
        mine = plan.reads.source == rank
        for start, nbytes in zip(plan.reads.remote_offsets[mine], plan.reads.nbytes[mine]):
            assert inside[start : start + nbytes].all(), f"a read of [{start}, {start + nbytes}) leaves the read pages"


# ---------------------------------------------------------------------------- properties


@pytest.mark.parametrize("seed", range(60))
def test_every_plan_moves_what_one_element_at_a_time_moves(seed):
    case = random_case(seed)
    print(f"seed {seed}: {case}")
    sources, dst = _buffers(case, seed)
    expected = reference_read(case, sources, dst)
    default = _plan(case, None)
    assert (default.kind is PlanKind.DIRECT) == (default.num_direct_descriptors is not None), "DIRECT wherever it applies"
    for kind in (None, PlanKind.DIRECT, PlanKind.STAGED):
        if kind is PlanKind.DIRECT and default.kind is PlanKind.STAGED:
            with pytest.raises(ValueError, match="agree page for page"):
                _plan(case, kind)
            continue
        plan = _plan(case, kind)
        assert plan.kind is (kind or default.kind)
        got = execute(plan, sources, dst)
        assert np.array_equal(got, expected), f"seed {seed}, {plan.summary()}: destination differs"
        _check_reads_stay_in_read_pages(case, plan)


@pytest.mark.parametrize("page_format", FORMATS)
@pytest.mark.parametrize("seed", range(12))
def test_one_page_format_everywhere_moves_the_same_bytes(seed, page_format):
    """Equal page formats read directly where block sizes and heads agree too."""
    case = random_case(2000 + seed, page_format)
    print(f"seed {seed}: {case}")
    sources, dst = _buffers(case, seed)
    expected = reference_read(case, sources, dst)
    default = _plan(case, None)
    for kind in (None, PlanKind.DIRECT, PlanKind.STAGED) if default.kind is PlanKind.DIRECT else (None,):
        plan = _plan(case, kind)
        assert np.array_equal(execute(plan, sources, dst), expected), f"seed {seed}, {plan.summary()}"
        _check_reads_stay_in_read_pages(case, plan)


@pytest.mark.parametrize("seed", range(8))
def test_staged_plans_read_whole_pages_one_descriptor_per_run_of_source_blocks(seed):
    case = random_case(1000 + seed)
    print(f"seed {seed}: {case}")
    plan = _plan(case, PlanKind.STAGED)
    read = sorted(set(plan.reads.source.tolist()))
    blocks = {r: sorted(case.src_ids[r][: -(-case.num_tokens // case.prefills[r].layout.block_size)]) for r in read}
    assert plan.staging_nbytes == plan.nbytes_read == sum(len(blocks[r]) * case.prefills[r].layout.block_nbytes for r in read)
    if all(case.prefills[r].layout.is_contiguous for r in read):  # block-major: a run of ids is one range
        assert plan.num_descriptors == sum(1 + sum(b != a + 1 for a, b in zip(ids, ids[1:])) for ids in blocks.values())
    assert plan.gather.num_indices <= len(read) * (case.num_tokens + 1), "indices per token chunk, not per element"


def test_identical_layouts_read_directly_with_the_runs_of_coalesce_blocks():
    lay = KVCacheLayout(num_blocks=40, num_layers=2, block_size=16, num_kv_heads=4, head_dim=8, dtype="bfloat16")
    rng = random.Random(7)
    src, dst = rng.sample(range(40), 12), [*range(3, 9), *rng.sample(range(10, 40), 6)]
    plan = plan_read(KVShard(lay), dst, [KVShard(lay)], [src], 12 * 16)
    assert plan.kind is PlanKind.DIRECT and plan.staging_nbytes == 0
    assert plan.num_descriptors == coalesce_blocks(dst, src, lay).num_descriptors


def test_tp2_to_1_with_a_larger_decode_block_is_staged_with_one_read_per_source_run():
    model = dict(num_layers=2, head_dim=8, dtype="float16")
    decode = KVShard(KVCacheLayout(num_blocks=8, block_size=32, num_kv_heads=4, page_format="H2ND", **model))
    prefills = [KVShard(KVCacheLayout(num_blocks=16, block_size=16, num_kv_heads=2, **model), h, 4) for h in (0, 2)]
    plan = plan_read(decode, [5, 6], prefills, [[0, 1, 2, 3], [8, 9, 10, 11]], 64)
    assert plan.kind is PlanKind.STAGED
    assert plan.descriptors_per_source(2) == [1, 1] and plan.nbytes_read == decode.layout.page_nbytes * 2 * 2


# ---------------------------------------------------------------------------- long prompts, transposed K


def _vllm_cpu(layout: KVCacheLayout) -> KVCacheLayout:
    """vLLM's CPU placement: layers outermost, pages of one layer adjacent."""
    return dataclasses.replace(layout, layer_stride=layout.num_blocks * layout.page_nbytes, block_stride=layout.page_nbytes)


@pytest.mark.parametrize("to_vllm", [True, False], ids=["2NHD->H2ND-KT", "H2ND-KT->2NHD"])
def test_a_long_prompt_between_transposed_k_and_2nhd_pages_moves_what_one_element_at_a_time_moves(to_vllm):
    """2,053 tokens (a tail past the last whole block on both sides), scattered ids, two prefill ranks on
    the 2NHD side: the element-by-element planner of before listed one atom per element here."""
    seed = 23
    print(f"seed {seed}")
    rng = random.Random(seed)
    model = dict(num_layers=2, head_dim=2, dtype="bfloat16")
    num_tokens, total = 2053, 2
    kvb = KVCacheLayout(num_blocks=160, block_size=16, num_kv_heads=1, **model)  # one TP rank of two
    vllm = _vllm_cpu(KVCacheLayout(num_blocks=80, block_size=32, num_kv_heads=2, page_format="H2ND-KT", **model))
    kvb_ids = [rng.sample(range(160), 129) for _ in range(2)]
    vllm_ids = rng.sample(range(80), 65)
    if to_vllm:
        case = Case(KVShard(vllm), vllm_ids, [KVShard(kvb, h, total) for h in range(2)], kvb_ids, num_tokens)
    else:
        case = Case(KVShard(kvb, 1, total), kvb_ids[0], [KVShard(vllm)], [vllm_ids], num_tokens)
    sources, dst = _buffers(case, seed)
    plan = _plan(case, None)
    assert plan.kind is PlanKind.STAGED
    assert np.array_equal(execute(plan, sources, dst), reference_read(case, sources, dst)), plan.summary()
    _check_reads_stay_in_read_pages(case, plan)


LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
MIXED_ENGINES_TINY = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32")  # tests/integrations/vllm's checkpoint


@pytest.mark.parametrize("model,num_tokens", [(LLAMA_8B, 256), (LLAMA_8B, 4096), (LLAMA_8B, 32768), (MIXED_ENGINES_TINY, 16384)],
                         ids=["llama-8b-256", "llama-8b-4096", "llama-8b-32768", "tiny-16384"])  # fmt: skip
def test_long_reads_between_kvbridge_and_vllm_cpu_pages_plan_per_block_not_per_element(model, num_tokens):
    """kvbridge's 16-token block-major 2NHD pages and vLLM CPU's 128-token layer-major H2ND-KT pages, both
    ways. Before, such a plan listed one atom per element and was refused past 2**23 of them (128 tokens at
    Llama-3-8B's KV, 8,192 at the mixed-engine tests' checkpoint, whose 1,024-token context cannot reach
    that); now it lists pages and token chunks."""
    kvb_ids, vllm_ids = np.arange(1, 1 + num_tokens // 16), np.arange(1, 1 + num_tokens // 128)
    kvb = KVCacheLayout(num_blocks=len(kvb_ids) + 8, block_size=16, **model)
    vllm = _vllm_cpu(KVCacheLayout(num_blocks=len(vllm_ids) + 8, block_size=128, page_format="H2ND-KT", **model))
    elements_per_token = model["num_layers"] * 2 * model["num_kv_heads"] * model["head_dim"]
    assert num_tokens * elements_per_token > (1 << 23)  # the old planner's limit
    into_vllm = plan_read(KVShard(vllm), vllm_ids, [KVShard(kvb)], [kvb_ids], num_tokens)
    assert into_vllm.kind is PlanKind.STAGED and into_vllm.num_descriptors == 1  # one run of block-major blocks
    assert into_vllm.gather.num_indices == num_tokens // 16  # a 16-token chunk per kvbridge block
    from_vllm = plan_read(KVShard(kvb), kvb_ids, [KVShard(vllm)], [vllm_ids], num_tokens)
    assert from_vllm.kind is PlanKind.STAGED and from_vllm.num_descriptors == model["num_layers"]  # a run of pages per layer
    assert from_vllm.gather.num_indices == num_tokens // 16
    assert into_vllm.nbytes_read == from_vllm.nbytes_read == num_tokens * elements_per_token * kvb.element_size


# ---------------------------------------------------------------------------- the descriptor budget


@pytest.mark.parametrize("fragmented", [False, True], ids=["runs", "fragmented"])
def test_a_tp2_to_1_read_of_4096_tokens_costs_at_most_twice_the_descriptors_of_tp1_to_1(fragmented):
    model = dict(num_layers=4, head_dim=16, dtype="bfloat16", block_size=16)
    num_tokens, num_blocks, heads = 4096, 512, 8
    rng = random.Random(23)
    pick = (lambda: rng.sample(range(num_blocks), 256)) if fragmented else (lambda: list(range(100, 356)))
    dst_ids, src_ids = pick(), pick()
    decode = KVShard(KVCacheLayout(num_blocks=num_blocks, num_kv_heads=heads, **model))
    tp1 = plan_read(decode, dst_ids, [KVShard(decode.layout)], [src_ids], num_tokens)
    half = KVCacheLayout(num_blocks=num_blocks, num_kv_heads=heads // 2, **model)
    tp2 = plan_read(decode, dst_ids, [KVShard(half, 0, heads), KVShard(half, heads // 2, heads)], [src_ids, pick()], num_tokens)
    print(f"descriptors per request, {'fragmented' if fragmented else 'runs'}: TP 1->1 {tp1.summary()}; TP 2->1 {tp2.summary()}")
    assert tp1.kind is PlanKind.DIRECT and tp2.kind is PlanKind.STAGED
    assert tp2.num_descriptors <= 2 * tp1.num_descriptors
    assert tp2.num_direct_descriptors is None  # a 2NHD page's half of the heads is no byte range: no direct read


# ---------------------------------------------------------------------------- refusals


MODEL = dict(num_blocks=8, num_layers=2, block_size=16, num_kv_heads=4, head_dim=8, dtype="bfloat16")


@pytest.mark.parametrize("field,value", [("num_layers", 3), ("head_dim", 16), ("dtype", "float16"), ("num_kv_heads", 8)])
def test_another_model_is_refused_naming_both_layouts(field, value):
    decode = KVShard(KVCacheLayout(**MODEL))
    prefill = KVShard(KVCacheLayout(**{**MODEL, field: value, "page_format": "H2ND"}))
    with pytest.raises(IncompatiblePeerError) as err:
        plan_read(decode, [0], [prefill], [[0]], 16)
    assert decode.describe() in str(err.value) and prefill.describe() in str(err.value)


def test_opaque_pages_are_refused_naming_both_layouts():
    decode = KVShard(KVCacheLayout(**MODEL))
    prefill = KVShard(KVCacheLayout(**{**MODEL, "page_format": "vllm-cpu-amx"}))
    for d, p in ((decode, prefill), (prefill, decode)):
        with pytest.raises(IncompatiblePeerError, match="vllm-cpu-amx pages move whole only") as err:
            plan_read(d, [0], [p], [[0]], 1)
        assert d.describe() in str(err.value) and p.describe() in str(err.value)


def test_a_plan_of_more_entries_than_planning_may_hold_is_refused(monkeypatch):
    """2 layers x 1 page + 16 tokens = 18 pages and token chunks listed, whatever head_dim and the K layout."""
    from kvbridge.errors import PlanTooLargeError
    from kvbridge.transfer import layout_plan

    decode = KVShard(KVCacheLayout(**{**MODEL, "page_format": "H2ND-KT"}))
    prefill = KVShard(KVCacheLayout(**MODEL))
    assert plan_read(decode, [0], [prefill], [[0]], 16).nbytes_read == 2048 * 2
    monkeypatch.setattr(layout_plan, "MAX_PLAN_ENTRIES", 17)
    with pytest.raises(PlanTooLargeError, match="lists 18 pages and token chunks, more than 17"):
        plan_read(decode, [0], [prefill], [[0]], 16)


def test_heads_no_prefill_rank_holds_are_refused():
    decode = KVShard(KVCacheLayout(**MODEL))
    half = KVShard(KVCacheLayout(**{**MODEL, "num_kv_heads": 2}), 0, 4)
    with pytest.raises(IncompatiblePeerError, match=r"KV heads \[2, 3\]"):
        plan_read(decode, [0], [half], [[0]], 16)


# ---------------------------------------------------------------------------- rebuilding the prefill's blocks


def test_the_prefills_blocks_are_rebuilt_from_the_decodes_pages_byte_for_byte():
    """What the digest check of a translated read hashes (layout_gather.rebuild_blocks)."""
    from kvbridge.transfer.layout_gather import rebuild_blocks

    prefill = KVCacheLayout(num_blocks=12, num_layers=3, block_size=16, num_kv_heads=2, head_dim=4, dtype="float16",
                            page_format="H2ND")  # fmt: skip
    prefill = dataclasses.replace(prefill, layer_stride=12 * prefill.page_nbytes, block_stride=prefill.page_nbytes)
    decode = KVCacheLayout(num_blocks=6, num_layers=3, block_size=32, num_kv_heads=2, head_dim=4, dtype="float16")
    decode = dataclasses.replace(decode, layer_stride=decode.page_nbytes, block_stride=decode.block_nbytes + 6)
    src_ids, dst_ids = [7, 2, 3, 11], [4, 0]
    case = Case(KVShard(decode), dst_ids, [KVShard(prefill)], [src_ids], 64)
    sources, dst = _buffers(case, 3)
    landed = execute(_plan(case, None), sources, dst)
    blocks, layout = rebuild_blocks(torch.from_numpy(landed), decode, dst_ids, prefill, len(src_ids))
    assert layout == prefill.block_major(4)
    src_view, got = _elements(sources[0], prefill), _elements(blocks.numpy(), layout)
    for i, block in enumerate(src_ids):
        assert np.array_equal(got[i], src_view[block]), f"block {block}"
    with pytest.raises(ValueError, match="do not hold"):
        rebuild_blocks(torch.from_numpy(landed), decode, dst_ids[:1], prefill, len(src_ids))


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_engine_ranks_of_tp_layout_plan_and_move_the_same_bytes(prefill_tp, decode_tp):
    """The shards of tp_layout.rank_kv_layouts (2 KV heads: TP 4 replicates each on two ranks)."""
    from kvbridge.tp_layout import rank_kv_layouts

    model = dict(num_layers=2, head_dim=4, dtype="bfloat16")
    total, num_tokens = 2, 40

    def ranks(tp, block_size, page_format):
        one = KVCacheLayout(num_blocks=8, block_size=block_size, num_kv_heads=max(1, total // tp),
                            page_format=page_format, **model)  # fmt: skip
        return [KVShard.of_rank(r, total) for r in rank_kv_layouts(tp, 4, total, 8, one)]

    prefills = ranks(prefill_tp, 16, "2NHD")
    for decode in ranks(decode_tp, 32, "H2ND"):
        case = Case(decode, [5, 1], prefills, [[0, 3, 4]] * len(prefills), num_tokens)
        sources, dst = _buffers(case, prefill_tp * 10 + decode_tp)
        plan = _plan(case, None)
        first_holders = {next(i for i, p in enumerate(prefills) if p.head_start <= h < p.head_end)
                         for h in range(decode.head_start, decode.head_end)}  # fmt: skip
        assert set(plan.reads.source.tolist()) == first_holders  # a replicated head is read from one rank
        assert np.array_equal(execute(plan, sources, dst), reference_read(case, sources, dst)), str(case)

"""KVBridgeConnector's identity rules and connector contract inside vLLM's real `Scheduler` (0.32, CPU).

* identity: a block's hash covers what vLLM's prefix-cache keys cover (cache salt, LoRA, images), computed
  with vLLM's own extra-key function on real vLLM `Request`s, and the LoRA adapter's content; images
  keep their identity in a chain at another engine's block size; a request whose extra keys cannot be
  had is computed locally (no load, no store, no lease);
* `get_num_new_matched_tokens` has no side effects: asked again and again, it answers the same and
  counts nothing twice (vLLM asks each step a request waits);
* preemption while offload stores are in flight: the step that frees the preempted request's blocks
  tells the worker to finish those stores first; chunked prefill of the tokens after a remote load;
* missing start-up handshake metadata is a hard error, not a warning followed by failing reads;
* the engine identity changes with every setting that changes KV (here: hf_overrides, the KV cache dtype).

    .venv-vllm/bin/python -m pytest -q tests/integrations/vllm/test_scheduler_contract.py
"""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from sched_harness import BLOCK_SIZE, SchedulerHarness  # noqa: E402
from sched_harness import OffloadWorkerModel  # noqa: E402
from test_scheduler_side import Driver, consumer, leftovers, mint_params, model_id_of, offload, prompt_of  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvbridge.block_hash import hash_full_blocks  # noqa: E402
from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.integrations.vllm.identity import UnidentifiableRequest, vllm_extra_keys_fn  # noqa: E402
from kvbridge.integrations.vllm.requests import RequestViews  # noqa: E402

pytestmark = pytest.mark.vllm


def _stored_then_reset(o: SchedulerHarness, req_id: str, prompt: list[int], **fields) -> None:
    """`prompt` computed, stored to the host tier, and gone from vLLM's prefix cache."""
    o.add_request(req_id, prompt, **fields)
    o.step()
    o.step(finished_sending={req_id})
    assert o.num_used_blocks == 0
    assert o.scheduler.kv_cache_manager.reset_prefix_cache()


def test_the_host_tier_serves_a_salted_prompt_to_its_own_salt_only(tiny_checkpoint):
    o = offload(tiny_checkpoint)
    prompt = prompt_of(20, 40)
    _stored_then_reset(o, "a0", prompt, cache_salt="tenant-a")

    o.add_request("b0", prompt, cache_salt="tenant-b")
    o.add_request("plain", prompt)
    step = o.step()
    assert o.matches["b0"] == [(0, False)] and o.matches["plain"] == [(0, False)]
    assert not step.metadata.loads

    o.add_request("a1", prompt, cache_salt="tenant-a")
    step = o.step()
    assert o.matches["a1"] == [(32, True)]
    (load,) = step.metadata.loads
    assert load.req_id == "a1"


def _adapter(directory, weights: bytes) -> str:
    """A LoRA adapter directory holding `weights` (rewritten in place when it exists)."""
    directory.mkdir(exist_ok=True)
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return str(directory)


def test_unsalted_hashes_are_kvbridges_own_and_extra_keys_change_every_block(tiny_checkpoint, tmp_path):
    namespace = model_id_of(tiny_checkpoint)
    views = RequestViews(BLOCK_SIZE, namespace, vllm_extra_keys_fn())
    prompt = prompt_of(21, 48)

    def hashes(req_id: str, **fields) -> list[bytes]:
        request = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                          pooling_params=None, arrival_time=0.0, **fields)  # fmt: skip
        return views.of(request).block_hashes

    plain = hashes("plain")
    assert plain == hash_full_blocks(prompt, BLOCK_SIZE, namespace=namespace)  # what kvbridge's engine computes
    salt_a, salt_a_again, salt_b = hashes("a", cache_salt="a"), hashes("a2", cache_salt="a"), hashes("b", cache_salt="b")
    lora_1 = hashes("l1", lora_request=LoRARequest("adapter-1", 1, _adapter(tmp_path / "1", b"one")))
    lora_2 = hashes("l2", lora_request=LoRARequest("adapter-2", 2, _adapter(tmp_path / "2", b"two")))
    assert salt_a == salt_a_again
    for other in (salt_a, salt_b, lora_1, lora_2):
        assert len(other) == len(plain) == 3
    variants = [plain, salt_a, salt_b, lora_1, lora_2]
    for i, x in enumerate(variants):  # no block of one variant is any block of another
        for y in variants[i + 1 :]:
            assert not set(x) & set(y)


def test_lora_identity_is_the_adapters_content(tiny_checkpoint, tmp_path):
    """Two adapters under one name and path (rewritten in place, or another host's copy of other weights)
    never share KV; the same weights do, whatever the files' times; an adapter that is not a local path
    (a hub id resolved elsewhere) is not identifiable."""
    views = RequestViews(BLOCK_SIZE, model_id_of(tiny_checkpoint), vllm_extra_keys_fn())
    prompt, path = prompt_of(26, 48), tmp_path / "adapter"

    def hashes(req_id: str, path: str) -> list[bytes]:
        request = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                          pooling_params=None, arrival_time=0.0, lora_request=LoRARequest("tenant", 1, path))  # fmt: skip
        return views.of(request).block_hashes

    first = hashes("a", _adapter(path, b"weights-a" * 1000))
    rewritten = hashes("b", _adapter(path, b"weights-b" * 1000))  # same name, same path, same size
    assert not set(first) & set(rewritten), "two adapters under one name and path share KV"
    os.utime(path / "adapter_model.safetensors", ns=(1, 1))
    assert hashes("c", str(path)) == rewritten  # a copy with other times holds the same weights: same KV
    os.utime(path / "adapter_config.json", ns=(1, 1))
    (path / "adapter_model.safetensors").write_bytes(b"weights-a" * 1000)  # back to the first weights, old times
    os.utime(path / "adapter_model.safetensors", ns=(1, 1))
    assert hashes("d", str(path)) == first
    with pytest.raises(UnidentifiableRequest):
        hashes("hub", "some-org/some-adapter")


def test_the_host_tier_never_serves_kv_of_another_adapter_under_the_same_name(tiny_checkpoint, tmp_path):
    o = offload(tiny_checkpoint)
    prompt, path = prompt_of(27, 40), tmp_path / "adapter"
    _stored_then_reset(o, "a0", prompt, lora_request=LoRARequest("tenant", 1, _adapter(path, b"weights-a" * 100)))
    _adapter(path, b"weights-b" * 100)  # the adapter is replaced in place; the name and path stay

    o.add_request("b0", prompt, lora_request=LoRARequest("tenant", 1, str(path)))
    step = o.step()
    assert o.matches["b0"] == [(0, False)], "the host tier served KV computed with another adapter"
    assert not step.metadata.loads


def test_multimodal_identity_holds_across_block_sizes():
    """The prefill's block size (a restarted chain) sees a request's images as a chain of its own does:
    the decode's own blocks, hashed first, do not move its multimodal cursor."""
    prompt = list(range(100, 164))

    def request(image: str) -> Request:
        feature = MultiModalFeatureSpec(data=None, modality="image", identifier=image, mm_position=PlaceholderRange(4, 8))
        return Request(request_id=image, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                       pooling_params=None, arrival_time=0.0, mm_features=[feature])  # fmt: skip

    decode, prefill = RequestViews(8, "ns", vllm_extra_keys_fn()), RequestViews(16, "ns", vllm_extra_keys_fn())
    seen = decode.of(request("cat"))
    assert len(seen.block_hashes) == 8  # the decode's own chain walks past the image first
    assert seen.prompt_block_hashes(16) == prefill.of(request("cat")).block_hashes
    assert not set(seen.prompt_block_hashes(16)) & set(prefill.of(request("dog")).block_hashes)
    assert seen.block_hashes == RequestViews(8, "ns", vllm_extra_keys_fn()).of(request("cat")).block_hashes


def test_a_request_without_computable_extra_keys_is_computed_locally(tiny_checkpoint):
    o = offload(tiny_checkpoint)
    o.adapter.views.extra_keys = None  # as under a vLLM without generate_block_hash_extra_keys
    prompt = prompt_of(22, 40)
    o.add_request("salted", prompt, cache_salt="tenant-a", max_tokens=1)
    step = o.step()
    assert o.matches["salted"] == [(0, False)]
    assert not step.metadata.stores  # nothing of it reaches the host tier
    assert o.finishes["salted"] == [(False, None)]  # no delayed free, no kv_transfer_params
    assert o.num_used_blocks == 0 and leftovers(o) == {} and not o.adapter._local

    o.add_request("plain", prompt)  # requests without extra keys are unaffected
    (store,) = o.step().metadata.stores
    assert store.req_id == "plain"


def test_get_num_new_matched_tokens_has_no_side_effects_offload(tiny_checkpoint):
    o = offload(tiny_checkpoint)
    prompt = prompt_of(23, 40)
    _stored_then_reset(o, "r0", prompt)
    request = o.make_request("r1", prompt)
    stats = o.inner.get_stats()

    answers = [o.connector.get_num_new_matched_tokens(request, 0) for _ in range(3)]

    assert answers == [(32, True)] * 3
    assert o.inner.get_stats() == stats  # nothing counted, nothing pinned
    o.scheduler.add_request(request)
    (load,) = o.step().metadata.loads  # the real admission still loads the hit, once
    assert load.req_id == "r1" and len(load.gpu_block_ids) == 2


def test_get_num_new_matched_tokens_counts_a_refusal_once(tiny_checkpoint):
    prompt, other = prompt_of(24, 40), prompt_of(25, 40)
    (params,) = mint_params(tiny_checkpoint, [other])  # another prompt's blocks: the hash does not match
    d = consumer(tiny_checkpoint)
    request = d.make_request("d0", prompt, kv_transfer_params=params)

    answers = [d.connector.get_num_new_matched_tokens(request, 0) for _ in range(3)]

    assert answers == [(0, False)] * 3
    assert d.inner.num_mismatched_params == 1
    d.scheduler.add_request(request)
    d.step()
    d.step()
    assert d.inner.num_mismatched_params == 1 and d.num_used_blocks == 0 and leftovers(d) == {}


def test_missing_start_up_handshake_is_a_hard_error(tiny_checkpoint):
    h = SchedulerHarness.build(tiny_checkpoint, role="kv_both", connector="OffloadingConnector",
                               options={"host_num_blocks": 8}, incarnation=None)  # fmt: skip
    h.add_request("r0", prompt_of(26, 40))
    with pytest.raises(ConfigError, match="no start-up metadata"):
        h.step()
    with pytest.raises(ConfigError, match="expected start-up metadata from one kvbridge worker"):
        h.connector.set_xfer_handshake_metadata({})


@pytest.mark.parametrize("seed", [0, 1])
def test_preemption_waits_for_the_preempted_requests_stores(tiny_checkpoint, seed):
    print(f"seed={seed}")
    # 7 usable blocks; two requests that each grow to 6 blocks: vLLM preempts one of them mid-decode
    h = SchedulerHarness.build(tiny_checkpoint, role="kv_both", connector="OffloadingConnector",
                               options={"host_num_blocks": 64}, num_blocks=8, max_num_seqs=4)  # fmt: skip
    run = Driver(h, OffloadWorkerModel(random.Random(seed), max_delay=30))  # stores stay in flight a while
    for i in range(2):
        h.add_request(f"r{i}", prompt_of(30 + i, 40), max_tokens=50)
    run.drain()

    preempting = [s for s in h.steps if s.scheduler_output.preempted_req_ids]
    assert preempting, "no request was preempted"
    num_waits = 0
    for step in preempting:
        preempted = step.scheduler_output.preempted_req_ids
        waited = step.metadata.wait_for_req_ids if step.metadata is not None else set()
        # every preempted request whose prompt stores were still running is waited for in that very step
        in_flight = {r for r in preempted if _had_stores_in_flight(h, step, r)}
        assert in_flight <= waited, (preempted, in_flight, waited)
        num_waits += len(in_flight)
    assert num_waits, "no request was preempted with stores in flight: the scenario tested nothing"
    assert run.finished() == {"r0", "r1"}
    assert h.num_used_blocks == 0 and leftovers(h) == {}
    h.inner.check_integrity()


def _had_stores_in_flight(h: SchedulerHarness, step, req_id: str) -> bool:
    """Whether a store of `req_id` was planned before `step`: a running request's stores are confirmed
    only when it finishes, and a preempted request has not finished."""
    index = h.steps.index(step)
    return any(s.metadata is not None and any(j.req_id == req_id for j in s.metadata.stores) for s in h.steps[:index])


def test_tokens_after_a_remote_load_are_prefilled_in_chunks(tiny_checkpoint):
    prompt = prompt_of(40, 40)  # 2 full blocks come from the prefill engine, 8 tokens are computed here
    (params,) = mint_params(tiny_checkpoint, [prompt])
    d = consumer(tiny_checkpoint, max_num_batched_tokens=4, max_num_seqs=4)
    d.add_request("d0", prompt, kv_transfer_params=params)

    (job,) = d.step().metadata.recvs.values()
    assert len(job.local_block_ids) == 2
    d.step(finished_recving={"d0"})
    chunks = [d.step().num_scheduled_tokens for _ in range(3)]

    assert chunks[:2] == [{"d0": 4}, {"d0": 4}]  # the rest of the prompt, in two chunks of the budget
    assert all(not s.metadata.recvs for s in d.steps[1:])  # read once, never again for a chunk
    assert d.scheduler.requests.get("d0") is None or d.scheduler.requests["d0"].num_computed_tokens >= 40
    for _ in range(3):
        d.step()
    assert d.num_used_blocks == 0 and leftovers(d) == {}


def test_engine_identity_covers_kv_affecting_overrides(tiny_checkpoint):
    from sched_harness import make_vllm_config
    from vllm.config import ModelConfig

    from kvbridge.integrations.vllm.config import engine_identity

    config = make_vllm_config(tiny_checkpoint, role="kv_both")
    plain = engine_identity(config)
    assert plain == model_id_of(tiny_checkpoint)  # as kvbridge's own engine names the checkpoint

    def with_overrides(**hf_overrides) -> str:
        config.model_config = ModelConfig(model=tiny_checkpoint, dtype="float32", max_model_len=4096, seed=0,
                                          skip_tokenizer_init=True, enforce_eager=True, hf_overrides=hf_overrides)  # fmt: skip
        return engine_identity(config)

    theta_a, theta_a_again = with_overrides(rope_theta=1e6), with_overrides(rope_theta=1e6)
    theta_b = with_overrides(rope_theta=5e5)
    assert theta_a == theta_a_again and theta_a.startswith(plain + "+kv:")
    assert len({plain, theta_a, theta_b}) == 3
    config.cache_config.cache_dtype = "fp8"  # a KV cache dtype is part of the identity too
    assert with_overrides(rope_theta=1e6) not in (theta_a, plain)

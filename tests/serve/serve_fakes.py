"""A deterministic stand-in for EngineCore, so the HTTP layer is tested in milliseconds without torch.

Token ids are bytes (vocab 256, EOS 0). Each step appends `(last token + 1) % 256`, skipping 0
unless the request's stop_token_ids say otherwise, to every running request. It honours the P/D
params the way the NixlConnector does, in shape only: `do_remote_decode` makes the finished
output carry `remote_*` params; `do_remote_prefill` counts the prompt as external tokens.
`kv_transfer_params={"fake_error": msg}` ends the request with an error.
"""

from __future__ import annotations

import threading
import time

from kvbridge.config import EngineConfig, ModelConfig
from kvbridge.kv_transfer_params import RemotePrefillParams
from kvbridge.engine.request_limits import RequestLimits
from kvbridge.engine.outputs import CompletionOutput, RequestOutput
from kvbridge.errors import InvalidRequestError

EOS = 0


class FakeTokenizer:
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


class FakeEngineCore:
    model_id = "fake"

    def __init__(self, engine_id: str = "fake-engine", step_delay_s: float = 0.0, model: str = "tiny") -> None:
        self.tokenizer = FakeTokenizer()
        self.config = EngineConfig(model=ModelConfig(model=model))  # `model`: where a chat template is read
        self.limits = RequestLimits(vocab_size=256, max_model_len=64)
        self.engine_id = engine_id
        self.step_delay_s = step_delay_s
        self.requests: dict[str, dict] = {}
        self.num_finished = 0
        self.num_aborted = 0
        self.num_steps = 0
        self.fail_next_step = False
        self.transfers_in_flight: set[str] = set()  # what try_reset_prefix_cache waits on; tests edit it
        self.num_resets = 0
        self.is_shut_down = False
        self.thread_ids: set[int] = set()  # every thread that touched the engine

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt_token_ids, sampling_params, kv_transfer_params=None) -> None:
        self._touch()
        if any(not 0 <= t < 256 for t in prompt_token_ids):
            raise InvalidRequestError("token id out of the vocabulary [0, 256)", param="prompt")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        self.requests[request_id] = {
            "prompt": list(prompt_token_ids),
            "params": sampling_params,
            "kv": dict(kv_transfer_params or {}),
            "out": [],
        }

    def abort_request(self, request_id: str) -> None:
        self._touch()
        if self.requests.pop(request_id, None) is not None:
            self.num_aborted += 1

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.num_steps += 1
        if self.fail_next_step:
            raise RuntimeError("injected step failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs = []
        for rid, req in list(self.requests.items()):
            outputs.append(self._advance(rid, req))
        return outputs

    def _advance(self, rid: str, req: dict) -> RequestOutput:
        params, kv = req["params"], req["kv"]
        last = (req["out"] or req["prompt"])[-1]
        token = (last + 1) % 256
        if token == EOS and not params.ignore_eos and EOS not in params.stop_token_ids:
            token = 1
        req["out"].append(token)
        reason, error, kv_out = None, None, None
        if "fake_error" in kv:
            reason, error = "error", kv["fake_error"]
        elif token in params.stop_token_ids:
            reason = "stop"
        elif len(req["out"]) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            del self.requests[rid]
            self.num_finished += 1
            if kv.get("do_remote_decode"):
                kv_out = RemotePrefillParams(  # the full shape: the API validates it on the decode leg
                    remote_engine_id=self.engine_id, remote_host="127.0.0.1", remote_port=5557,
                    remote_block_ids=[0], remote_request_id=rid, remote_block_hash="00" * 16,
                    remote_incarnation="fake-incarnation", remote_lease_token="fake-token",
                ).to_dict()
        ids = list(req["out"])
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=req["prompt"],
            outputs=[CompletionOutput(0, ids, self.tokenizer.decode(ids), reason)],
            finished=reason is not None,
            kv_transfer_params=kv_out,
            num_external_tokens=len(req["prompt"]) if kv.get("do_remote_prefill") else 0,
            error=error,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        return False

    def reset_prefix_cache(self) -> bool:
        return True

    def try_reset_prefix_cache(self, waiting_on: frozenset[str] | None = None) -> frozenset[str]:
        self._touch()
        pending = frozenset(self.transfers_in_flight)
        pending = pending & waiting_on if waiting_on is not None else pending
        self.num_resets += not pending
        return pending

    def get_stats(self) -> dict:
        self._touch()
        return {
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "pool": {"num_free_blocks": 10, "num_used_blocks": len(self.requests)},
            "engine_id": self.engine_id,  # a string: not a metric
        }

    def check_integrity(self) -> None:
        self._touch()

    def shutdown(self) -> None:
        self.is_shut_down = True

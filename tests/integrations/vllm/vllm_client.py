"""An OpenAI-completions client for vLLM servers, the two-leg P/D protocol, and /metrics scraping.

    out = complete(url, {"prompt": ids, "max_tokens": 8, "temperature": 0})        # or "stream": True
    pd = pd_complete(prefill_url, decode_url, {"prompt": ids, "max_tokens": 8, "temperature": 0})
    pd.token_ids, pd.ttft_s, pd.kv_transfer_params

The P/D protocol is the one vLLM's toy proxy speaks, written here from its description: the same
client drives vLLM's own NixlConnector and kvbridge's connector inside vLLM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import time
import secrets
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from kvbridge.serve.launcher import http_json

REQUEST_TIMEOUT_S = 120.0

# The prefill leg's kv_transfer_params: "compute the prompt, keep its KV for a remote decode".
PREFILL_LEG_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


class VLLMRequestError(RuntimeError):
    """A completion request was answered with an HTTP error or a malformed body."""


class Completion(NamedTuple):
    token_ids: list[int]
    text: str
    prompt_token_ids: list[int]
    ttft_s: float  # request sent -> first token received (the whole request when not streamed)
    total_s: float  # request sent -> last byte received
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None


class PDCompletion(NamedTuple):
    decode: Completion  # the decode server's completion: what the user gets
    prefill: Completion  # the prefill leg (max_tokens 1)
    kv_transfer_params: dict[str, Any]  # what the decode was sent (the prefill's answer, or its coordinates)
    at_once: bool = False  # both legs sent together (push mode), not the decode after the prefill

    @property
    def token_ids(self) -> list[int]:
        return self.decode.token_ids

    @property
    def ttft_s(self) -> float:
        """The user's time to first token: the whole prefill leg, then the decode leg's first token; with
        both legs sent at once, the decode leg's first token alone (it started with the prefill)."""
        return self.decode.ttft_s if self.at_once else self.prefill.total_s + self.decode.ttft_s


def complete(
    base_url: str, body: dict[str, Any], *, timeout_s: float = REQUEST_TIMEOUT_S, request_id: str | None = None
) -> Completion:
    """POST /v1/completions with `body` (one prompt: text or token ids); `stream: true` streams it.
    `request_id`: sent as X-Request-Id, from which vLLM derives its own request id.

    `return_token_ids` is always set, so the completion's token ids come back whatever the tokenizer.
    A streamed completion's `ttft_s` is the arrival of the first chunk that carries a token. An HTTP
    error or a malformed answer raises VLLMRequestError with the server's message.
    """
    body = {**body, "return_token_ids": True}
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        headers = {"Content-Type": "application/json"} | ({"X-Request-Id": request_id} if request_id else {})
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read().decode(errors="replace")
            raise VLLMRequestError(f"POST {base_url}/v1/completions answered {resp.status}: {detail[:2000]}")
        if body.get("stream"):
            return _read_stream(resp, start, base_url)
        raw = resp.read()
        end = time.perf_counter()
        return _parse_completion(raw, start, end)
    finally:
        conn.close()


def _parse_completion(raw: bytes, start: float, end: float) -> Completion:
    try:
        body = json.loads(raw)
        choice = body["choices"][0]
        prompt_token_ids = list(choice.get("prompt_token_ids") or [])
        return Completion(list(choice["token_ids"]), choice["text"], prompt_token_ids, end - start, end - start,
                          body.get("kv_transfer_params"), choice.get("finish_reason"))  # fmt: skip
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise VLLMRequestError(f"malformed completion ({exc!r}): {raw[:2000]!r}") from None


def _read_stream(resp: http.client.HTTPResponse, start: float, base_url: str) -> Completion:
    """Server-sent events: "data: {chunk}" lines, then "data: [DONE]"; chunks are joined into one completion."""
    token_ids: list[int] = []
    prompt_token_ids: list[int] = []
    texts: list[str] = []
    first_token_at = finish_reason = kv_transfer_params = None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: ") :])
        kv_transfer_params = chunk.get("kv_transfer_params") or kv_transfer_params
        for choice in chunk.get("choices", []):
            if choice.get("token_ids") and first_token_at is None:
                first_token_at = time.perf_counter()
            token_ids += choice.get("token_ids") or []
            prompt_token_ids += choice.get("prompt_token_ids") or []
            texts.append(choice.get("text") or "")
            finish_reason = choice.get("finish_reason") or finish_reason
    end = time.perf_counter()
    if first_token_at is None:
        raise VLLMRequestError(f"the stream from {base_url} carried no token")
    return Completion(token_ids, "".join(texts), prompt_token_ids, first_token_at - start, end - start,
                      kv_transfer_params, finish_reason)  # fmt: skip


def _prefill_leg_body(body: dict[str, Any], **params: Any) -> dict[str, Any]:
    """`body` as the prefill leg: one token, not streamed, kv_transfer_params asking it to keep the KV."""
    prefill_body = {**body, "max_tokens": 1, "stream": False}
    prefill_body["kv_transfer_params"] = {**PREFILL_LEG_PARAMS, **params}
    prefill_body.pop("stream_options", None)
    return prefill_body


def pd_complete(
    prefill_url: str, decode_url: str, body: dict[str, Any], *, timeout_s: float = REQUEST_TIMEOUT_S
) -> PDCompletion:
    """The two-leg P/D protocol of vLLM's toy proxy, for one completion request.

    1. The prefill server gets `body` with max_tokens 1 and kv_transfer_params asking it to keep the
       prompt's KV for a remote decode (`PREFILL_LEG_PARAMS`); it answers with kv_transfer_params
       saying where that KV is.
    2. The decode server gets the original `body` with those kv_transfer_params, reads the KV from
       the prefill server and generates. Its completion (streamed if `body` says so) is the result.

    Both legs carry one X-Request-Id, as the proxy sends it: vLLM's NixlPushConnector pairs the
    decode's registration with the prefill's finished blocks by that id, and waits forever without it.
    """
    prefill_body = _prefill_leg_body(body)
    request_id = f"pd-{uuid.uuid4().hex}"
    prefill = complete(prefill_url, prefill_body, timeout_s=timeout_s, request_id=request_id)
    if not prefill.kv_transfer_params:
        raise VLLMRequestError(
            f"the prefill server {prefill_url} returned no kv_transfer_params; start it with a KV connector "
            "in role kv_producer or kv_both"
        )
    decode = complete(
        decode_url, {**body, "kv_transfer_params": prefill.kv_transfer_params}, timeout_s=timeout_s, request_id=request_id
    )
    return PDCompletion(decode, prefill, prefill.kv_transfer_params)


# What a push-mode decode leg needs of the prefill engine before it answers: where to register its blocks.
PUSH_COORDINATES = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size")


def push_coordinates(prefill_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's coordinates in kv_transfer_params it returned (any earlier request's): a
    push-mode proxy is configured with them, since its decode leg goes out before the prefill answers."""
    return {key: prefill_params[key] for key in PUSH_COORDINATES if key in prefill_params}


def pd_complete_at_once(
    prefill_url: str, decode_url: str, body: dict[str, Any], coordinates: dict[str, Any], *,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> PDCompletion:  # fmt: skip
    """Both legs at once, as vLLM's proxy for its NixlPushConnector sends them: the prefill leg as in
    `pd_complete`, and with it the decode leg, whose kv_transfer_params name the prefill engine
    (`coordinates`, see `push_coordinates`) and no blocks: the decode registers the blocks it allocated
    with the prefill, which writes the KV into them as it finishes. Both legs carry one X-Request-Id
    (the pairing key) and a transfer id. The user's TTFT is the decode leg's own."""
    request_id = f"pd-{uuid.uuid4().hex}"
    transfer_id = f"xfer-{uuid.uuid4().hex}"
    prefill_body = _prefill_leg_body(body, transfer_id=transfer_id)
    decode_params = {"do_remote_decode": False, "do_remote_prefill": True, "pp_size": 1, **coordinates,
                     "remote_request_id": request_id, "transfer_id": transfer_id}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prefill = pool.submit(complete, prefill_url, prefill_body, timeout_s=timeout_s, request_id=request_id)
        decode = complete(decode_url, {**body, "kv_transfer_params": decode_params}, timeout_s=timeout_s,
                          request_id=request_id)  # fmt: skip
        return PDCompletion(decode, prefill.result(), decode_params, at_once=True)


def handoff_inbox(prefill_url: str, decode_url: str, body: dict[str, Any], *, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
    """The decode's hand-off inbox (kvbridge's NixlConnector option handoff_inbox), as its answer to a P/D
    request in turn names it: a kvbridge proxy learns it so, before it sends both legs at once."""
    answer = pd_complete(prefill_url, decode_url, {**body, "stream": False}, timeout_s=timeout_s).decode
    inbox = (answer.kv_transfer_params or {}).get("handoff_inbox")
    if not inbox:
        raise VLLMRequestError(f"the decode server {decode_url} named no handoff_inbox; start it with handoff_inbox on")
    return inbox


def pd_complete_handoff(
    prefill_url: str, decode_url: str, body: dict[str, Any], inbox: dict[str, Any], *,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> PDCompletion:  # fmt: skip
    """Both legs at once through kvbridge's hand-off: under a fresh key, the prefill leg names the decode's
    `inbox` (see `handoff_inbox`), to which the prefill offers its kv_transfer_params as it finishes; the
    decode leg names the key and the same inbox, and waits for that offer. The user's TTFT is the decode leg's own."""
    key = secrets.token_hex(32)
    prefill_body = _prefill_leg_body(body, handoff={"key": key, "inbox": inbox})
    decode_params = {"do_remote_prefill": True, "handoff_key": key, "handoff_inbox": inbox}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prefill = pool.submit(complete, prefill_url, prefill_body, timeout_s=timeout_s)
        decode = complete(decode_url, {**body, "kv_transfer_params": decode_params}, timeout_s=timeout_s)
        return PDCompletion(decode, prefill.result(), decode_params, at_once=True)


def warm_up_pd(
    prefill_url: str, decode_url: str, body: dict[str, Any], *, attempts: int = 3, timeout_s: float = REQUEST_TIMEOUT_S
) -> PDCompletion:
    """One P/D request that may be retried: the first between two servers includes the NIXL handshake.

    vLLM's NixlConnector gives the prefill's side channel 5 s to answer a handshake (hard-coded in
    0.32); on a loaded machine it can miss that, and the request fails with a 500. A later request
    handshakes again. Send this before anything that is asserted or timed.
    """
    for _ in range(attempts - 1):
        with contextlib.suppress(VLLMRequestError):
            return pd_complete(prefill_url, decode_url, body, timeout_s=timeout_s)
    return pd_complete(prefill_url, decode_url, body, timeout_s=timeout_s)


def wait_for_counter(
    base_url: str, name: str, at_least: float, prefixes: Sequence[str] = ("vllm:",), timeout_s: float = 10.0
) -> dict[str, float]:
    """The server's metrics once counter `name` reaches `at_least`, or the last ones after `timeout_s`:
    vLLM's statistics reach /metrics a step after the request that changed them has answered."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(base_url, prefixes)
        if metrics.get(name, 0) >= at_least or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def scrape_metrics(base_url: str, prefixes: Sequence[str] = ("vllm:",), timeout_s: float = 10.0) -> dict[str, float]:
    """GET /metrics: each sample whose name starts with one of `prefixes`, summed over its label sets.

    Histograms appear as NAME_sum, NAME_count and NAME_bucket (the buckets summed too: use _sum and
    _count). Scrape before and after a request and subtract to get that request's share.
    """
    status, text = http_json(f"{base_url}/metrics", timeout_s=timeout_s)
    if status != 200 or not isinstance(text, str):
        raise VLLMRequestError(f"GET {base_url}/metrics answered {status}")
    return metric_totals(text, prefixes)


def metric_totals(text: str, prefixes: Sequence[str]) -> dict[str, float]:
    """The samples of Prometheus text `text` whose names start with one of `prefixes`, summed over
    their label sets (what `scrape_metrics` returns; in-process: `prometheus_client.generate_latest()`)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(tuple(prefixes)):
            continue  # comments, other metrics
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        if name.endswith("_created"):
            continue  # creation timestamps, not values
        with contextlib.suppress(ValueError):
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals

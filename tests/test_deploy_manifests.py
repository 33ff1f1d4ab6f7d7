"""docs/kubernetes/*.yaml say what they run: every `kvbridge serve` container's flags parse with kvbridge's own
parser (its KV-events config included), the router's with vllm-router's, its label selectors find the prefill
and decode pods, and every Secret key a pod reads exists. The Kubernetes schema itself is checked by
kubernetes-validate in .ci/run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvbridge.cli import build_parser
from kvbridge.serve.server import kv_events_config

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "docs" / "kubernetes").glob("*.yaml"))


def _resources() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _containers(kind: str = "Deployment") -> list[tuple[dict, dict]]:
    return [(r, c) for r in _resources() if r["kind"] == kind for c in r["spec"]["template"]["spec"]["containers"]]


def test_there_are_manifests_with_prefill_decode_and_router():
    commands = [(c["command"][0], c.get("args", [])[:2]) for _, c in _containers()]
    assert ("kvbridge", ["serve", "--role=prefill"]) in commands and ("kvbridge", ["serve", "--role=decode"]) in commands
    assert any(cmd == "vllm-router" for cmd, _ in commands)


@pytest.mark.parametrize("name", [r["metadata"]["name"] for r, c in _containers() if c["command"] == ["kvbridge"]])
def test_kvbridge_containers_pass_flags_kvbridge_serve_accepts(name):
    (container,) = [c for r, c in _containers() if r["metadata"]["name"] == name]
    args = build_parser().parse_args(container["args"])  # exits (SystemExit) on a flag serve does not have
    config = kv_events_config(args)
    if args.role == "prefill":
        assert config is not None and config.is_publishing
        ports = {p["containerPort"] for p in container["ports"]}
        assert {int(config.endpoint.rsplit(":", 1)[1]), int(config.replay_endpoint.rsplit(":", 1)[1])} <= ports
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    if args.admin_token_file:
        assert any(args.admin_token_file.startswith(path) for path in mounts.values()), args.admin_token_file


def test_the_router_parses_and_its_selectors_find_the_pods():
    from vllm_router.launch_router import parse_router_args

    ((_, router),) = [(r, c) for r, c in _containers() if c["command"] == ["vllm-router"]]
    parsed = parse_router_args(router["args"])
    labels = {r["metadata"]["name"]: r["spec"]["template"]["metadata"]["labels"] for r, c in _containers()}
    for selector, role in ((parsed.prefill_selector, "prefill"), (parsed.decode_selector, "decode")):
        matched = [name for name, pod in labels.items() if selector and all(pod.get(k) == v for k, v in selector.items())]
        assert matched == [f"kvbridge-{role}"], (selector, matched)


def test_every_secret_key_a_pod_reads_exists():
    secrets = {r["metadata"]["name"]: set(r.get("stringData", {})) | set(r.get("data", {})) for r in _resources() if r["kind"] == "Secret"}
    reads = []
    for resource, container in _containers():
        for var in container.get("env", []):
            if ref := var.get("valueFrom", {}).get("secretKeyRef"):
                reads.append((ref["name"], ref["key"]))
        for volume in resource["spec"]["template"]["spec"].get("volumes", []):
            if secret := volume.get("secret"):
                reads += [(secret["secretName"], item["key"]) for item in secret.get("items", [])]
    assert reads
    for name, key in reads:
        assert key in secrets.get(name, set()), f"a pod reads {name}/{key}, which the manifests do not define"

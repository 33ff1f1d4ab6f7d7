"""Docs that stay true: every ```bash, ```sh and ```python block of README.md and docs/*.md is run
here, or deliberately not, as the HTML comment on the line before the block says:

    <!-- docs-test: skip (why) -->    not run; the reason in parentheses is required
    <!-- docs-test: serve (what) -->  each line is a `kvbridge serve` command: started on free ports,
                                      asked one prompt twice with the prefix cache reset in between;
                                      the second answer must load its KV through the node's connector
    <!-- docs-test: client (what) --> runs as an unmarked block does, against a `kvbridge serve` node
                                      (the tiny preset) that the test starts: the docs' address
                                      127.0.0.1:8000 is replaced by the node's

An unmarked python block runs in a subprocess, an unmarked shell block under `bash -euo pipefail`,
both with this checkout's kvbridge first on PYTHONPATH, in a scratch directory, within
BLOCK_TIMEOUT_S; each must exit 0. A block that cannot run on a CPU machine in seconds (servers,
GPUs, other hosts, installs) must be marked skip, with the reason: a block with neither a marker nor
a passing run fails the test, naming its file and line. Other fences (```json, plain ```) are text.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from kvbridge.serve.launcher import ManagedProcess, cli_argv, free_ports, http_json, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("bash", "sh", "python")
BLOCK_TIMEOUT_S = 60
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>\w+)\s*(?:\((?P<reason>.*)\))?\s*-->")
FENCE = re.compile(r"^```(?P<language>\S*)\s*$")


class Block(NamedTuple):
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # the comment on the line before the fence, if it is a docs-test marker
    reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file in LANGUAGES, with the marker before each."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence["language"] in LANGUAGES:
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            kind, reason = (marker["kind"], marker["reason"]) if marker else (None, None)
            found.append(Block(path, i + 1, fence["language"], "\n".join(lines[i + 1 : end]), kind, reason))
        i = end + 1
    return found


BLOCKS = [block for path in DOCS for block in blocks_of(path)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_every_marker_is_known_and_says_why():
    for block in BLOCKS:
        if block.marker is not None:
            assert block.marker in ("skip", "serve", "client"), f"{block.name}: unknown docs-test marker {block.marker!r}"
            assert (block.reason or "").strip(), f"{block.name}: a docs-test marker needs a reason in parentheses"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker is None], ids=lambda b: b.name)
def test_block_runs(block: Block, tmp_path):
    _run_block(block, block.code, tmp_path)


DOCS_ADDRESS = "127.0.0.1:8000"  # where the docs' client examples send their requests


@pytest.fixture(scope="module")
def client_node(tmp_path_factory):
    """The `kvbridge serve --port 8000` the docs' client examples talk to, on a free port."""
    (port,) = free_ports(1)
    argv = cli_argv("serve", "--port", str(port), "--num-blocks", "64", "--num-threads", "1")
    node = ManagedProcess("docs-client-node", f"http://127.0.0.1:{port}", argv, str(tmp_path_factory.mktemp("docs")), _env())
    try:
        wait_healthy([node], timeout_s=120)
        yield node
    finally:
        node.stop()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "client"], ids=lambda b: b.name)
def test_client_block_runs_against_a_node(block: Block, client_node, tmp_path):
    assert DOCS_ADDRESS in block.code, f"{block.name}: a client block talks to {DOCS_ADDRESS}"
    _run_block(block, block.code.replace(DOCS_ADDRESS, client_node.url.removeprefix("http://")), tmp_path)


def _run_block(block: Block, code: str, tmp_path) -> None:
    argv = [sys.executable, "-c", code] if block.language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    try:
        done = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name} ran past {BLOCK_TIMEOUT_S}s: make it quick, or mark it <!-- docs-test: skip (why) -->")
    assert done.returncode == 0, (
        f"{block.name} exited with {done.returncode}; fix the docs, or mark the block "
        f"<!-- docs-test: skip (why) -->\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def _node(line: str, index: int, log_dir: str) -> ManagedProcess:
    """A `kvbridge serve` line of the docs, on free loopback ports and with a small KV cache."""
    words = shlex.split(line)
    assert words[:2] == ["kvbridge", "serve"], f"a docs-test serve block holds only `kvbridge serve` lines: {line}"
    port, side_channel_port = free_ports(2)
    ports = {"--port": str(port), "--side-channel-port": str(side_channel_port)}
    args = [ports.get(words[i - 1], word) for i, word in enumerate(words) if i >= 2]
    args += ["--num-blocks", "64", "--num-threads", "1"]
    return ManagedProcess(f"docs-node{index}", f"http://127.0.0.1:{port}", cli_argv("serve", *args), log_dir, _env())


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "serve"], ids=lambda b: b.name)
def test_served_nodes_load_kv_through_their_connector(block: Block, tmp_path):
    lines = [line for line in block.code.split("\n") if line.strip()]
    nodes = [_node(line, i, str(tmp_path)) for i, line in enumerate(lines)]
    try:
        wait_healthy(nodes, timeout_s=120)
        body = {"prompt": "A prompt long enough to fill a few KV blocks. " * 3, "max_tokens": 2, "temperature": 0}
        for node, line in zip(nodes, lines):
            first = http_json(f"{node.url}/v1/completions", body)
            assert first[0] == 200, (line, first)
            assert http_json(f"{node.url}/v1/kvbridge/reset_prefix_cache", {})[0] == 200
            status, again = http_json(f"{node.url}/v1/completions", body)
            assert status == 200 and again["choices"][0]["token_ids"] == first[1]["choices"][0]["token_ids"]
            assert again["kvbridge"]["num_external_tokens"] > 0, (line, again["kvbridge"], node.log_tail())
    finally:
        for node in nodes:
            node.stop()

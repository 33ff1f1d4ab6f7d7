"""A missing or broken dependency of a configured connector stops it at start-up with a named error
(`kvbridge/dependencies.py`), not on the first transfer that needs it. `xxhash` is hidden from a real
node's process by a package of that name earlier on its path that fails to import, as a missing or a
broken installation does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.serve.launcher import cli_argv, free_ports

WORKTREE = Path(__file__).resolve().parents[2]
FAULTS = {
    "missing": "raise ModuleNotFoundError(\"No module named 'xxhash'\", name='xxhash')\n",
    "broken": "raise ImportError('libxxhash.so.0: cannot open shared object file')\n",
}


def _env_without_xxhash(tmp_path: Path, fault: str) -> dict[str, str]:
    (tmp_path / "xxhash").mkdir()
    (tmp_path / "xxhash" / "__init__.py").write_text(FAULTS[fault])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(WORKTREE), env.get("PYTHONPATH", "")])
    return env


def test_a_node_without_xxhash_refuses_to_start_naming_it(tmp_path):
    http_port, side_port = free_ports(2)
    argv = cli_argv("serve", "--role", "prefill", "--port", str(http_port), "--side-channel-port", str(side_port),
                    "--num-blocks", "16", "--num-threads", "1")  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=_env_without_xxhash(tmp_path, "missing"))
    assert done.returncode != 0, done.stderr
    assert "connector 'NixlConnector' needs the Python module 'xxhash', which is not installed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_configuring_the_offloading_connector_without_xxhash_is_a_named_error(tmp_path, fault):
    code = (
        "from kvbridge.config import KVTransferConfig\n"
        "from kvbridge.connectors.factory import check_connector_config\n"
        "from kvbridge.errors import MissingDependencyError\n"
        "try:\n"
        "    check_connector_config(KVTransferConfig(connector='OffloadingConnector', role='kv_both'))\n"
        "except MissingDependencyError as e:\n"
        "    print('REFUSED', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_env_without_xxhash(tmp_path, fault))  # fmt: skip
    assert done.stdout.startswith("REFUSED connector 'OffloadingConnector' needs the Python module 'xxhash'"), (
        done.stdout + done.stderr
    )
    assert ("is not installed" if fault == "missing" else "libxxhash.so.0") in done.stdout

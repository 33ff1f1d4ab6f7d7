"""`kvbridge generate`: text and JSON output, named errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

from kvbridge import cli


def test_generate_json_is_greedy_and_deterministic(capsys):
    argv = ["generate", "--prompt", "Hello", "--prompt", "kvbridge", "--max-tokens", "5", "--ignore-eos", "--json"]
    assert cli.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert cli.main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert [o["prompt"] for o in first["outputs"]] == ["Hello", "kvbridge"]
    assert all(len(o["token_ids"]) == 5 and o["finish_reason"] == "length" for o in first["outputs"])
    assert [o["token_ids"] for o in first["outputs"]] == [o["token_ids"] for o in second["outputs"]]
    assert first["model_id"] == "tiny:seed=0" and first["dtype"] == "float32"


def test_generate_text_output(capsys):
    assert cli.main(["generate", "--max-tokens", "3", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "prompt: 'Hello, kvbridge'" in out and "3 tokens" in out


def test_bad_model_is_a_named_error_with_exit_code_2(capsys):
    assert cli.main(["generate", "--model", "/no/such/dir", "--prompt", "x"]) == 2
    assert "ModelNotFoundError" in capsys.readouterr().err


def test_generate_module_does_not_import_torch():
    code = (
        "import argparse, sys; from kvbridge import cli_generate; "
        "cli_generate.add_arguments(argparse.ArgumentParser()); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"

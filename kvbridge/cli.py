"""`kvbridge <command>`: each command lives in its own module, imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvbridge import __version__, env

# command -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvbridge.engine.cli_generate", "generate completions with the reference engine"),
    "serve": ("kvbridge.serve.server", "run an engine behind an OpenAI-compatible HTTP API"),
    "proxy": ("kvbridge.serve.proxy", "route requests to prefill nodes, then decode nodes"),
    "demo": ("kvbridge.serve.demo", "P/D disaggregation on one machine: prefill, decode and proxy processes"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (module_name, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module_name)
        # Parsers are built eagerly so `--help` works; the heavy imports happen in run().
        importlib.import_module(module_name).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=env.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

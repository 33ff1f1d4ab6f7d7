"""`kvbridge <command>`: each command lives in its own module, imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvbridge import __version__, env
from kvbridge.cli_errors import FlagNamesFilter
from kvbridge.errors import ConfigError

# command -> (module with add_arguments(parser) and run(args) -> int, one-line help, default log level).
# Servers log at INFO (start-up progress, one line per request); one-shot commands only warnings.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("kvbridge.cli_generate", "generate completions with the reference engine", "WARNING"),
    "serve": ("kvbridge.serve.server", "run an engine behind an OpenAI-compatible HTTP API", "INFO"),
    "proxy": ("kvbridge.serve.proxy", "route requests to prefill nodes, then decode nodes", "INFO"),
    "demo": ("kvbridge.serve.demo", "P/D disaggregation on one machine: prefill, decode and proxy processes", "WARNING"),
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

DESCRIPTION = """\
kvbridge moves an LLM's KV cache between inference engines: prefill/decode (P/D) disaggregation
over NIXL, KV offload, and a reference engine served over an OpenAI-compatible HTTP API."""

EPILOG = """\
examples:
  kvbridge generate --prompt "Hello"                                  # one engine, in this process
  kvbridge serve --no-connector --port 8000                           # a plain OpenAI-compatible node
  kvbridge serve --role prefill --port 8100 --side-channel-port 5600   # decode nodes pull from 5600
  kvbridge serve --role decode  --port 8200                           # no side channel of its own
  kvbridge proxy --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
  kvbridge demo                                                       # all of the above on loopback, checked

`kvbridge COMMAND --help` lists a command's options and their defaults."""

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to an option's help, unless the help already says what the default
    is: a default of None or False means "not set", which only the help text can explain."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS  # not `in`: 0 == False
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (module_name, help_text, log_level) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        cmd.set_defaults(_module=module_name)
        # Parsers are built eagerly so `--help` works; the heavy imports happen in run().
        importlib.import_module(module_name).add_arguments(cmd)
        cmd.add_argument(
            "--log-level", type=str.upper, choices=LOG_LEVELS, default=env.log_level(log_level),
            help=f"level of kvbridge's log lines on stderr (default: $KVBRIDGE_LOG_LEVEL, else {log_level})",
        )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # a default from KVBRIDGE_LOG_LEVEL, which argparse does not check
        parser.error(f"KVBRIDGE_LOG_LEVEL={args.log_level!r}; expected one of {', '.join(LOG_LEVELS)}")
    try:
        env.validate()
    except ConfigError as exc:
        parser.error(str(exc))  # usage error: exit 2
    # Other libraries' loggers stay at WARNING; --log-level sets kvbridge's own.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # log lines name flags, as the user typed them
        handler.addFilter(FlagNamesFilter())
    logging.getLogger("kvbridge").setLevel(args.log_level)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

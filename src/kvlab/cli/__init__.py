"""The `kvlab` command: size a KV cache, generate text, replay traffic, check exercises.

    kvlab size llama-3.1-70b --batch 128 --seq-len 4096 --gpu H100-80GB
    kvlab generate --model tiny --prompt "The" --max-new-tokens 20 --cache contiguous
    kvlab report                      # the main job: every cache strategy on realistic traffic
    kvlab check 0                     # check your stage-0 exercise
    kvlab fetch smollm2-135m          # a real pretrained model (4-bit GGUF) into the user's cache
    kvlab compare-vllm --vllm-python vllm-venv/bin/python   # your engine against vLLM itself

Bad input exits with status 2 and one line on stderr naming the bad value (or file). One module
per subcommand, each with `register(commands)` and `run(args)` (shared types: `arguments`); torch
is imported in `run`, so `kvlab size` and `kvlab report` start without it (tests/test_startup.py).
"""

from __future__ import annotations

import argparse
import signal
import sys

from ..config import ConfigError
from ..fetch import FetchError
from ..sizing import SizingError
from . import compare_vllm, fetch_check, generate, report, serve, size

__all__ = ["build_parser", "main"]


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line, `kvlab <sub>: error: ...`, exit 2, not buried under the usage
    block (--help still prints it); subparsers inherit the class from `add_subparsers`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole `kvlab` argument parser: one subparser per subcommand."""
    parser = OneLineErrorParser(prog="kvlab", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (size, generate, report, serve, fetch_check, compare_vllm):
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The exit status; errors a user can cause are one line and status 2, never a traceback."""
    if argv is None and hasattr(signal, "SIGPIPE"):  # `kvlab ... | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, SizingError, ValueError, OSError, KeyError, MemoryError,
            FetchError) as error:
        # OSError: a file the user named could not be read; every reader names it in the message.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"kvlab {args.command}: error: {message}", file=sys.stderr)
        return 2

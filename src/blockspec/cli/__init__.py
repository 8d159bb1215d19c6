"""The ``blockspec`` command line: one module per command (generate, bench, align, models, env, sv), each adding
its parser and the thin function that runs it; this module builds the parser and turns errors into exit statuses.

Torch and transformers load inside the commands, so ``blockspec --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys

from ..defaults import NOTICE
from . import align, bench, env, generate, models, sv

EXIT_STATUS = """exit status:
  0    done
  2    bad input: an argument, path, device, model or profile that cannot be used (the message says which)
  1    an unexpected error, likely a bug: please report it with `blockspec env` and the `--debug` traceback
  130  interrupted (Ctrl-C)
  141  the output's reader went away (a closed pipe, as in `| head`): nothing more to print, quietly
"""

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; any error ends as one line on stderr and an exit status (see EXIT_STATUS), or, with
    --debug, as the usual traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.addLevelName(NOTICE, "NOTICE")
    logging.basicConfig(level=logging.INFO if args.verbose else NOTICE, format="%(name)s: %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("\nblockspec: interrupted", file=sys.stderr)  # starts a new line: a streamed text may be half printed
        return 130
    except Exception as error:
        if isinstance(error, BrokenPipeError) and _stdout_closed():  # `blockspec generate ... | head -c1`
            return 141  # the reader has what it wanted; another broken pipe (a socket, a subprocess) is an error
        if args.debug:
            raise
        expected = _is_user_error(error)
        message = " ".join(str(error).split())  # library and transformers messages may span lines
        if not expected or not message:
            message = f"{type(error).__name__}: {message}" if message else type(error).__name__
        print(f"blockspec: error: {message} (run with --debug for the traceback)", file=sys.stderr)
        return 2 if expected else 1


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone away (poll reports an error on it). If so, as it says so, it
    also points stdout's file descriptor at /dev/null, so that the interpreter's last flush of what is still
    buffered raises nothing more (Python's own advice for SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(event & select.POLLERR for _, event in poller.poll(0)):
            return False
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    except (AttributeError, OSError, ValueError):  # no file descriptor underneath (an embedding program, a test)
        return False
    return True


def _is_user_error(error: Exception) -> bool:
    """Errors that mean "this input cannot be used" (exit 2) rather than a bug (exit 1): bad values, missing or
    unreadable files and models (transformers reports those as OSError), missing packages, unusable presets."""
    from ..models.presets import PresetError  # stdlib only: cheap, and only on the error path

    return isinstance(error, (ValueError, OSError, ImportError, PresetError))


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors in one line (the usage of `generate` alone is a screen long), and --debug
    accepted after any subcommand too, where a user adds it after reading the error's hint."""

    def __init__(self, *args, top: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # A subcommand's --debug defaults to SUPPRESS so that it never overwrites the top-level value.
        self.add_argument(
            "--debug",
            action="store_true",
            default=False if top else argparse.SUPPRESS,
            help="on an error, show the traceback instead of a one-line message",
        )

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="blockspec",
        description="Lossless speculative decoding with token and block verification.",
        epilog=generate.EXAMPLES + "\n" + EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        top=True,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (model loading, cache)")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for command in (generate, bench, align, models, sv, env):
        command.add_parser(sub)
    return parser

"""Shared command-line plumbing for `python -m memra_dsv4 <command>`.

Contract: bad input at the CLI boundary is one line naming the problem and exit status 2, never
a usage dump or a traceback.  ``ArgParser`` turns argparse's own errors into ``UsageError``;
each command catches ``UsageError`` (plus the domain errors it expects), prints one line and
returns 2.
"""

from __future__ import annotations

import argparse

__all__ = ["UsageError", "ArgParser"]


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)

"""`python -m memra_dsv4 <command> ...`: one dispatcher, each command owned by its module.

Commands are imported lazily so that `census` or `synth` never import CuPy.  Each target is a
`main(argv: list[str]) -> int`; errors at this boundary print one line naming the problem and
exit with status 2, never a traceback for bad input.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "synth": ("memra_dsv4.synth", "main", "write a synthetic checkpoint in the official layout"),
    "census": ("memra_dsv4.census", "main", "print the tensor census of a checkpoint or preset"),
    "plan": ("memra_dsv4.placement", "main", "print the pipeline split over N devices"),
    "run": ("memra_dsv4.run", "main", "greedy continuation by re-prefill (oracle or GPU)"),
    "demo": ("memra_dsv4.demo", "main", "make a tiny checkpoint, prefill and decode it"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m memra_dsv4 <command> [args]\n\ncommands:")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:<8} {doc}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"memra_dsv4: unknown command {cmd!r}; known: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[cmd]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

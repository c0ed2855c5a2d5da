"""load_tool(name): import tools/<name>.py as a module, for the CPU tests of the command-line tools.

tools/ is a folder of scripts, not a package, so each test loads its tool by path; this is the one
place that does it (the tests used to carry their own copy of these lines).  Every call executes
the file afresh, so a test that patches module globals never leaks into the next.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    path = TOOLS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no tool {name!r}: {path} does not exist")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

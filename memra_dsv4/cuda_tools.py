"""Where the CUDA command-line tools live, for the SASS checks and the tools that read SASS
(tests/test_pdl_preload_sass.py, tools/sass_count.py); nothing here needs a GPU.

``nvdisasm()``: nvdisasm on PATH, else the one the nvidia-cuda-nvdisasm wheel of the test extra
installs (``nvidia/cu*/bin/nvdisasm`` inside the ``nvidia`` namespace package, which is not on
PATH), else None.  ``require_nvdisasm()``: the same, or an error that says where it looked.
"""

from __future__ import annotations

import glob
import os
import shutil


def nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))):
            if os.access(cand, os.X_OK):
                return cand
    return None


def require_nvdisasm() -> str:
    found = nvdisasm()
    if found is None:
        raise FileNotFoundError("nvdisasm not found: not on PATH and no nvidia-cuda-nvdisasm wheel "
                                "(nvidia/cu*/bin/nvdisasm) in this Python; `make venv` installs the "
                                "test extra, which has it")
    return found

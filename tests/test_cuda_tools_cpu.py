"""memra_dsv4.cuda_tools: nvdisasm from PATH first, else the wheel's copy inside the nvidia
namespace package, else None / an error that names where it looked."""

from __future__ import annotations

import os
import sys
import types

import pytest

from memra_dsv4 import cuda_tools


def test_path_first(monkeypatch):
    monkeypatch.setattr(cuda_tools.shutil, "which", lambda name: "/opt/cuda/bin/" + name)
    assert cuda_tools.nvdisasm() == "/opt/cuda/bin/nvdisasm"


def test_the_wheels_copy_when_not_on_path(monkeypatch, tmp_path):
    exe = tmp_path / "cu13" / "bin" / "nvdisasm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    os.chmod(exe, 0o755)
    monkeypatch.setattr(cuda_tools.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(tmp_path)]))
    assert cuda_tools.nvdisasm() == str(exe)
    assert cuda_tools.require_nvdisasm() == str(exe)


def test_none_and_a_named_error_when_absent(monkeypatch, tmp_path):
    (tmp_path / "cu13" / "bin").mkdir(parents=True)   # the wheel's folder without the tool
    monkeypatch.setattr(cuda_tools.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(tmp_path)]))
    assert cuda_tools.nvdisasm() is None
    with pytest.raises(FileNotFoundError, match="nvdisasm not found.*PATH.*nvidia-cuda-nvdisasm"):
        cuda_tools.require_nvdisasm()

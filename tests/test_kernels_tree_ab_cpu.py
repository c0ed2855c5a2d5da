"""In-process A/B of two kernel trees (no GPU): kernel_loader.use_kernels_dir routes the loaders and
the lookup memo to another tree and back, and bench.decode_step's ``kernels=tree|base`` arm
setting validates its --base-kernels DIR before any GPU work."""

from __future__ import annotations

import os
import shutil

import pytest

from memra_dsv4.gpu import kernel_loader as KL


@pytest.fixture
def fresh_loaders(monkeypatch):
    """Empty loader / memo tables for the test (no CuPy work: loaders build modules lazily)."""
    monkeypatch.setattr(KL, "_LOADERS", {})
    monkeypatch.setattr(KL, "_LOOKUP", {})
    monkeypatch.setattr(KL, "_OTHER_DIR", None)
    yield
    KL.use_kernels_dir(None)


def test_use_kernels_dir_routes_and_returns(fresh_loaders, tmp_path):
    base = tmp_path / "kernels_cu"
    base.mkdir()
    own = KL.get_loader(0)
    assert os.path.abspath(own.kernels_dir) == os.path.abspath(KL.KERNELS_DIR)
    KL.use_kernels_dir(str(base))
    other = KL.get_loader(0)
    assert other is not own and other.kernels_dir == str(base)
    assert KL.get_loader(0) is other                       # one loader per (device, tree)
    KL.use_kernels_dir(None)
    assert KL.get_loader(0) is own
    KL.use_kernels_dir(KL.KERNELS_DIR)                     # the checkout's own tree: no reroute
    assert KL.get_loader(0) is own and KL._OTHER_DIR is None


def test_lookup_memo_keys_on_the_tree(fresh_loaders, tmp_path, monkeypatch):
    """A lookup made under one tree is never served to the other (the graphs an arm captures
    must hold its own tree's kernels)."""
    base = tmp_path / "k"
    base.mkdir()
    monkeypatch.setattr(KL.KernelLoader, "get", lambda self, stem, name: (self.kernels_dir, name))
    monkeypatch.setattr(KL, "_GET", KL.KernelLoader.get)   # the memo stays on
    assert KL.lookup(0, "rmsnorm", "x")[0] == os.path.abspath(KL.KERNELS_DIR)
    KL.use_kernels_dir(str(base))
    assert KL.lookup(0, "rmsnorm", "x")[0] == str(base)
    KL.use_kernels_dir(None)
    assert KL.lookup(0, "rmsnorm", "x")[0] == os.path.abspath(KL.KERNELS_DIR)


def test_use_kernels_dir_refuses_a_missing_tree(fresh_loaders, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        KL.use_kernels_dir(str(tmp_path / "nope"))
    assert KL._OTHER_DIR is None                           # nothing half-changed


def test_bench_kernels_arm_validation(tmp_path):
    from bench import decode_step as B
    arms = B.check_arms("path=device+kernels=base,path=device+kernels=tree")
    assert [a["kernels"] for a in arms] == ["base", "tree"]
    with pytest.raises(SystemExit, match="kernels"):
        B.check_arms("path=device+kernels=old")
    assert B._kernels_dir({"path": "device"}, None) is None
    assert B._kernels_dir({"kernels": "tree"}, str(tmp_path)) is None
    with pytest.raises(SystemExit, match="needs --base-kernels"):
        B._kernels_dir({"kernels": "base"}, None)
    with pytest.raises(SystemExit, match="not a directory"):
        B._kernels_dir({"kernels": "base"}, str(tmp_path / "nope"))
    from memra_dsv4.gpu.ops import router  # noqa: F401  (registers the router stem)
    assert "router" in KL.registered()
    tree = tmp_path / "tree"
    shutil.copytree(KL.KERNELS_DIR, tree)
    assert B._kernels_dir({"kernels": "base"}, str(tree)) == str(tree)
    os.remove(tree / "router.cu")
    with pytest.raises(SystemExit, match="lacks router.cu"):
        B._kernels_dir({"kernels": "base"}, str(tree))

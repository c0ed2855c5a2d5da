"""CPU parts of the GPU decode: StepWs arena plan invariants, step byte counting, the decode
path seam, the bench's arm parsing and the device step's attention form."""
import numpy as np
import pytest

from memra_dsv4.config import preset
from memra_dsv4.gpu import step
from memra_dsv4.gpu.weights import weight_plan


@pytest.mark.parametrize("name", ["tiny", "small", "flash"])
def test_step_ws_plan_invariants(name):
    cfg = preset(name)
    plans = [step.step_ws_plan(cfg, layers, e, h, 4096, i)
             for i, layers, e, h in weight_plan(cfg, 2)]
    for i, p in enumerate(plans):
        p.check()
        names = {s.name for s in p}
        assert {"tok", "pos", "streams.a", "streams.b", "attn.cand", "moe.ids"} <= names
        assert ("boundary.in" in names) == (i > 0)
        assert ("head.logits" in names) == (i == len(plans) - 1)
        assert p.slot("tok").dtype == "i32" and p.slot("pos").dtype == "i32"
        for s in p:
            assert s.offset % 256 == 0, s
    # same inputs -> same offsets (graphs captured against one arena stay valid)
    _, layers, e, h = weight_plan(cfg, 2)[0]
    a = step.step_ws_plan(cfg, layers, e, h, 4096, 0)
    b = step.step_ws_plan(cfg, layers, e, h, 4096, 0)
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize("name,msl", [("tiny", 1024), ("small", 1024), ("flash", 4096), ("flash", 65536)])
def test_step_ws_plan_serves_both_decode_attention_forms(name, msl):
    """Every layer's candidate count K (as step_device computes it: window, + the CSA selection
    width or the HCA compressed rows) fits attn.cand (build_cand's list, decode_attn "split")
    and its split-K workspace fits dev.attn_ws (either form)."""
    from memra_dsv4.gpu.ops.attention import workspace_size
    cfg = preset(name)
    W, H, hd = cfg.sliding_window, cfg.num_attention_heads, cfg.head_dim
    for i, layers, e, h in weight_plan(cfg, 2):
        p = step.step_ws_plan(cfg, layers, e, h, msl, i)
        for lid in layers:
            r = cfg.compress_ratio(lid)
            if not r:
                K = W
            elif cfg.attn_kind(lid) == "csa":
                K = W + p.slot("idx.sel").shape[0]
            else:
                K = W + max(1, msl // r)
            assert p.slot("attn.cand").shape[0] >= K, (name, lid, K)
            need = workspace_size(1, H, hd, K)
            assert int(np.prod(p.slot("dev.attn_ws").shape)) >= need, (name, lid, K, need)


def test_step_ws_plan_sized_by_kinds_not_layer_count():
    cfg = preset("flash")
    p1 = step.step_ws_plan(cfg, range(2, 6), False, False, 4096, 1)
    p2 = step.step_ws_plan(cfg, range(2, 40), False, False, 4096, 1)
    assert p1.fingerprint() == p2.fingerprint()


def test_flash_native_bytes_match_the_anchor():
    cfg = preset("flash")
    L = [(range(cfg.num_hidden_layers), True, True)]
    nat = step.total_step_bytes(cfg, 1024, L, dense="fp8")
    own = step.total_step_bytes(cfg, 1024, L, dense="bf16")
    # dsv4_perf_anchors.md section 0: ~11.2 GB per token, native FP8 dense + FP4 experts + bf16 head
    assert 11.0e9 < nat < 11.5e9, nat
    assert own > nat + 5e9          # bf16 dense doubles ~5.9 GB of FP8 bytes
    b = step.step_bytes(cfg, 1024, range(cfg.num_hidden_layers), True, True, dense="fp8")
    assert 3.3e9 < b["experts"] < 3.6e9   # 43 layers x 6 experts x 3 x 2048x4096 FP4 + scales
    assert b["head"] > 1.0e9


def test_bytes_split_over_stages_and_grow_with_context():
    cfg = preset("small")
    one = step.total_step_bytes(cfg, 100, [(range(cfg.num_hidden_layers), True, True)])
    two = step.total_step_bytes(cfg, 100, [(l, e, h) for _, l, e, h in weight_plan(cfg, 2)])
    assert one == two
    kv = [step.step_bytes(cfg, p, range(cfg.num_hidden_layers), False, False)["kv"]
          for p in (0, 10, 100, 1000)]
    assert kv == sorted(kv) and kv[0] < kv[-1]
    with pytest.raises(ValueError, match="dense"):
        step.step_bytes(cfg, 0, range(1), False, False, dense="fp16")


def test_decode_path_seam_resolution(monkeypatch, capsys):
    from memra_dsv4.gpu.decode import resolve_decode_path
    monkeypatch.delenv("MEMRA_DSV4_DECODE_PATH", raising=False)
    assert resolve_decode_path() == "legacy"
    assert "gpu decode path = legacy" in capsys.readouterr().err
    monkeypatch.setenv("MEMRA_DSV4_DECODE_PATH", "device")
    assert resolve_decode_path() == "device"
    assert resolve_decode_path("device-hostmath") == "device-hostmath"
    with pytest.raises(ValueError, match="legacy, device-hostmath, device"):
        resolve_decode_path("auto")


def test_bench_decode_step_parses():
    from bench.harness import parse_arms
    arms = parse_arms("path=legacy,path=device")
    assert [a["path"] for a in arms] == ["legacy", "device"]
    import bench.decode_step as bd
    assert callable(bd.main)


def test_device_step_attn_form_reads_the_model():
    """DeviceStep.attn_form: model.decode_attn (split when the model has none), validated."""
    from types import SimpleNamespace

    from memra_dsv4.gpu.step_device import DeviceStep
    ds = object.__new__(DeviceStep)       # no GPU: only the form's resolution
    for value, want in (("split", "split"), ("fused", "fused"), (None, "split")):
        ds.m = SimpleNamespace(decode_attn=value)
        assert ds.attn_form() == want
    ds.m = SimpleNamespace()
    assert ds.attn_form() == "split"
    ds.m = SimpleNamespace(decode_attn="3launch")
    with pytest.raises(ValueError, match=r"model.decode_attn \(env MEMRA_DSV4_DECODE_ATTN\).*split, fused"):
        ds.attn_form()

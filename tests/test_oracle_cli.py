"""`run` and `demo` commands on the oracle (no GPU here)."""

import numpy as np

from memra_dsv4 import demo, run


def test_run_greedy_on_oracle(capsys):
    assert run.main(["synth:tiny", "--prompt-ids", "1,2,3", "--max-new", "3",
                     "--device", "oracle", "--numerics", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "device=oracle numerics=bf16" in out and out.count("\nstep ") == 3
    gen = [int(t) for t in out.split("generated: ")[1].split()[0].split(",")]
    # greedy by re-prefill is the argmax of the oracle's last-position logits
    from memra_dsv4.oracle import Oracle
    o = Oracle(run.open_checkpoint("synth:tiny"), "bf16")
    ids = [1, 2, 3]
    for t in gen:
        assert t == int(np.argmax(o.prefill(ids).logits))
        ids.append(t)


def test_run_auto_says_oracle(capsys):
    assert run.main(["synth:tiny:1", "--prompt-ids", "5", "--max-new", "1"]) == 0
    out = capsys.readouterr().out
    assert "device=" in out


def test_run_bad_input(capsys):
    cases = [
        (["synth:tiny", "--prompt-ids", "1,x"], "not an integer"),
        (["synth:tiny", "--prompt-ids", "1,,2"], "comma-separated"),
        (["synth:tiny", "--prompt-ids", "600"], "outside the vocabulary"),
        (["synth:tiny", "--prompt-ids", "1", "--max-new", "-1"], "--max-new"),
        (["synth:tiny", "--prompt-ids", "1", "--numerics", "fp8"], "MEMRA_DSV4_NUMERICS"),
        (["synth:tiny", "--prompt-ids", "1", "--device", "tpu"], "MEMRA_DSV4_DEVICE"),
        (["/no/such/dir", "--prompt-ids", "1"], "checkpoint"),
        (["synth:tiny"], "--prompt-ids"),
    ]
    for argv, msg in cases:
        assert run.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and msg in err, (argv, err)


def test_demo(tmp_path, capsys):
    assert demo.main(["--dir", str(tmp_path / "ck"), "--steps", "2", "--device", "oracle"]) == 0
    out = capsys.readouterr().out
    assert "[1] wrote" in out and "[6] MTP block" in out and "generated:" in out
    assert "(same tokens as re-prefill)" in out, out
    assert "[7] speculative decoding on the oracle" in out
    assert "(same tokens as the incremental decode)" in out, out
    assert demo.main(["--steps", "-2"]) == 2


def test_greedy_incremental_equals_reprefill_on_the_oracle():
    backend = run.select_backend(run.open_checkpoint("synth:tiny"), "oracle", "bf16",
                                 log=lambda m: None)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]          # crosses tiny's window (8) and CSA emits
    a = run.greedy_reprefill(backend, prompt, 5, log=lambda m: None)
    b = run.greedy_incremental(backend, prompt, 5, log=lambda m: None)
    assert a == b


def test_run_continue_modes_agree_and_bad_value_is_refused(capsys, monkeypatch):
    gens = {}
    for mode in ("incremental", "reprefill"):
        assert run.main(["synth:tiny", "--prompt-ids", "3,1,4,1,5,9,2,6,5", "--max-new", "4",
                         "--device", "oracle", "--continue", mode]) == 0
        out = capsys.readouterr().out
        assert f"continue={mode}" in out and out.count("\nstep ") == 4
        gens[mode] = out.split("generated: ")[1].split()[0]
    assert gens["incremental"] == gens["reprefill"]
    monkeypatch.setenv("MEMRA_DSV4_CONTINUE", "sideways")
    assert run.main(["synth:tiny", "--prompt-ids", "1", "--device", "oracle"]) == 2
    assert "MEMRA_DSV4_CONTINUE" in capsys.readouterr().err

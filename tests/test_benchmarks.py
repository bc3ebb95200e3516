"""The benchmark and diagnosis scripts' CPU-checkable parts: the row time limit of the kernel
benchmark, the whole-model decoding benchmark on a tiny model, and the compile-only resource
check of the kernels for sm_90 (Triton's bundled ptxas, no GPU)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_row_time_limit_stops_a_slow_row_only():
    import bench_kernels
    with pytest.raises(bench_kernels.RowTimeout, match="row-timeout"):  # the endless row is stopped
        with bench_kernels._time_limit(0.2):
            while True:
                time.sleep(0.01)
    before = signal.getsignal(signal.SIGALRM)
    with bench_kernels._time_limit(0.1):  # a fast row is untouched, and the alarm is cleared after it
        pass
    time.sleep(0.3)  # past the 0.1 s: a timer left running would raise here
    assert signal.getsignal(signal.SIGALRM) is before
    # a limit past what the system timer holds (1e300 s overflows time_t) is no limit, not a failure of every row
    with bench_kernels._time_limit(1e300):
        time.sleep(0.01)
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_baselines_are_timed_first():
    import bench_kernels

    ops = ["falcon-1", "falcon-3", "fla-gated-delta-rule", "torch-chunk-1", "sdpa", "fla-simple-gla"]
    assert bench_kernels.timing_order(ops) == ["fla-gated-delta-rule", "sdpa", "fla-simple-gla", "falcon-1",
                                               "falcon-3", "torch-chunk-1"]
    assert set(bench_kernels.timing_order(list(bench_kernels.OPS))) == set(bench_kernels.OPS)


def test_paired_ratio_cancels_a_slow_spell_of_the_host():
    import bench_kernels
    # ours takes 2 ms and theirs 4 ms, except in rounds 2-4 where the host slows both by 3 ms
    slow = {2, 3, 4}
    calls = {"ours": 0, "theirs": 0}

    def timer(name, base):
        def t():
            i = calls[name]
            calls[name] += 1
            return base + (3.0 if i in slow else 0.0)
        return t
    found = bench_kernels.paired_ratio(timer("ours", 2.0), timer("theirs", 4.0), rounds=9)
    assert calls == {"ours": 9, "theirs": 9}  # alternated, one call each per round
    assert found["ratio"] == pytest.approx(0.5)  # 6 of 9 rounds are clean: the median is theirs
    assert found["ratio_min"] == pytest.approx(0.5) and found["ratio_max"] == pytest.approx(5.0 / 7.0)
    assert found["ms"] == pytest.approx(2.0) and found["fla_ms"] == pytest.approx(4.0) and found["rounds"] == 9
    with pytest.raises(ValueError, match="rounds"):
        bench_kernels.paired_ratio(timer("ours", 1.0), timer("theirs", 1.0), rounds=0)


def test_markdown_lists_paired_rows_apart_from_the_table():
    import bench_kernels
    versions = dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p")
    B, T, H, K, V = bench_kernels.SHAPES[0]
    row = dict(op="falcon-1", fla_op="fla-gated-delta-rule", B=B, T=T, H=H, K=K, V=V, mode="fwdbwd-paired", ms=2.0,
               fla_ms=2.5, ratio=0.8, ratio_min=0.75, ratio_max=0.9, rounds=9, target=0.8, commit="x")
    text = bench_kernels._markdown([row], versions, "x", [], [])
    assert "| falcon-1 | fla-gated-delta-rule | 8 | 2048 | 9 | 0.80 | 0.75-0.90 | 2.000 | 2.500 | <= 0.8 |" in text
    assert "| falcon-1 | 8 |" not in text  # not a timing row of the main table


def test_markdown_adds_graph_times_and_their_ratio_when_rows_have_them():
    import bench_kernels
    versions = dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p")
    B, T, H, K, V = bench_kernels.SHAPES[0]
    base = dict(B=B, T=T, H=H, K=K, V=V, mode="fwdbwd", peak_mem_bytes=2**20, commit="x")
    rows = [dict(op="falcon-2", ms=5.0, graph_ms=4.5, **base), dict(op="fla-gated-delta-rule", ms=2.5, graph_ms=1.5, **base),
            dict(op="falcon-1", ms=2.0, graph_error="RuntimeError: capture", **base)]
    text = bench_kernels._markdown(rows, versions, "x", [], [])
    assert "| op | B | T | H | K | V | mode | ms | graph ms | peak MiB |" in text
    assert "| falcon-2 | 8 | 2048 | 16 | 128 | 128 | fwdbwd | 5.000 | 4.500 | 1 |" in text
    assert "| falcon-1 | 8 | 2048 | 16 | 128 | 128 | fwdbwd | 2.000 | not captured | 1 |" in text
    # eager ratio 5.0 / 2.5, graph ratio 4.5 / 1.5; falcon-1 has a counterpart row missing: no ratio line
    assert "| falcon-2 | fla-gated-delta-rule | 8 | 2048 | 16 | 128 | 128 | 2.00 | 3.00 | <= 1.5 | 1.00 |" in text
    # rows without graph times keep the plain layout
    plain = bench_kernels._markdown([dict(op="falcon-2", ms=5.0, **base)], versions, "x", [], [])
    assert "graph" not in plain


def test_markdown_ratios_of_a_shape_of_ones_own_carry_no_target():
    import bench_kernels
    versions = dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p")
    base = dict(mode="fwdbwd", commit="x")
    wide = dict(B=4, T=2048, H=16, K=256, V=256, **base)
    rows = [dict(op="falcon-1", ms=3.0, peak_mem_bytes=3 * 2**20, **wide),
            dict(op="fla-gated-delta-rule", ms=2.0, peak_mem_bytes=2 * 2**20, **wide),
            dict(op="falcon-1", ms=9.0, peak_mem_bytes=2**20, B=8, T=2048, H=16, K=128, V=128, **base)]
    text = bench_kernels._markdown(rows, versions, "x", [], [])
    # the K = 256 pair has its ratio, without the benchmark shape's target; the lone K = 128 row has none
    assert "| falcon-1 | fla-gated-delta-rule | 4 | 2048 | 16 | 256 | 256 | 1.50 | - | 1.50 |" in text
    assert "| falcon-1 | fla-gated-delta-rule | 8 |" not in text


def test_paired_drift_flags_a_slow_spell_on_one_side_only():
    import bench_kernels
    B, T, H, K, V = bench_kernels.SHAPES[0]

    def row(op, ms, mode="fwdbwd"):
        return dict(op=op, B=B, T=T, H=H, K=K, V=V, mode=mode, ms=ms, peak_mem_bytes=0)
    rows = [row("falcon-2", 12.404), row("fla-gated-delta-rule", 2.813), row("fla-gated-delta-rule", 0.45, "fwd")]
    pair = dict(op="falcon-2", fla_op="fla-gated-delta-rule", B=B, T=T, H=H, K=K, V=V, ms=12.428, fla_ms=4.436,
                ratio=2.801)
    # fla's paired median is 58 % above its own row: flagged, with the rows' ratio 12.404 / 2.813
    text = bench_kernels.paired_drift(pair, rows)
    assert "fla-gated-delta-rule 4.436 ms paired against 2.813 ms in its row (+58%)" in text
    assert "falcon-2 12.428" not in text and "not reliable (the rows' ratio: 4.41)" in text
    # both sides within 25 % of their rows (fla +12 %): nothing to flag
    assert bench_kernels.paired_drift(dict(pair, fla_ms=3.15, ratio=3.95), rows) is None
    # a side without a row of its own is not judged
    assert bench_kernels.paired_drift(dict(pair, op="falcon-3"), rows).startswith(
        "paired falcon-3 / fla-gated-delta-rule: fla-gated-delta-rule 4.436 ms")
    assert "rows' ratio" not in bench_kernels.paired_drift(dict(pair, op="falcon-3"), rows)
    # the markdown marks the flagged ratio
    paired = dict(pair, mode="fwdbwd-paired", ratio_min=2.6, ratio_max=6.0, rounds=9, target=1.5,
                  unreliable=text)
    versions = dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p")
    md = bench_kernels._markdown(rows + [paired], versions, "x", [text], [])
    assert "| 9 | 2.80 (not reliable: see the notes) | 2.60-6.00 |" in md and f"- {text}" in md


def _refused_naming(exit_, capsys, option):
    """argparse's one-line refusal (status 2) whose message names the option given a bad value: an option the
    parser does not know (``unrecognized arguments``) or an error about another one does not pass."""
    err = capsys.readouterr().err
    message = err.rpartition("error: ")[2]
    assert exit_.value.code == 2 and "Traceback" not in err, (option, err)
    assert option in message and "unrecognized arguments" not in message, (option, err)


def test_decode_benchmark_tiny_model(tmp_path, capsys, monkeypatch):
    import bench_decode

    import falcon_fwa.ops.triton as kernels
    from falcon_fwa.models import get_preset
    # the fused step on the GPU where there is one; on the CPU through Triton's interpreter (conftest sets
    # TRITON_INTERPRET there, and only there)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # each row's decoding steps on the fused step kernel: all of the triton rows', none of the torch rows'
    kernel_steps, per_row = [], {}
    real_step, real_measure = kernels.falcon_step_triton, bench_decode._measure
    monkeypatch.setattr(kernels, "falcon_step_triton", lambda *a, **kw: kernel_steps.append(1) or real_step(*a, **kw))

    def measure(model, prompt, args, preset, impl):
        before = len(kernel_steps)
        out = real_measure(model, prompt, args, preset, impl)
        per_row[(impl, prompt.shape[0])] = len(kernel_steps) - before
        return out

    monkeypatch.setattr(bench_decode, "_measure", measure)
    assert bench_decode.main(["--presets", "tiny-falcon", "tiny-transformer", "--batch", "1", "3", "--prompt", "5",
                              "--new-tokens", "4", "--repeats", "1", "--device", device,
                              "--dtype", "float32", "--out", str(tmp_path), "--name", "d"]) == 0
    rows = json.loads((tmp_path / "d.json").read_text())
    assert [(r["preset"], r["impl"], r["batch"]) for r in rows] == [
        ("tiny-falcon", "triton", 1), ("tiny-falcon", "torch", 1), ("tiny-falcon", "triton", 3),
        ("tiny-falcon", "torch", 3), ("tiny-transformer", "-", 1), ("tiny-transformer", "-", 3)]
    assert all(r["tokens_per_s"] > 0 and r["new_tokens"] == 4 for r in rows)
    layers = get_preset("tiny-falcon").num_hidden_layers
    # 3 warm-up and 3 timed steps after the prompt's pass, each through every layer
    assert per_row == {("triton", 1): 6 * layers, ("torch", 1): 0, ("triton", 3): 6 * layers, ("torch", 3): 0,
                       ("-", 1): 0, ("-", 3): 0}, per_row
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    assert all(r["same_tokens"] and r["max_logit_diff"] < 1e-3 for r in torch_rows)  # fused step == PyTorch step
    assert "| tiny-falcon | torch | 3 |" in (tmp_path / "d.md").read_text()
    for bad in (["--new-tokens", "1"], ["--cuda-graphs", "--device", "cpu"], ["--device", "tpu"], ["--batch", "0"],
                ["--presets", "tiny-nope"]) + ((["--device", "cuda"],) if not torch.cuda.is_available() else ()):
        with pytest.raises(SystemExit) as exit_:
            bench_decode.main(bad)
        _refused_naming(exit_, capsys, bad[0])


def test_decode_matches_generate():
    # the benchmark's greedy loop over the cache picks the tokens of HF generate
    import bench_decode
    from falcon_fwa.models import FalconForCausalLM, get_preset
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 6))
    tokens, _, _ = bench_decode.decode(model, prompt, 5)
    ref = model.generate(prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert torch.equal(tokens, ref[:, 6:])


def test_compiled_decoding_does_not_recompile_per_token():
    # FalconCache.advance stays out of the graph: its Python token counter would otherwise be a guard that
    # fails at every step. Frames: those of the prompt's pass (broken around the op, which runs outside
    # compiled graphs), the first step (conv buffers from the prompt's pass have other strides) and the
    # steady step, all there after three new tokens; longer decoding loops add none.
    from torch._dynamo.testing import CompileCounter
    import bench_decode
    from falcon_fwa.models import FalconForCausalLM, get_preset
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", num_hidden_layers=1)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 6))
    ref, _, _ = bench_decode.decode(model, prompt, 6)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, dynamic=False)
    bench_decode.decode(compiled, prompt, 3)
    frames = counter.frame_count
    tokens, _, _ = bench_decode.decode(compiled, prompt, 6)
    assert torch.equal(tokens, ref)
    assert counter.frame_count == frames
    bench_decode.decode(compiled, prompt, 8)
    assert counter.frame_count == frames
    torch._dynamo.reset()


def test_kernel_resources_compiles_for_sm90_and_flags_the_limit(tmp_path):
    pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_resources.py"), "--rules", "1A",
                        "--dtypes", "bf16", "--dims", "16", "--limit", "1024", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr  # some kernel needs more than 1 KB
    rows = json.loads(out.read_text())
    kernels = {row["kernel"] for row in rows}
    assert {"output_fwd", "dv_bwd", "dqk_bwd"} <= kernels
    assert all(row["limit"] == 1024 and row["rule"] == "1A" and row["K"] == 16 for row in rows)
    # ptxas -v's figures for every kernel: registers within sm_90's 255 per thread, spills counted in bytes
    assert all(0 < row["regs"] <= 255 and row["spill_stores"] >= 0 and row["spill_loads"] >= 0 for row in rows)
    # blocks per SM for the launches that fit the (given) limit, none for those over it
    assert all((row["blocks_per_sm"] is None) == (row["shared"] > 1024) for row in rows)
    assert all(row["blocks_per_sm"] >= 1 for row in rows if row["blocks_per_sm"] is not None)
    over = [row for row in rows if row["shared"] > 1024]
    assert over and len(over) < len(rows)  # tiny kernels (the per-row step-size maps) stay under
    assert f"{len(over)} above the shared-memory limit" in r.stdout


def test_blocks_per_sm_by_hand():
    from kernel_resources import blocks_per_sm
    # sm_90: 65,536 registers, 233,472 bytes of shared memory, 64 warps and 32 blocks per SM
    # 246 registers round up to 248 per thread: 7,936 per warp, 63,488 for 8 warps; one block by registers
    assert blocks_per_sm(246, 114688, 8) == 1
    # at 4 warps and 255 registers (256 per thread): 32,768 per block, two; shared 2 x (114,688 + 1,024) fits
    assert blocks_per_sm(255, 114688, 4) == 2
    # registers would allow two (240 per thread, 30,720 per block); 123,392 + 1,024 bytes of shared memory one
    assert blocks_per_sm(240, 123392, 4) == 1
    # a small kernel: 32 registers and no shared memory at 4 warps; the 64 resident warps allow 16 blocks
    assert blocks_per_sm(32, 0, 4) == 16
    # sm_86: 48 resident warps, 16 blocks; 102,400 bytes of shared memory
    assert blocks_per_sm(32, 0, 2, arch=86) == 16 and blocks_per_sm(32, 50176, 2, arch=86) == 2


def test_addition_step_timer_tiny(tmp_path, capsys):
    import bench_addition_step
    assert bench_addition_step.main(["--models", "Falcon-3A.3", "Transformer", "--preset", "tiny", "--batch", "4", "8",
                                     "--steps", "2", "--warmup", "1", "--profile", "3", "--device", "cpu",
                                     "--out", str(tmp_path), "--name", "s"]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(r["model"], r["batch"]) for r in rows] == [("Falcon-3A.3", 4), ("Falcon-3A.3", 8), ("Transformer", 4),
                                                       ("Transformer", 8)]
    assert all(r["ms_per_step"] > 0 and len(r["top_kernels"]) == 3 for r in rows)
    assert all(r["matmul_precision"] == "highest" for r in rows)  # the tiny preset's setting
    before = torch.get_float32_matmul_precision()
    assert bench_addition_step.main(["--models", "Transformer", "--preset", "tiny", "--batch", "4", "--steps", "1",
                                     "--warmup", "0", "--device", "cpu", "--matmul-precision", "highest", "high",
                                     "--out", str(tmp_path), "--name", "p"]) == 0
    assert torch.get_float32_matmul_precision() == before  # the process setting is given back
    rows = json.loads((tmp_path / "p.json").read_text())
    assert [(r["batch"], r["matmul_precision"]) for r in rows] == [(4, "highest"), (4, "high")]  # side by side
    # tiny trains on widths 1-5: a sample is 3n + 4 <= 19 tokens, padded to the batch's longest
    assert all(r["batch"] * 7 <= r["tokens_per_step"] <= r["batch"] * 19 for r in rows)
    for bad in (["--batch", "0"], ["--device", "tpu"], ["--models", "Nope"], ["--preset", "nope"],
                ["--profile", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            bench_addition_step.main(bad)
        _refused_naming(exit_, capsys, bad[0])


@pytest.mark.parametrize("script", ["bench_short_prompts", "host_overhead", "bench_read_norm", "bench_wy_forward",
                                    "memory_breakdown", "sweep_launch", "check_fla_delta"])
def test_gpu_only_scripts_say_so_in_one_line_on_a_cpu_machine(script, monkeypatch, tmp_path):
    pytest.importorskip("falcon_fwa.ops.triton")  # the scripts import the kernels' modules
    import importlib
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module(script)
    argv = {"bench_wy_forward": ["--out", str(tmp_path)], "memory_breakdown": ["--ops", "falcon-3"],
            "sweep_launch": ["--op", "falcon-3", "--table", "delta.SCALAR_LAUNCH.grouped", "--kernels", "dqk_bwd"]}
    with pytest.raises(SystemExit, match=f"^{script}.py needs a CUDA GPU$"):
        module.main(argv.get(script, []))


def test_autotune_picks_reads_through_heuristics_and_skips_kernels_not_run(monkeypatch):
    import types

    import triton
    import triton.language as tl
    from bench_kernels import autotune_picks

    @triton.jit
    def kernel(x, n, BLOCK: tl.constexpr, EXTRA: tl.constexpr):
        pass

    def tuned():
        return triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])(kernel)

    ran, idle, elsewhere = tuned(), tuned(), tuned()
    ran.cache[(128,)] = ran.configs[1]  # what a run with n = 128 leaves behind
    elsewhere.cache[(64,)] = elsewhere.configs[0]
    module = types.ModuleType("fakefla.ops.chunk")
    module.wrapped = triton.heuristics({"EXTRA": lambda args: 1})(ran)
    module.idle = idle
    other = types.ModuleType("fakeflax")
    other.elsewhere = elsewhere
    monkeypatch.setitem(sys.modules, "fakefla.ops.chunk", module)
    monkeypatch.setitem(sys.modules, "fakeflax", other)
    assert autotune_picks("fakefla") == {"fakefla.ops.chunk.wrapped": {"(128,)": str(ran.configs[1])}}


def test_decode_rows_time_the_backend_they_name(monkeypatch):
    # falcon_step's default backend="auto" takes the fused Triton step on CUDA: the "torch" decode row
    # must force the PyTorch step, and neither row may pay for the argument checks in the timed calls
    import triton.testing

    import bench_kernels
    import falcon_fwa
    import falcon_fwa.ops.triton as ops_triton
    real_step = falcon_fwa.falcon_step
    seen = []

    def recording_step(*args, **kwargs):
        seen.append((kwargs.get("backend", "auto"), kwargs.get("validate", True)))
        return real_step(*args, **kwargs)

    def fake_triton_step(*args, **kwargs):  # stands in for the fused kernel on this CPU machine
        seen.append(("kernel", None))
        return real_step(*args, backend="torch", validate=False, **kwargs)

    timed = []

    def fake_do_bench(fn, warmup=25, rep=100, return_mode="mean", **kw):
        assert return_mode == "median" and not torch.is_grad_enabled()
        n = len(seen)
        fn()
        timed.extend(seen[n:])
        return 0.25

    monkeypatch.setattr(falcon_fwa, "falcon_step", recording_step)
    monkeypatch.setattr(ops_triton, "falcon_step_triton", fake_triton_step)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert bench_kernels.measure_decode("torch", "1A", 2, device="cpu") == 0.25
    assert timed == [("torch", False)]  # the PyTorch step, unchecked; no fused kernel
    seen.clear(), timed.clear()
    assert bench_kernels.measure_decode("triton", "1", 2, device="cpu") == 0.25
    assert timed == [("triton", False), ("kernel", None)]


def test_profile_only_run_keeps_the_rows_of_an_earlier_run(tmp_path, monkeypatch):
    # gpu_suite.sh's profile stage runs `--name h200 --ops --profile ...` into the OUT of the kernels stage
    import bench_kernels as bk
    monkeypatch.setattr(bk, "_versions", lambda: dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p"))
    monkeypatch.setattr(bk, "autotune_picks", lambda prefix="fla": {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bk, "measure", lambda build, shape, mode: (1.0 if mode == "fwd" else 2.0, 100))
    monkeypatch.setattr(bk, "profile", lambda name, shape, iters=5: [dict(op=name, kernel="k", calls=1, ms=1.0)])
    out = str(tmp_path)
    bk.main(["--out", out, "--name", "h200", "--shapes", "0", "--ops", "falcon-1", "fla-gated-delta-rule",
             "--commit", "x"])
    rows = json.loads((tmp_path / "h200.json").read_text())
    md = (tmp_path / "h200.md").read_text()
    assert len(rows) == 4 and "| falcon-1 | fla-gated-delta-rule | 8 | 2048 | 16 | 128 | 128 | 1.00 | <= 0.8 | 1.00 |" in md
    bk.main(["--out", out, "--name", "h200", "--shapes", "0", "--ops", "--profile", "falcon-1", "--commit", "x"])
    assert json.loads((tmp_path / "h200.json").read_text()) == rows
    assert (tmp_path / "h200.md").read_text() == md
    assert json.loads((tmp_path / "h200-profile-falcon-1.json").read_text())[0]["kernel"] == "k"


SPEC_KEYS = {"op", "B", "T", "H", "K", "V", "mode", "ms", "peak_mem_bytes"}  # what every row of <name>.json holds


def test_kernel_rows_carry_the_keys_of_the_benchmark_spec_and_the_window_of_the_sliding_rules():
    import re

    import bench_kernels as bk
    for op in bk.OPS:
        for mode in ("fwd", "fwdbwd"):
            row = json.loads(json.dumps(bk.timing_row(op, (2, 64, 3, 16, 32), mode, 1.234567, 4096, "abc")))
            assert SPEC_KEYS <= set(row) and "process" not in row
            assert (row["op"], row["B"], row["T"], row["H"], row["K"], row["V"], row["mode"]) == (
                op, 2, 64, 3, 16, 32, mode)
            assert row["ms"] == 1.2346 and row["peak_mem_bytes"] == 4096 and row["commit"] == "abc"
            sliding = re.match(r"(falcon|torch-chunk)-3", op, flags=re.I) is not None  # rules 3 and 3A
            assert ("window" in row) == sliding and row.get("window", bk.WINDOW) == bk.WINDOW, op
    assert bk.timing_row("sdpa", bk.SHAPES[0], "fwd", 1.0, 0, "abc", tag="run-1")["process"] == "run-1"
    # a decoding row (<name>-decode.json, not a row of the spec): one token of one layer; 12 layers at 0.5 ms a
    # step give B / 6 ms tokens per second; no peak was measured, and none is written
    row = bk.decode_row("triton", "1A", 64, 0.5)
    assert row["op"] == "falcon-step-triton-1a" and row["T"] == 1 and "peak_mem_bytes" not in row
    assert row["mode"] == "decode" and row["tokens_per_s_12_layers"] == round(64 / 0.006)


def test_kernel_benchmark_writes_spec_rows(tmp_path, monkeypatch):
    import bench_kernels as bk
    monkeypatch.setattr(bk, "_versions", lambda: dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p"))
    monkeypatch.setattr(bk, "autotune_picks", lambda prefix="fla": {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bk, "measure", lambda build, shape, mode: (1.5, 2**20))
    bk.main(["--out", str(tmp_path), "--name", "n", "--shape", "1", "64", "2", "16", "16", "--ops", "falcon-3a",
             "fla-simple-gla", "--commit", "x"])
    rows = json.loads((tmp_path / "n.json").read_text())
    assert [(r["op"], r["mode"]) for r in rows] == [("fla-simple-gla", "fwd"), ("fla-simple-gla", "fwdbwd"),
                                                    ("falcon-3a", "fwd"), ("falcon-3a", "fwdbwd")]
    assert all(SPEC_KEYS <= set(r) and (r["B"], r["T"], r["ms"], r["peak_mem_bytes"]) == (1, 64, 1.5, 2**20)
               for r in rows)
    assert [r.get("window") for r in rows] == [None, None, bk.WINDOW, bk.WINDOW]
    md = (tmp_path / "n.md").read_text()
    assert "| falcon-3a (window 4) | 1 | 64 | 2 | 16 | 16 | fwdbwd | 1.500 | 1 |" in md


def test_kernel_benchmark_on_a_cpu_machine_says_it_needs_cuda_in_one_line(tmp_path, monkeypatch, capsys):
    import bench_kernels as bk
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^bench_kernels.py needs a CUDA GPU$"):
        bk.main(["--out", str(tmp_path), "--ops", "falcon-1"])
    for bad in (["--shapes", "2"], ["--ops", "falcon-9"], ["--profile", "nope"], ["--row-timeout", "nan"],
                ["--row-timeout", "inf"], ["--shape", "0", "64", "2", "16", "16"], ["--paired", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            bk.main(["--out", str(tmp_path)] + bad)
        _refused_naming(exit_, capsys, bad[0])
    assert not list(tmp_path.iterdir())


def test_short_prompt_crossover_and_report():
    # the crossover is the longest length up to which the fused kernel won at every shorter measured length
    import argparse

    import bench_short_prompts as bsp
    rows = [dict(rule="3A", B=1, T=T, H=6, K=8, V=8, fused_ms=f, chunk_ms=1.0, ratio=f, rel_diff=0.0)
            for T, f in ((1, 0.2), (2, 0.5), (4, 1.2), (8, 0.9))]  # loses at 4: 8 does not count
    rows += [dict(rule="3A", B=64, T=1, H=6, K=8, V=8, fused_ms=2.0, chunk_ms=1.0, ratio=2.0, rel_diff=0.0)]
    assert bsp.crossover(rows, "3A", 1) == 2
    assert bsp.crossover(rows, "3A", 64) == 0
    assert bsp.crossover(rows, "1A", 1) == 0
    args = argparse.Namespace(heads=6, head_dim=8, window=4, batch=[1, 64], device="cpu")
    assert "| 3A | 2 | 0 |" in bsp.report(rows, args)


def test_short_prompts_lists_a_failing_shape_and_measures_the_next(monkeypatch, tmp_path):
    """An out-of-memory shape is a row with its error in both files (and ends the crossover there); the shapes
    after it are still measured, and both files are written after every row."""
    import json

    import bench_short_prompts as bsp

    import falcon_fwa
    import falcon_fwa.cli_options
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test device")
    monkeypatch.setattr(falcon_fwa.cli_options, "resolve_device", lambda d: torch.device("cpu"))
    monkeypatch.setattr(bsp, "_inputs", lambda rule, B, T, H, K, V, device: dict(
        q=torch.full((B, T, H, K), float(T)), k=None, v=None, beta=None, lam=None, log_gate=None))

    def op(q, k, v, beta, lam, *, form, **kw):
        if q.shape[1] == 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return q, None

    monkeypatch.setattr(falcon_fwa, "falcon_attention", op)
    import triton.testing
    calls = []  # fused (first) 0.5 ms, chunk 1.0 ms at every length: the crossover would be 8 without the failure
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, **kw: calls.append(fn()) or 0.5 * (1 + (len(calls) + 1) % 2))
    assert bsp.main(["--rules", "1A", "--batch", "1", "--lengths", "2", "4", "8", "--heads", "1", "--head-dim", "2",
                     "--out", str(tmp_path), "--name", "sp"]) == 0
    rows = json.loads((tmp_path / "sp.json").read_text())
    assert [r["T"] for r in rows] == [2, 4, 8]
    assert rows[1]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert "error" not in rows[0] and "error" not in rows[2] and rows[2]["ratio"] == 0.5
    md = (tmp_path / "sp.md").read_text()
    assert "| 1A | 1 | 4 | failed: OutOfMemoryError | - | - | - |" in md
    assert "| 1A | 2 |" in md  # crossover: 2, the failed length ends it
    assert "- rule 1A, B=1, T=4: OutOfMemoryError: CUDA out of memory" in md


def test_memory_breakdown_replays_the_allocator_trace_to_its_peak():
    import memory_breakdown
    trace = [dict(action="alloc", addr=1, size=100), dict(action="alloc", addr=2, size=50),
             dict(action="free_requested", addr=1, size=100), dict(action="free_completed", addr=1, size=100),
             dict(action="alloc", addr=3, size=80), dict(action="alloc", addr=4, size=200),
             dict(action="free_requested", addr=4, size=200), dict(action="alloc", addr=5, size=10)]
    peak, alive = memory_breakdown.live_at_peak(trace)
    assert peak == 50 + 80 + 200 and sorted(alive) == [2, 3, 4]
    frames = [dict(filename="/x/torch/nn/f.py", line=3, name="g"),
              dict(filename="/r/src/falcon_fwa/ops/triton/delta.py", line=94, name="wy_forward")]
    assert memory_breakdown._where(frames) == "ops/triton/delta.py:94 wy_forward"


def test_sweep_launch_resolves_tables_by_name():
    import sweep_launch
    from falcon_fwa.ops.triton import delta
    assert sweep_launch.resolve("delta.SCALAR_LAUNCH.grouped") is delta.SCALAR_LAUNCH["grouped"]
    assert sweep_launch.resolve("delta.WY_FWD_LAUNCH.16bit") is delta.WY_FWD_LAUNCH["16bit"]
    with pytest.raises(SystemExit, match="not a dict"):
        sweep_launch.resolve("delta.WY_MAX_CHUNK")


def test_sweep_launch_parses_candidates():
    import sweep_launch
    assert sweep_launch.parse_candidate("128,64,4,3") == (128, 64, 4, 3)
    for bad in ("64,64,4", "64,64,4,x", "64,64,0,2"):
        with pytest.raises(SystemExit, match="BK,BV,WARPS,STAGES"):
            sweep_launch.parse_candidate(bad)
    own = dict(BR=64, BK=128, num_warps=4)
    assert sweep_launch.setting_of(sweep_launch.parse_candidate("BR=32,num_warps=8"), own) == dict(
        BR=32, BK=128, num_warps=8)
    assert sweep_launch.setting_of((64, 32, 8, 2), own) == dict(BK=64, BV=32, num_warps=8, num_stages=2)
    with pytest.raises(SystemExit, match="not in the kernel's entry"):
        sweep_launch.setting_of(sweep_launch.parse_candidate("BV=32"), own)
    for bad in ("BR=0", "BR=x", "=4", "BR=32,"):
        with pytest.raises(SystemExit, match="KEY=N"):
            sweep_launch.parse_candidate(bad)


def test_kernel_resources_sees_the_gpu_block_sizes_of_the_element_wise_kernels(monkeypatch):
    """The window kernels take the interpreter's large blocks on CPU tensors; compiling for a GPU from
    CPU tensors (kernel_resources.py) must see the GPU's launches instead."""
    pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
    from falcon_fwa.ops.triton import launch

    x = torch.zeros(1)
    assert launch.interpreted(x)
    monkeypatch.setattr(launch, "COMPILE_FOR_GPU", True)
    assert not launch.interpreted(x)
    source = open(os.path.join(ROOT, "benchmarks", "kernel_resources.py")).read()
    assert "launch.COMPILE_FOR_GPU = True" in source


def test_forms_benchmark_on_tiny_shapes_and_a_killed_run_leaves_its_own_table(tmp_path, monkeypatch):
    import bench_forms_cpu as bf
    argv = ["--seq-lens", "8", "16", "--rules", "1A", "3A", "--heads", "1", "--head-dim", "4", "--chunk-size", "4",
            "--repeats", "1", "--out", str(tmp_path), "--name", "f"]
    assert bf.main(argv) == 0
    report = json.loads((tmp_path / "f.json").read_text())
    md = (tmp_path / "f.md").read_text()
    assert len(report["cells"]) == 2 * 2 * 3 * 2 and all(len(c["times_s"]) == 1 for c in report["cells"])
    for c in report["cells"]:  # the table shows each cell's median, in ms
        assert bf._fmt(c["median_s"], c) in md.split(f"| {c['rule']} | {c['T']} |")[1].split("\n")[0]
    speed = report["summary"]["speedup_chunk_over_recurrent"]["1A/fwdbwd/T=16"]
    cell = {(c["rule"], c["T"], c["form"], c["mode"]): c["median_s"] for c in report["cells"]}
    assert speed == cell[("1A", 16, "recurrent", "fwdbwd")] / cell[("1A", 16, "chunk", "fwdbwd")]

    calls = []
    real = bf._time_cell

    def killed_at_the_third_cell(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bf, "_time_cell", killed_at_the_third_cell)
    with pytest.raises(KeyboardInterrupt):
        bf.main(argv)
    report = json.loads((tmp_path / "f.json").read_text())
    md = (tmp_path / "f.md").read_text()
    assert len(report["cells"]) == 2  # the new run's two cells, in both files; none of the earlier run's
    rec_fwd, rec_fwdbwd = (bf._fmt(c["median_s"], c) for c in report["cells"])  # the recurrent form's cells
    assert f"| 1A | 8 | {rec_fwd} | - | - | {rec_fwdbwd} | - | - | - / - |" in md
    assert "| 3A | 16 | - | - | - | - | - | - | - / - |" in md


def test_forms_benchmark_refuses_bad_sizes_in_one_line(tmp_path, capsys):
    import bench_forms_cpu as bf
    for bad in (["--repeats", "0"], ["--seq-lens", "0"], ["--chunk-size", "0"], ["--head-dim", "0"],
                ["--threads", "-1"], ["--cell-budget", "0"], ["--time-limit", "nan"]):
        with pytest.raises(SystemExit) as exit_:
            bf.main(bad + ["--out", str(tmp_path)])
        _refused_naming(exit_, capsys, bad[0])
    assert not list(tmp_path.iterdir())


def test_diagnosis_and_resource_scripts_refuse_bad_sizes_before_any_kernel(tmp_path, monkeypatch, capsys):
    import diagnose_kernels
    import kernel_resources
    for bad in (["--warps", "4"], ["--warps", "4,x"], ["--warps", "0,4"], ["--shape", "0", "8", "1", "8", "8"],
                ["--chunk-size", "0"]):
        with pytest.raises(SystemExit) as exit_:
            diagnose_kernels.main(bad + ["--out", str(tmp_path / "d.json")])
        _refused_naming(exit_, capsys, bad[0])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (its own refusal comes first)
    for bad in (["--dims", "0"], ["--chunk-sizes", "0"], ["--window", "0"], ["--limit", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            kernel_resources.main(bad + ["--out", str(tmp_path / "r.json")])
        _refused_naming(exit_, capsys, bad[0])
    assert not list(tmp_path.iterdir())


def _fake_kernel_run(monkeypatch, timings):
    """bench_kernels.main without a GPU: ``timings[(op, mode)]`` is the ``(ms, peak)`` that ``measure``
    returns for that row, or an exception it raises."""
    import bench_kernels as bk
    monkeypatch.setattr(bk, "_versions", lambda: dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p"))
    monkeypatch.setattr(bk, "autotune_picks", lambda prefix="fla": {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = {id(build): name for name, build in bk.OPS.items()}

    def measure(build, shape, mode):
        found = timings[(names[id(build)], mode)]
        if isinstance(found, BaseException):
            raise found
        return found
    monkeypatch.setattr(bk, "measure", measure)
    return bk


def test_kernel_benchmark_reports_failing_ops_in_its_tables_and_times_the_others(tmp_path, monkeypatch):
    # fla not importable (so --allow-fla-gated cannot lift its guard), an out-of-memory row, a bare assert
    # (no message), and a CUDA context that raises on every later call, as after an illegal memory access
    def sticky():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def no_fla():
        raise ModuleNotFoundError("No module named 'fla'")
    MiB = 2**20
    bk = _fake_kernel_run(monkeypatch, {
        ("falcon-1", "fwd"): (1.0, MiB), ("falcon-1", "fwdbwd"): (2.0, 3 * MiB),
        ("fla-gated-delta-rule", "fwd"): (1.5, MiB),
        ("fla-gated-delta-rule", "fwdbwd"): torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
        ("falcon-1a", "fwd"): (0.5, MiB), ("falcon-1a", "fwdbwd"): (3.0, 2 * MiB),
        ("fla-simple-gla", "fwd"): (0.5, MiB), ("fla-simple-gla", "fwdbwd"): (4.0, 4 * MiB),
        ("falcon-2", "fwd"): AssertionError(), ("falcon-2", "fwdbwd"): (9.0, 5 * MiB)})
    monkeypatch.setattr(torch.cuda, "empty_cache", sticky)
    monkeypatch.setattr(bk, "lift_fla_gated_guard", no_fla)
    bk.main(["--out", str(tmp_path), "--name", "n", "--shapes", "0", "--allow-fla-gated", "--commit", "x", "--ops",
             "falcon-1", "fla-gated-delta-rule", "falcon-1a", "fla-simple-gla", "falcon-2"])
    rows = json.loads((tmp_path / "n.json").read_text())
    # the rows that came, each with its time; the failed ones are not rows
    assert sorted((r["op"], r["mode"], r["ms"]) for r in rows) == [
        ("falcon-1", "fwd", 1.0), ("falcon-1", "fwdbwd", 2.0), ("falcon-1a", "fwd", 0.5), ("falcon-1a", "fwdbwd", 3.0),
        ("falcon-2", "fwdbwd", 9.0), ("fla-gated-delta-rule", "fwd", 1.5), ("fla-simple-gla", "fwd", 0.5),
        ("fla-simple-gla", "fwdbwd", 4.0)]
    md = (tmp_path / "n.md").read_text()
    shape = "| 8 | 2048 | 16 | 128 | 128 |"
    assert f"| fla-gated-delta-rule {shape} fwdbwd | failed: OutOfMemoryError | - |" in md
    assert f"| falcon-2 {shape} fwd | failed: AssertionError | - |" in md
    # the pairs whose fla side failed say so; 1A against simple_gla: 3.0 / 4.0 ms and 2 / 4 MiB
    assert f"| falcon-1 | fla-gated-delta-rule {shape} failed (fla-gated-delta-rule) | <= 0.8 | - |" in md
    assert f"| falcon-2 | fla-gated-delta-rule {shape} failed (fla-gated-delta-rule) | <= 1.5 | - |" in md
    assert f"| falcon-1a | fla-simple-gla {shape} 0.75 | <= 1.0 | 0.50 |" in md
    failures = md.split("## Failures")[1]
    assert "- --allow-fla-gated: fla not importable: ModuleNotFoundError: No module named 'fla'" in failures
    assert "- fla-gated-delta-rule (8, 2048, 16, 128, 128) fwdbwd: OutOfMemoryError: CUDA out of memory." in failures
    assert "- falcon-2 (8, 2048, 16, 128, 128) fwd: AssertionError\n" in failures
    assert "TRITON_ABOVE_3_7_1" not in md  # the guard was not lifted: no note says it was


class _Killed(BaseException):
    """The process stopped mid-run (``timeout``'s SIGTERM): nothing after it runs."""


def test_kernel_benchmark_cut_off_keeps_the_failures_and_decode_rows_found_so_far(tmp_path, monkeypatch):
    bk = _fake_kernel_run(monkeypatch, {
        ("fla-gated-delta-rule", "fwd"): (1.5, 2**20),
        ("fla-gated-delta-rule", "fwdbwd"): torch.cuda.OutOfMemoryError("CUDA out of memory"),
        ("falcon-1", "fwd"): _Killed()})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(_Killed):
        bk.main(["--out", str(tmp_path), "--name", "n", "--shapes", "0", "--commit", "x", "--ops", "falcon-1",
                 "fla-gated-delta-rule"])
    md = (tmp_path / "n.md").read_text()  # the failed row is on disk before the next row starts
    assert "| fla-gated-delta-rule | 8 | 2048 | 16 | 128 | 128 | fwdbwd | failed: OutOfMemoryError | - |" in md
    assert [r["mode"] for r in json.loads((tmp_path / "n.json").read_text())] == ["fwd"]
    # decoding rows: on disk one by one; one step of one layer in 0.5 ms gives B / (12 x 0.5 ms) tokens/s
    steps = iter([0.5, 0.25, _Killed()])

    def measure_decode(impl, rule, B):
        found = next(steps)
        if isinstance(found, BaseException):
            raise found
        return found
    monkeypatch.setattr(bk, "measure_decode", measure_decode)
    with pytest.raises(_Killed):
        bk.main(["--out", str(tmp_path), "--name", "d", "--ops", "--decode", "--commit", "x"])
    assert not (tmp_path / "d.json").exists()  # the spec's rows (fwd, fwdbwd) hold no decoding step
    rows = json.loads((tmp_path / "d-decode.json").read_text())
    assert [(r["op"], r["B"], r["tokens_per_s_12_layers"]) for r in rows] == [
        ("falcon-step-triton-1a", 1, round(1 / 0.006)), ("falcon-step-torch-1a", 1, round(1 / 0.003))]
    assert "| falcon-step-torch-1a | 1 | 250.0 | 333 |" in (tmp_path / "d.md").read_text()


def test_failure_text_names_the_type_even_without_a_message():
    from bench_kernels import failure
    assert failure(AssertionError()) == "AssertionError"
    assert failure(RuntimeError("\n  first line\nsecond")) == "RuntimeError: first line"
    assert failure(ValueError("x" * 300)) == "ValueError: " + "x" * 200


def test_decode_benchmark_reports_a_row_that_fails_without_a_message(tmp_path, monkeypatch):
    import bench_decode

    def measure(model, prompt, args, preset, impl):
        if impl == "triton":
            raise AssertionError()  # a bare assert: no message to quote
        B = prompt.shape[0]
        return dict(preset=preset, impl=impl, batch=B, tokens_per_s=10.0 * B, ms_per_step=1.0), None, None

    monkeypatch.setattr(bench_decode, "_measure", measure)
    assert bench_decode.main(["--presets", "tiny-falcon", "--batch", "1", "2", "--device", "cpu", "--dtype", "float32",
                              "--out", str(tmp_path), "--name", "d"]) == 0
    rows = json.loads((tmp_path / "d.json").read_text())
    assert [(r["impl"], r["batch"]) for r in rows] == [("torch", 1), ("torch", 2)]
    md = (tmp_path / "d.md").read_text()
    assert "- failed: tiny-falcon triton batch 1: AssertionError\n" in md
    assert "- failed: tiny-falcon triton batch 2: AssertionError\n" in md


def test_host_overhead_reports_a_failing_op_and_times_the_next(monkeypatch, capsys):
    import contextlib
    import types

    import host_overhead as ho
    capsys.readouterr()  # what the module printed when first imported (without fla: "fla not importable: ...")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def missing(*shape):
        raise ModuleNotFoundError("No module named 'fla'")

    def oom(*shape):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    calls = []

    def cpu_op(*shape):  # stands in for a kernel op: counts its fwd+bwd calls
        x = torch.ones(3, requires_grad=True)
        return (lambda: calls.append(1) or x * 2), [x]

    @contextlib.contextmanager
    def profile(activities):  # the profiler's device time of 5 calls: 2,000 us, so 0.4 ms a call
        yield types.SimpleNamespace(key_averages=lambda: [types.SimpleNamespace(device_time_total=2000.0)])

    monkeypatch.setattr(ho, "do_bench", lambda fn, warmup, rep, return_mode: fn() or 0.5)
    monkeypatch.setattr(ho, "profile", profile)
    monkeypatch.setattr(ho, "OPS", {"a": missing, "b": oom, "c": cpu_op})
    ho.main(["--ops", "a", "b", "c", "--profile"])
    lines = capsys.readouterr().out.splitlines()[1:]  # after the commit, torch and Triton
    assert lines[0] == f"{'a':22s} failed: ModuleNotFoundError: No module named 'fla'"
    assert lines[1] == f"{'b':22s} failed: OutOfMemoryError: CUDA out of memory"
    assert lines[2].startswith(f"{'c':22s} do_bench  0.500 ms | host enqueue") and lines[2].endswith(
        "| device busy  0.400 ms")
    assert len(calls) == 1 + 3 + 1 + 10 + 5  # the upstream gradient's, warm-up, do_bench, enqueue, profiler


class _Parsed(BaseException):
    """Raised by a patched ``ArgumentParser.parse_args`` once the arguments parsed: nothing runs."""


def test_gpu_suite_stages_are_documented_and_their_commands_parse(tmp_path, monkeypatch):
    import argparse
    import re
    import shlex
    import stat

    script = os.path.join(ROOT, "benchmarks", "gpu_suite.sh")
    text = open(script).read()
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    stages = re.findall(r"^  ([a-z-]+)\)$", text[text.index('case "$STAGE" in'):], flags=re.M)
    assert len(stages) == 16
    # every stage in the usage lines, the unknown-stage message and the README's command
    assert set(re.findall(r"gpu_suite\.sh OUT_DIR ([a-z-]+)", text)) == set(stages)
    message = re.search(r'unknown stage \$STAGE: choose (.*)" >&2', text).group(1)
    assert set(re.split(r", | or ", message)) == set(stages)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert set(re.search(r"gpu_suite\.sh OUT \{([^}]*)\}", readme).group(1).split(",")) == set(stages)

    # each stage run with its Python and nvidia-smi stubbed: the stubs record the command lines
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {"python": 'line=$(printf "%q " "$@"); echo "$line" >> "$CALLS"',  # one write: stages run some at once
             "nvidia-smi": 'for _ in $(seq 1 "$FAKE_GPUS"); do echo "GPU: stub"; done'}
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_ / name).chmod(stat.S_IRWXU)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", PYTHON=str(bin_ / "python"),
               CALLS=str(calls), TRITON_CACHE_DIR=str(tmp_path / "cache"), BASE_SRC=str(tmp_path), AB_ROUNDS="1",
               ADDITION_RUNS=str(tmp_path / "runs"), PAIRED="3", CUDAGRAPH="1", BENCH_PROFILE="falcon-2")
    runs = [(stage, "1") for stage in stages if stage != "lm"] + [("kernels", "2")]  # lm: results/lm/run_small.sh
    for stage, gpus in runs:
        r = subprocess.run(["bash", script, str(tmp_path / "out"), stage], cwd=ROOT, capture_output=True,
                           text=True, env=dict(env, FAKE_GPUS=gpus), timeout=60)
        assert "unknown stage" not in r.stderr, (stage, r.stderr)
    lines = [shlex.split(line) for line in calls.read_text().splitlines()]
    commands = [argv for argv in lines if argv[:1] != ["-c"]]  # less the version line of every stage
    assert len(commands) >= len(runs)

    real_parse = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(real_parse(self, args, namespace))

    from falcon_fwa import cli
    from falcon_fwa.models import get_preset
    seen = set()
    for argv in commands:
        if argv[:2] == ["-m", "pytest"]:  # the test files it names exist
            files = [a for a in argv if a.endswith(".py")]
            assert files and all(os.path.isfile(os.path.join(ROOT, f)) for f in files), argv
            continue
        if argv[0].startswith("tests/"):
            assert os.path.isfile(os.path.join(ROOT, argv[0])), argv
            continue
        if argv[:2] == ["-m", "falcon_fwa.cli"]:
            main, args, name = cli.main, argv[2:], "cli " + argv[2]
        else:
            assert argv[0].startswith("benchmarks/") and os.path.isfile(os.path.join(ROOT, argv[0])), argv
            name = os.path.basename(argv[0])[:-3]
            main, args = __import__(name).main, argv[1:]
        seen.add(name)
        if name in ("bench_kernels", "bench_short_prompts", "host_overhead"):
            # every check of the arguments, op names included, runs before the refusal without a GPU
            with monkeypatch.context() as m:
                m.setattr(torch.cuda, "is_available", lambda: False)
                with pytest.raises(SystemExit, match=f"^{name}.py needs a CUDA GPU$"):
                    main(args)
            continue
        with monkeypatch.context() as m:
            m.setattr(argparse.ArgumentParser, "parse_args", parse_only)
            with pytest.raises(_Parsed) as parsed:
                main(args)
        if name == "bench_decode":
            for preset in parsed.value.args[0].presets:
                get_preset(preset)
    assert seen == {"bench_kernels", "bench_short_prompts", "host_overhead", "bench_decode", "diagnose_kernels",
                    "check_fla_delta", "bench_addition_step", "cli addition-compare", "cli scaling"}


@pytest.mark.parametrize("script", sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks"))
                                          if f.endswith(".py")))
def test_every_benchmark_script_prints_its_help(script, monkeypatch, capsys):
    import importlib
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (kernel_resources.py refuses to compile under it)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(script).main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "usage:" in out and "options:" in out, out


def test_decode_tokens_per_second_by_hand(monkeypatch):
    # a warm-up loop, then --repeats timed loops of new_tokens - 1 steps each (the first new token comes from the
    # prompt's pass): batch 8, 61 new tokens, loops of 2, 4 and 3 s -> median 3 s for 60 steps of 8 tokens
    import argparse

    import bench_decode
    seconds = iter([9.0, 2.0, 4.0, 3.0])
    monkeypatch.setattr(bench_decode, "decode", lambda model, prompt, n, graphs: (None, None, next(seconds)))
    args = argparse.Namespace(new_tokens=61, repeats=3, prompt=5, compile="none", cuda_graphs=False)
    row, _, _ = bench_decode._measure(None, torch.zeros(8, 5, dtype=torch.long), args, "p", "torch")
    assert row["tokens_per_s"] == 8 * 60 / 3.0 and row["ms_per_step"] == 3000.0 / 60


def test_sweep_launch_examples_name_kernels_and_keys_of_their_tables():
    pytest.importorskip("falcon_fwa.ops.triton")  # the scripts import the kernels' modules
    import itertools
    import shlex

    import sweep_launch
    text = sweep_launch.__doc__.replace("\\\n", " ")
    examples = [shlex.split(line.split("#")[0])[2:] for line in text.splitlines()
                if line.strip().startswith("python benchmarks/sweep_launch.py")]
    assert len(examples) == 4
    for argv in examples:
        def values(option):
            i = argv.index(option) + 1
            return list(itertools.takewhile(lambda a: not a.startswith("--"), argv[i:]))
        table = sweep_launch.resolve(values("--table")[0])
        for kernel in values("--kernels"):
            assert kernel in table, (argv, sorted(table))
            for candidate in values("--candidates") if "--candidates" in argv else []:
                sweep_launch.setting_of(sweep_launch.parse_candidate(candidate), dict(table[kernel]))


def test_memory_breakdown_reports_a_failing_op_and_breaks_down_the_next(tmp_path, monkeypatch, capsys):
    import memory_breakdown as mb

    def no_fla():
        raise ModuleNotFoundError("No module named 'fla'")

    def breakdown(name, shape):
        if name.startswith("fla-"):
            raise ModuleNotFoundError("No module named 'fla'")
        return dict(op=name, shape=list(shape), peak_bytes=3 * 2**20, groups=[dict(where="w", bytes=3 * 2**20, blocks=2)])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(mb, "lift_fla_gated_guard", no_fla)
    monkeypatch.setattr(mb, "breakdown", breakdown)
    mb.main(["--ops", "fla-gated-delta-rule", "falcon-3", "--allow-fla-gated", "--out", str(tmp_path)])
    found = [{k: v for k, v in r.items() if k not in ("commit", "dirty")}  # (test_record_provenance_more.py)
             for r in json.loads((tmp_path / "memory_breakdown.json").read_text())]
    assert found[0] == dict(op="fla-gated-delta-rule", shape=list(mb.SHAPES[0]),
                            error="ModuleNotFoundError: No module named 'fla'")
    assert found[1]["op"] == "falcon-3" and found[1]["peak_bytes"] == 3 * 2**20
    out = capsys.readouterr().out
    assert "fla-gated-delta-rule: failed: ModuleNotFoundError" in out and "falcon-3: peak 3 MiB above the inputs" in out


def test_check_fla_delta_reference_is_the_ops_plain_rule_1():
    """The script's textbook (gated) delta rule equals the op's rule 1 with no shift, no normalization and no
    ridge (the recurrence the fla backend of the DeltaNet baselines stands for), in float64; and one step by
    hand: ``S_1 = beta k v^T``, ``o_1 = beta (q . k) v``."""
    import check_fla_delta as cfd

    from falcon_fwa import falcon_attention
    x = cfd.inputs(2, 37, 3, 8, 5, seed=1)
    for g in (None, x["g"]):
        ref = cfd.reference(x["q"], x["k"], x["v"], x["beta"], g)
        op, _ = falcon_attention(x["q"], x["k"], x["v"], x["beta"], torch.zeros_like(x["beta"]), rule="1",
                                 shift=False, normalize=False, log_gate=g, form="recurrent", backend="torch")
        torch.testing.assert_close(ref, op, rtol=0, atol=1e-12)
    q, k, v, beta = x["q"][:, :1], x["k"][:, :1], x["v"][:, :1], x["beta"][:, :1]
    by_hand = beta[..., None] * (q * k).sum(-1, keepdim=True) * v
    torch.testing.assert_close(cfd.reference(q, k, v, beta), by_hand, rtol=0, atol=1e-15)


def test_check_fla_delta_keeps_the_forward_of_a_configuration_whose_backward_faults(monkeypatch, tmp_path, capsys):
    import check_fla_delta as cfd
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    outputs = iter([
        subprocess.CompletedProcess(
            [], 1, stdout='{"forward": {"o": 0.28}}\n',
            stderr="Traceback ...\ntorch.AcceleratorError: CUDA error: an illegal memory access was encountered\n"
                   "Search for `cudaErrorIllegalAddress'\n"),
        subprocess.CompletedProcess(
            [], 0, stdout='{"forward": {"o": 0.005}}\n{"result": {"o": 0.005, "dq": 0.006}}\n', stderr=""),
    ])
    seen, real = [], subprocess.run
    monkeypatch.setattr(cfd.subprocess, "run", lambda argv, **kw: real(argv, **kw) if argv[0] == "git"
                        else seen.append(argv[3:]) or next(outputs))  # git: the record's commit
    out = str(tmp_path / "r.json")
    assert cfd.main(["--ops", "delta", "--keys", "32", "64", "--lengths", "100", "--out", out]) == 0
    assert seen == [["delta", "2", "100", "2", "32", "64", "bf16"], ["delta", "2", "100", "2", "64", "64", "bf16"]]
    rows = [{k: v for k, v in r.items() if k not in ("commit", "dirty")}  # (test_record_provenance_more.py)
            for r in json.loads((tmp_path / "r.json").read_text())]
    assert rows[0]["o"] == 0.28 and rows[0]["error"].startswith("torch.AcceleratorError: CUDA error: an illegal")
    assert rows[1] == dict(op="delta", dtype="bf16", B=2, T=100, H=2, K=64, V=64, o=0.005, dq=0.006)
    with pytest.raises(SystemExit):
        cfd.main(["--keys", "0"])
    assert "--keys must be at least 1" in capsys.readouterr().err


def test_check_fla_delta_keeps_the_forward_of_a_configuration_that_runs_out_of_time(monkeypatch, tmp_path):
    """A child killed at ``--timeout`` after its forward line (fla autotuning the backward on a fresh machine,
    say): the row keeps the forward's error beside the timeout, as for a backward that faults (the
    ``TimeoutExpired`` carries the child's output as bytes, even with ``text=True``)."""
    import check_fla_delta as cfd
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    real = subprocess.run

    def run(argv, **kw):
        if argv[0] == "git":  # the record's commit
            return real(argv, **kw)
        raise subprocess.TimeoutExpired(argv, kw["timeout"], output=b'{"forward": {"o": 0.28}}\n', stderr=b"")

    monkeypatch.setattr(cfd.subprocess, "run", run)
    out = str(tmp_path / "r.json")
    assert cfd.main(["--ops", "delta", "--keys", "32", "--lengths", "100", "--timeout", "5", "--out", out]) == 0
    rows = [{k: v for k, v in r.items() if k not in ("commit", "dirty")}  # (test_record_provenance_more.py)
            for r in json.loads((tmp_path / "r.json").read_text())]
    assert rows == [dict(op="delta", dtype="bf16", B=2, T=100, H=2, K=32, V=64, o=0.28, error="no result in 5 s")]


def _registry_rule(name):
    """The rule a Falcon op of the kernel benchmark names (``falcon-2a-unchecked`` -> ``2A``), or None."""
    import re
    m = re.fullmatch(r"(?:falcon|torch-chunk)-(1a|2a|3a|1|2|3)(?:-unchecked|-seg\d)?", name, flags=re.I)
    return m.group(1).upper() if m else None


def test_registry_holds_the_benchmark_ops_and_names_each_falcon_rule():
    import bench_kernels as bk
    assert {n for n in bk.OPS if _registry_rule(n) is None} == {
        "falcon-1a-kernels-only", "fla-simple-gla", "fla-gla", "fla-delta-rule", "fla-gated-delta-rule", "sdpa"}
    assert {f"{p}-{r}" for p in ("falcon", "torch-chunk") for r in ("1", "2", "3")} | {
        "falcon-1a", "falcon-2a", "falcon-3a", "torch-chunk-1A", "torch-chunk-2A", "torch-chunk-3A"} <= set(bk.OPS)
    # every Falcon op of a ratio is one of the registry, against one of fla's four kernels
    assert {ours for ours, _, _ in bk.TARGETS} <= set(bk.OPS)
    assert {theirs for _, theirs, _ in bk.TARGETS} == {"fla-simple-gla", "fla-gla", "fla-gated-delta-rule"}


@pytest.mark.parametrize("name", [n for n in __import__("bench_kernels").OPS if _registry_rule(n)])
def test_registry_falcon_op_computes_the_rule_its_name_says(name):
    """Each Falcon op of the kernel benchmark (the Triton kernels, the segmented op, the PyTorch chunk form)
    is the rule its name says, at ``window=WINDOW`` for the sliding rules: its output and the gradients of
    all five inputs (q, k, v, beta, lam, each a leaf) equal those of the float64 recurrent form of that
    rule on the same inputs. In float32 (the interpreter runs no bf16), over two chunks of 64: on the GPU
    where there is one, else on the CPU through the interpreter."""
    import bench_kernels as bk

    from falcon_fwa import falcon_attention
    rule = _registry_rule(name)
    B, T, H, K, V = shape = (1, 66, 1, 4, 4)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fn, leaves = bk.OPS[name](*shape, device=device, dtype=torch.float32)
    assert len(leaves) == 5 and all(t.is_leaf and t.requires_grad and t.device.type == device for t in leaves)
    assert leaves[3].shape == (B, T, H) + ((V,) if rule in ("2", "2A") else ())
    out = fn()
    do = torch.randn_like(out)
    out.backward(do)
    ref_in = [t.detach().cpu().double().requires_grad_() for t in leaves]
    ref, _ = falcon_attention(*ref_in, rule=rule, window=bk.WINDOW, form="recurrent", backend="torch")
    ref.backward(do.cpu().double())
    for got, want, what in [(out, ref, "o")] + [(t.grad, r.grad, f"d{n}") for t, r, n in
                                                zip(leaves, ref_in, ("q", "k", "v", "beta", "lam"))]:
        got, want = got.detach().cpu().double(), want.detach()
        err = float((got - want).norm() / want.norm())
        assert err < 1e-4, (what, err)


# fla 0.6.0's chunk ops, as its documentation gives them: module, function, leading parameters in order
FLA_CALLS = {"fla-simple-gla": ("fla.ops.simple_gla", "chunk_simple_gla", ("q", "k", "v", "g", "g_gamma", "scale")),
             "fla-gla": ("fla.ops.gla", "chunk_gla", ("q", "k", "v", "g", "scale")),
             "fla-delta-rule": ("fla.ops.delta_rule", "chunk_delta_rule", ("q", "k", "v", "beta", "scale")),
             "fla-gated-delta-rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                                      ("q", "k", "v", "g", "beta", "scale"))}


def test_registry_fla_ops_pass_every_leaf_to_the_argument_it_stands_for(monkeypatch):
    """Each fla row calls its kernel with q, k, v ``[B, T, H, K|V]`` in the benchmark's dtype, a log decay
    ``g <= 0`` (``[B, T, H]``; per key column ``[B, T, H, K]`` for chunk_gla), ``beta`` in ``[0, 1]`` and, for
    the delta rules, unit keys; the tensors of the call are exactly the leaves whose gradients are timed.
    fla stands in as modules that record the call (its kernels run on CUDA only)."""
    import inspect
    import types

    import bench_kernels as bk
    calls = []
    for name, (module, function, params) in FLA_CALLS.items():
        signature = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
                                       for p in params])

        def op(*args, _sig=signature, _name=name, **kwargs):
            bound = _sig.bind(*args, **kwargs).arguments
            calls.append((_name, bound))
            return bound["v"] * 1.0, None
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{function: op}))
    B, T, H, K, V = 2, 16, 3, 8, 4
    for name in FLA_CALLS:
        fn, leaves = bk.OPS[name](B, T, H, K, V, device="cpu")
        fn()
        got, args = calls.pop()
        assert got == name and not calls
        assert [id(t) for t in args.values() if torch.is_tensor(t)] == [id(t) for t in leaves]  # no other input
        assert all(t.is_leaf and t.requires_grad for t in leaves) and "scale" not in args
        assert [tuple(args[n].shape) for n in "qkv"] == [(B, T, H, K), (B, T, H, K), (B, T, H, V)]
        assert all(args[n].dtype == torch.bfloat16 for n in "qkv")
        if "g" in args:
            assert args["g"].shape == ((B, T, H, K) if name == "fla-gla" else (B, T, H)) and (args["g"] <= 0).all()
        if "beta" in args:
            assert args["beta"].shape == (B, T, H) and ((args["beta"] >= 0) & (args["beta"] <= 1)).all()
            norms = args["k"].float().norm(dim=-1)
            assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    # the ratios: each Falcon rule against the fla kernel of the same recurrence shape
    assert {(ours, theirs) for ours, theirs, _ in bk.TARGETS if ours.count("-") == 1} == {
        ("falcon-1a", "fla-simple-gla"), ("falcon-3a", "fla-simple-gla"), ("falcon-2a", "fla-gla"),
        ("falcon-1", "fla-gated-delta-rule"), ("falcon-2", "fla-gated-delta-rule"),
        ("falcon-3", "fla-gated-delta-rule")}


def test_registry_sdpa_is_causal_softmax_attention():
    import bench_kernels as bk
    B, T, H, K = 2, 5, 3, 4
    fn, (q, k, v) = bk.OPS["sdpa"](B, T, H, K, K, device="cpu", dtype=torch.float64)
    assert q.shape == (B, H, T, K)  # torch's layout: heads before time
    scores = (q @ k.transpose(-1, -2)) / K ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(fn(), scores.softmax(-1) @ v)


def test_paired_drift_compares_with_the_rows_of_the_paired_shape_only():
    # two shapes of one B and T (K = 128 and K = 256, --shape twice): the pair at K = 128 is judged against the
    # K = 128 rows (within 25 %), not the K = 256 ones that came after them (2.5x and 2x slower)
    import bench_kernels as bk

    def row(op, ms, K):
        return dict(op=op, B=8, T=2048, H=16, K=K, V=K, mode="fwdbwd", ms=ms, peak_mem_bytes=0)
    rows = [row("falcon-1", 1.3, 128), row("fla-gated-delta-rule", 1.7, 128),
            row("falcon-1", 3.3, 256), row("fla-gated-delta-rule", 3.4, 256)]
    pair = dict(op="falcon-1", fla_op="fla-gated-delta-rule", B=8, T=2048, H=16, K=128, V=128, ms=1.35, fla_ms=1.75,
                ratio=0.77)
    assert bk.paired_drift(pair, rows) is None
    text = bk.paired_drift(dict(pair, K=256, V=256), rows)  # the same medians against the K = 256 rows
    assert "falcon-1 1.350 ms paired against 3.300 ms in its row (-59%)" in text and "rows' ratio: 0.97" in text


def test_kernel_benchmark_keeps_decoding_rows_apart_from_the_spec_rows(tmp_path, monkeypatch):
    # <name>.json holds the timing rows alone (mode fwd or fwdbwd, a measured peak); the decoding steps of
    # --decode go to <name>-decode.json, and both are in the report
    bk = _fake_kernel_run(monkeypatch, {("falcon-1", "fwd"): (1.0, 2**20), ("falcon-1", "fwdbwd"): (2.0, 2**21)})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bk, "measure_decode", lambda impl, rule, B: 0.5 if impl == "triton" else 1.0)
    bk.main(["--out", str(tmp_path), "--name", "n", "--shapes", "0", "--commit", "x", "--ops", "falcon-1",
             "--decode"])
    rows = json.loads((tmp_path / "n.json").read_text())
    assert [(r["op"], r["mode"]) for r in rows] == [("falcon-1", "fwd"), ("falcon-1", "fwdbwd")]
    decode = json.loads((tmp_path / "n-decode.json").read_text())
    assert [(r["op"], r["B"]) for r in decode] == [(f"falcon-step-{i}-{r}", B) for r in ("1a", "1") for B in (1, 64)
                                                   for i in ("triton", "torch")]
    assert all(r["mode"] == "decode" and "peak_mem_bytes" not in r for r in decode)
    md = (tmp_path / "n.md").read_text()
    assert "| falcon-1 | 8 | 2048 | 16 | 128 | 128 | fwdbwd | 2.000 | 2 |" in md
    assert "| falcon-step-torch-1 | 64 | 1000.0 | 5,333 |" in md  # 64 tokens per 12 x 1 ms


def test_kernel_benchmark_says_which_paired_ratio_it_could_not_take(tmp_path, monkeypatch):
    # --paired times each Falcon op of --ops against its fla counterpart; one whose counterpart is not in --ops
    # is named in the report, not passed over in silence
    bk = _fake_kernel_run(monkeypatch, {(op, mode): (1.0, 2**20) for op in ("falcon-1", "falcon-1a", "fla-simple-gla")
                                        for mode in ("fwd", "fwdbwd")})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bk, "measure_paired", lambda ours, theirs, shape, rounds: dict(
        ratio=0.8, ratio_min=0.7, ratio_max=0.9, ms=0.8, fla_ms=1.0, rounds=rounds))
    bk.main(["--out", str(tmp_path), "--name", "n", "--shapes", "0", "--commit", "x", "--paired", "3", "--ops",
             "falcon-1", "falcon-1a", "fla-simple-gla"])
    paired = json.loads((tmp_path / "n-paired.json").read_text())
    assert [(r["op"], r["fla_op"]) for r in paired] == [("falcon-1a", "fla-simple-gla")]
    md = (tmp_path / "n.md").read_text()
    assert "- --paired: falcon-1 not paired: its counterpart fla-gated-delta-rule is not in --ops" in md


def test_check_fla_delta_refuses_a_timeout_it_cannot_wait_for(capsys):
    # subprocess.run takes no infinite or NaN timeout (OverflowError, ValueError after the first configuration
    # started), and one of 0 s or less gives every configuration "no result": each is refused by name first
    import check_fla_delta as cfd
    for bad in ("inf", "nan", "0", "-5"):
        with pytest.raises(SystemExit) as exit_:
            cfd.main(["--timeout", bad])
        _refused_naming(exit_, capsys, "--timeout")


def test_sweep_launch_refuses_bad_arguments_by_name_before_asking_for_a_gpu(monkeypatch, capsys):
    pytest.importorskip("falcon_fwa.ops.triton")  # the scripts import the kernels' modules
    import sweep_launch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    good = {"--op": ["falcon-3"], "--table": ["delta.SCALAR_LAUNCH.grouped"], "--kernels": ["dqk_bwd"]}
    for option, value in (("--op", ["falcon-9"]), ("--table", ["delta.NO_SUCH_TABLE"]), ("--table", ["nosuch.X"]),
                          ("--kernels", ["no_such_kernel"]), ("--calls", ["0"]), ("--candidates", ["64,64,4"]),
                          ("--shape", ["0", "64", "2", "16", "16"])):
        argv = [a for k, v in dict(good, **{option: value}).items() for a in [k, *v]]
        with pytest.raises(SystemExit) as exit_:
            sweep_launch.main(argv)
        _refused_naming(exit_, capsys, option)


def _git_repo(folder):
    subprocess.run(["git", "init", "-q", str(folder)], check=True)
    subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "0"], check=True)


def test_committed_files_are_the_existing_ones_git_tracks(tmp_path):
    """A tracked file counts; an untracked one, a missing one, and any file outside a repository do not."""
    from falcon_fwa.provenance import committed_files

    repo = tmp_path / "repo"
    _git_repo(repo)
    (repo / "results").mkdir()
    for name in ("record.md", "scratch.md"):
        (repo / "results" / name).write_text("x\n")
    subprocess.run(["git", "-C", str(repo), "add", "results/record.md"], check=True)
    outside = tmp_path / "elsewhere.md"
    outside.write_text("x\n")
    paths = [str(repo / "results" / n) for n in ("record.md", "scratch.md", "missing.md")] + [str(outside)]
    assert committed_files(paths) == [paths[0]]


@pytest.mark.parametrize("script", ["bench_forms_cpu", "bench_kernels"])
def test_a_benchmark_does_not_write_over_a_tracked_record_without_overwrite(tmp_path, script, capsys):
    """Run with --out a folder whose NAME.md git tracks: refused before any work, naming --out, --name and
    --overwrite, and the record is unchanged (an untracked file is not refused: committed_files above)."""
    import importlib

    module = importlib.import_module(script)
    repo = tmp_path / "repo"
    _git_repo(repo)
    record = repo / "rec.md"
    record.write_text("the record of earlier runs\n")
    subprocess.run(["git", "-C", str(repo), "add", "rec.md"], check=True)
    with pytest.raises(SystemExit) as stop:
        module.main(["--out", str(repo), "--name", "rec"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {repo} --name rec would write over {record}" in err and "--overwrite" in err
    assert record.read_text() == "the record of earlier runs\n"

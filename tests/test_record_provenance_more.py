"""The other benchmark records name the commit of the falcon_fwa code that wrote them as the main ones do
(``test_record_provenance.py``): the addition step timer, the memory breakdown, the kernel diagnosis, the kernel
resources, the launch sweep, the host overhead report, the fla delta-rule check, the CPU forms benchmark and the
kernel benchmark's decoding rows each record the full commit of the package's checkout and ``dirty``, whether
that checkout had uncommitted changes to tracked files (``bench_kernels.source``), in every row where the record
is a list of rows. The expensive parts (models, kernels, GPU, child processes) are the tests' own."""
import copy
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from falcon_fwa import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_addition_step  # noqa: E402
import bench_forms_cpu  # noqa: E402
import bench_kernels as bk  # noqa: E402
import check_fla_delta  # noqa: E402
import diagnose_kernels  # noqa: E402
import kernel_resources  # noqa: E402
import memory_breakdown  # noqa: E402
import sweep_launch  # noqa: E402
from test_record_provenance import EDITS, _state  # noqa: E402



def _named(rows, head, dirty):
    """Every row names ``head`` in full and ``dirty`` (``True``/``False``/``None`` compared by identity)."""
    assert rows
    for r in rows:
        assert r["commit"] == head and r["dirty"] is dirty, r


@pytest.mark.parametrize("edit", EDITS)
def test_addition_step_rows_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    monkeypatch.setattr(bench_addition_step, "time_steps", lambda name, preset, batch, *a: dict(
        model=name, batch=batch, ms_per_step=1.0, tokens_per_step=7 * batch, steps=1))
    assert bench_addition_step.main(["--models", "Transformer", "--preset", "tiny", "--batch", "4", "8",
                                     "--device", "cpu", "--out", str(tmp_path), "--name", "s"]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(r["model"], r["batch"], r["ms_per_step"]) for r in rows] == [("Transformer", 4, 1.0),
                                                                          ("Transformer", 8, 1.0)]
    _named(rows, head, dirty)


@pytest.mark.parametrize("edit", EDITS)
def test_memory_breakdown_rows_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu,
                                                                    edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)

    def breakdown(name, shape):
        if name == "falcon-1":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return dict(op=name, shape=list(shape), peak_bytes=2**20, groups=[dict(where="w", bytes=2**20, blocks=1)])

    monkeypatch.setattr(memory_breakdown, "breakdown", breakdown)
    memory_breakdown.main(["--ops", "falcon-1", "falcon-3", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "memory_breakdown.json").read_text())
    assert rows[0]["error"].startswith("OutOfMemoryError") and rows[1]["peak_bytes"] == 2**20  # a failed row too
    _named(rows, head, dirty)


@pytest.mark.parametrize("edit", EDITS)
def test_kernel_diagnosis_rows_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, edit):
    import kernel_checks

    from falcon_fwa.ops.triton import delta
    for table in ("WY_FWD_LAUNCH", "WY_WARPS", "FULL_K_16BIT", "FULL_K_16BIT_GROUPED", "FULL_K_16BIT_256"):
        monkeypatch.setattr(delta, table, copy.deepcopy(getattr(delta, table)))  # its warps are set per row
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    errors = iter([dict(o=1e-6, dS=2e-6), RuntimeError("out of resource: shared memory")])

    def check_kernel(*a, **kw):
        found = next(errors)
        if isinstance(found, Exception):
            raise found
        return found

    monkeypatch.setattr(kernel_checks, "check_kernel", check_kernel)
    out = tmp_path / "d.json"
    assert diagnose_kernels.main(["--shape", "1", "8", "1", "4", "4", "--warps", "4,4", "8,8", "--out",
                                  str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["errors"] == dict(o=1e-6, dS=2e-6) and rows[1]["error"].startswith("RuntimeError")
    _named(rows, head, dirty)


@pytest.mark.parametrize("edit", EDITS)
def test_kernel_resource_rows_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, edit):
    from triton.runtime.jit import JITFunction

    from falcon_fwa.ops.triton import api, launch
    for owner, name in ((JITFunction, "run"), (api, "_interpreting"), (launch, "COMPILE_FOR_GPU")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # given back after the test: main replaces them
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)

    def compile_only(arch, limit, rows, context):  # one compiled kernel, without Triton or ptxas
        def run(self, *args, **kwargs):
            row = dict(context, kernel="k", blocks={}, num_warps=4, num_stages=2, shared=1024, limit=limit, regs=32,
                       spill_stores=0, spill_loads=0)
            if row not in rows:
                rows.append(row)
        return run

    monkeypatch.setattr(kernel_resources, "_compile_only", compile_only)
    monkeypatch.setattr(api, "falcon_chunk_triton", lambda q, k, *a, **kw: (
        JITFunction.run(None) or q, types.SimpleNamespace(S=k)))
    out = tmp_path / "r.json"
    assert kernel_resources.main(["--rules", "1A", "--dtypes", "fp32", "--dims", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["rule"], r["kernel"], r["shared"], r["blocks_per_sm"]) for r in rows] == [("1A", "k", 1024, 16)]
    _named(rows, head, dirty)


@pytest.mark.parametrize("edit", EDITS)
def test_launch_sweep_record_names_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu, edit):
    pytest.importorskip("falcon_fwa.ops.triton")  # the sweep resolves the kernels' launch tables
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep_launch, "run", lambda op, calls, shape: ([torch.ones(2)], {"dqk_bwd": 1.0}))
    sweep_launch.main(["--op", "falcon-3", "--table", "delta.SCALAR_LAUNCH.grouped", "--kernels", "dqk_bwd",
                       "--candidates", "16,16,1,1", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "sweep_falcon-3.json").read_text())
    assert record["op"] == "falcon-3" and len(record["rows"]) == 1 and record["pick"] == {}
    _named([record], head, dirty)


@pytest.mark.parametrize("edit", EDITS)
def test_host_overhead_report_names_the_full_commit_and_its_changes(checkout, monkeypatch, capsys, fake_gpu, edit):
    import triton

    import host_overhead
    capsys.readouterr()  # what the module printed when first imported (without fla: "fla not importable: ...")
    head, dirty = _state(checkout, edit)
    monkeypatch.setattr(host_overhead, "row", lambda name, profiled: print(f"{name} timed"))
    host_overhead.main(["--ops", "falcon-1a", "--profile"])
    note = " with uncommitted changes to tracked files" if dirty else ""
    assert capsys.readouterr().out.splitlines() == [
        f"commit `{head}`{note}; torch {torch.__version__}, triton {triton.__version__}", "falcon-1a timed"]


def _children(monkeypatch, stdout):
    """Every configuration's child process of ``check_fla_delta.py`` prints ``stdout``; git runs as it does."""
    real = subprocess.run
    monkeypatch.setattr(check_fla_delta.subprocess, "run", lambda argv, **kw: real(argv, **kw) if argv[0] == "git"
                        else subprocess.CompletedProcess(argv, 0, stdout=stdout, stderr=""))


@pytest.mark.parametrize("edit", EDITS)
def test_fla_delta_check_rows_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    _children(monkeypatch, '{"result": {"o": 0.005, "dq": 0.006}}\n')
    out = tmp_path / "r.json"
    assert check_fla_delta.main(["--ops", "delta", "--keys", "32", "64", "--lengths", "100", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["K"], r["o"], r["dq"]) for r in rows] == [(32, 0.005, 0.006), (64, 0.005, 0.006)]
    _named(rows, head, dirty)


@pytest.mark.parametrize("edit", EDITS)
def test_cpu_forms_record_names_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert bench_forms_cpu.main(["--seq-lens", "4", "--rules", "1", "--heads", "1", "--head-dim", "2",
                                 "--chunk-size", "2", "--repeats", "1", "--out", str(out), "--name", "f"]) == 0
    record = json.loads((out / "f.json").read_text())
    _named([record], head, dirty)
    assert record["machine"]["commit"] == head + (" with uncommitted changes to tracked files" if dirty else "")


def _decode(tmp_path, monkeypatch, *extra):
    """``bench_kernels.py --ops --decode``: the decoding rows alone, each step timed at 0.5 ms."""
    monkeypatch.setattr(bk, "_versions", lambda: dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c",
                                                      python="p"))
    monkeypatch.setattr(bk, "autotune_picks", lambda prefix="fla": {})
    monkeypatch.setattr(bk, "measure_decode", lambda impl, rule, B: 0.5)
    bk.main(["--out", str(tmp_path), "--name", "n", "--ops", "--decode", *extra])
    rows = json.loads((tmp_path / "n-decode.json").read_text())
    assert len(rows) == 8 and all(r["mode"] == "decode" for r in rows)
    return rows, (tmp_path / "n.md").read_text()


@pytest.mark.parametrize("edit", EDITS)
def test_kernel_decode_rows_name_the_full_commit_and_its_changes(tmp_path, checkout, monkeypatch, fake_gpu, edit):
    head, dirty = _state(checkout, edit)
    monkeypatch.chdir(tmp_path)
    rows, md = _decode(tmp_path / "out", monkeypatch)
    _named(rows, head, dirty)
    note = " with uncommitted changes to tracked files" if dirty else ""
    assert f"\ncommit `{head}`{note}; torch t," in md


def test_kernel_decode_rows_keep_a_given_commit_with_changes_unknown_unless_it_is_the_checkouts(
        tmp_path, checkout, monkeypatch, fake_gpu):
    head, _ = _state(checkout, "src/code.py")
    rows, _ = _decode(tmp_path / "a", monkeypatch, "--commit", "abc1234")  # as on a machine without .git
    _named(rows, "abc1234", None)
    rows, _ = _decode(tmp_path / "b", monkeypatch, "--commit", head[:7])  # the checkout's own, shortened
    _named(rows, head[:7], True)


def test_outside_a_checkout_the_rows_say_the_commit_is_unknown(tmp_path, monkeypatch, fake_gpu):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    rows, _ = _decode(tmp_path / "out", monkeypatch)
    _named(rows, "unknown", None)
    _children(monkeypatch, '{"result": {"o": 0.005}}\n')
    out = tmp_path / "r.json"
    assert check_fla_delta.main(["--ops", "delta", "--keys", "32", "--lengths", "100", "--out", str(out)]) == 0
    _named(json.loads(out.read_text()), "unknown", None)

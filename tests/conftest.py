"""Shared helpers for the op tests: random inputs, error metrics and an
independent float64 reference of the six Falcon rules.

The reference is written straight from the paper, one rule at a time and one
token at a time, with plain Python loops over batch rows and heads: Algorithm 5
(Falcon-1), the per-column rule of Section 4.2 (Falcon-2), the inner-product rules
of Section 4.3 (Falcon-1A / 2A), Algorithm 2 with its FIFO buffer (Falcon-3) and
Section 4.5 (Falcon-3A). It shares no code with ``falcon_fwa.ops``.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import signal
import subprocess

import torch as _torch

# Without CUDA the Triton kernel tests run through Triton's interpreter, which only
# takes effect if set before the first import of triton (transformers imports it).
if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from typing import Dict, Optional

import pytest
import torch

# Under pytest-xdist (``-n 2``) each worker takes its share of the cores, and so do the processes it starts.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

# A suite started with SIGINT or SIGHUP ignored (in the background of a shell without job control, under nohup)
# would pass that on to the commands it starts and runs in-process, which keep a signal ignored at launch ignored
# (as a run under nohup should): their stop tests would then see no stop. The tests get the usual dispositions.
for _signal, _handler in (("SIGINT", signal.default_int_handler), ("SIGHUP", signal.SIG_DFL)):
    if hasattr(signal, _signal) and signal.getsignal(getattr(signal, _signal)) == signal.SIG_IGN:
        signal.signal(getattr(signal, _signal), _handler)

# With a Triton too old for the kernels (torch 2.4 and 2.5 bring 3.0 and 3.1), importing ``falcon_fwa.ops.triton``
# raises an ImportError that starts with ``kernel_limits.TRITON_REFUSED``: a test or test module that imports the
# kernels is skipped with that message, as it is where Triton is missing, instead of failing.
from falcon_fwa.ops.kernel_limits import TRITON_REFUSED as KERNELS_REFUSED  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    try:
        return (yield)
    except ImportError as err:
        if str(err).startswith(KERNELS_REFUSED):
            pytest.skip(str(err))
        raise


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.failed and KERNELS_REFUSED in str(report.longrepr):
        reason = next(line for line in str(report.longrepr).splitlines() if KERNELS_REFUSED in line)
        report.outcome, report.longrepr = "skipped", (str(collector.path), None, reason.lstrip("E ").strip())
    return report


# Where the installed torch's FSDP2 cannot shard CPU processes (torch 2.4; the trainer refuses it there), the tests
# that train sharded CPU processes are skipped.
from falcon_fwa.train.distributed import fsdp2_shards_on_cpu  # noqa: E402

fsdp2_on_cpu = pytest.mark.skipif(not fsdp2_shards_on_cpu(),
                                  reason="torch 2.4's FSDP2 trains on CUDA devices only (it opens CUDA streams)")

# hf: data sources load through the datasets package (a dependency, absent where the package's src is put on the path
# instead of installed, as on the GPU machines): the tests of those sources skip without it.
needs_datasets = pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                                    reason="hf: sources load through the datasets package")

RULE_NAMES = ("1", "2", "3", "1A", "2A", "3A")
PER_COLUMN = ("2", "2A")
SLIDING = ("3", "3A")
FORMS = ("recurrent", "parallel", "chunk")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (float64)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def random_inputs(
    rule: str,
    *,
    B: int = 2,
    T: int = 37,
    H: int = 2,
    K: int = 5,
    V: int = 4,
    beta_range=(0.05, 1.95),
    lam_range=(0.0, 1.0),
    zero_key_rows: float = 0.0,
    with_gate: bool = False,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> Dict[str, torch.Tensor]:
    """Random op inputs (keys and queries of norm about 1). ``zero_key_rows`` is the
    fraction of (b, t, h) key rows set to exactly zero."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64) / math.sqrt(K)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64) / math.sqrt(K)
    if zero_key_rows > 0:
        k = k * (rand(B, T, H, 1) >= zero_key_rows)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    bshape = (B, T, H, V) if rule in PER_COLUMN else (B, T, H)
    lo, hi = beta_range
    beta = lo + (hi - lo) * rand(*bshape)
    lo, hi = lam_range
    lam = lo + (hi - lo) * rand(B, T, H)
    out = dict(q=q, k=k, v=v, beta=beta, lam=lam)
    if with_gate:
        out["log_gate"] = -0.5 * rand(B, T, H)
    return {name: t.to(dtype) for name, t in out.items()}


def reference_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    rule: str,
    window: int = 4,
    eps: float = 1e-6,
    decay_floor: float = 1e-3,
    shift: bool = True,
    normalize: bool = True,
    log_gate: Optional[torch.Tensor] = None,
    read: str = "after",
    scale_ridge: bool = False,
    initial_S: Optional[torch.Tensor] = None,
):
    """Literal float64 loop of the Falcon rules on a fresh sequence (from ``S_0 = 0``, or from
    ``initial_S`` ``[B, H, K, V]``, the ``S_init`` of Algorithms 1 and 4, still opened by the sentinel).

    Returns ``o`` ``[B, T, H, V]``, ``S_T`` ``[B, H, K, V]`` and a dict with the
    fraction of updating steps (per head and, for 2/2A, per column) on which the
    positive-decay clamp ``alpha = min(eta*lam, 1 - decay_floor)`` is active, and per step:
    ``eta``, ``gamma``, ``clamped`` (``[B, T, H]``, or ``[B, T, H, V]`` for 2/2A), the
    prediction ``S'^T x_t`` before the write (``[B, T, H, V]``) and ``valid`` ``[B, T]``.
    """
    q, k, v, beta, lam = (t.detach().double() for t in (q, k, v, beta, lam))
    gate = None if log_gate is None else log_gate.detach().double()
    Bsz, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(Bsz, T, H, V, dtype=torch.float64)
    S_final = torch.zeros(Bsz, H, K, V, dtype=torch.float64)
    n_steps, n_clamped = 0, 0
    per_step = (Bsz, T, H, V) if rule in PER_COLUMN else (Bsz, T, H)
    etas, gammas = torch.zeros(per_step, dtype=torch.float64), torch.ones(per_step, dtype=torch.float64)
    clamps = torch.zeros(per_step, dtype=torch.bool)
    preds = torch.zeros(Bsz, T, H, V, dtype=torch.float64)
    valid = torch.ones(Bsz, T, dtype=torch.bool)

    for b in range(Bsz):
        for h in range(H):
            S = torch.zeros(K, V, dtype=torch.float64) if initial_S is None else initial_S[b, h].double().clone()
            # Algorithm 2's FIFO of the last `window` pairs (x_j, y_j): after the push at
            # step t it holds exactly I_t = {j : max(2, t - window + 1) <= j <= t}
            # (from j = 1 with shift=False, where there is no sentinel).
            fifo = []
            for i in range(T):  # i = t - 1
                S_prev = S
                if gate is not None:  # S' = exp(g_t) S_{t-1}
                    S = math.exp(gate[b, i, h].item()) * S
                if shift and i == 0:
                    # boundary sentinel: x_1 = 0, eta_1 = 0, gamma_1 = 1
                    valid[b, i] = False
                else:
                    x = k[b, i - 1, h] if shift else k[b, i, h]  # write feature x_t
                    y = v[b, i, h]  # target y_t
                    lam_t = lam[b, i, h]
                    gain = beta[b, i, h]  # scalar, or [V] for the per-column rules
                    if rule in SLIDING:
                        fifo.append((x, y))
                        if len(fifo) > window:
                            fifo.pop(0)
                        Bt = len(fifo)
                        X = torch.stack([p[0] for p in fifo])  # [Bt, K], rows x_j
                        if rule == "3":
                            E = torch.linalg.eigvalsh(X @ X.T)[-1] / Bt  # mu_t^(B)
                        else:
                            E = (X * X).sum() / Bt  # Ebar_t^(B)
                    else:
                        E = x @ x  # ||x_t||^2
                    if scale_ridge:
                        lam_t = lam_t * E
                    if normalize:
                        denom = E + lam_t + eps
                        eta = gain / denom if denom > 0 else gain * 0.0
                    else:
                        eta = gain
                    alpha_raw = eta * lam_t
                    alpha = torch.clamp(alpha_raw, max=1.0 - decay_floor)
                    gamma = 1.0 - alpha
                    etas[b, i, h], gammas[b, i, h] = eta, gamma
                    clamps[b, i, h] = alpha_raw >= 1.0 - decay_floor  # the clamp holds gamma at decay_floor
                    n_steps += alpha_raw.numel()
                    n_clamped += int(clamps[b, i, h].sum())
                    preds[b, i, h] = S.T @ x
                    if rule == "1":  # Algorithm 5
                        r = y - S.T @ x
                        S = gamma * S + eta * torch.outer(x, r)
                    elif rule == "2":  # one NLMS step per value column
                        cols = []
                        for c in range(V):
                            s_c = S[:, c]
                            cols.append(gamma[c] * s_c + eta[c] * x * (y[c] - s_c @ x))
                        S = torch.stack(cols, dim=1)
                    elif rule == "1A":
                        S = gamma * S + eta * torch.outer(x, y)
                    elif rule == "2A":
                        S = torch.stack([gamma[c] * S[:, c] + eta[c] * y[c] * x for c in range(V)], dim=1)
                    elif rule == "3":  # Algorithm 2
                        U = torch.zeros(K, V, dtype=torch.float64)
                        for xj, yj in fifo:
                            U = U + torch.outer(xj, yj - S.T @ xj)
                        S = gamma * S + (eta / Bt) * U
                    elif rule == "3A":  # Eq. (4.19)
                        N = sum(torch.outer(xj, yj) for xj, yj in fifo) / Bt
                        S = gamma * S + eta * N
                    else:
                        raise ValueError(rule)
                read_state = S if read == "after" else S_prev
                o[b, i, h] = read_state.T @ q[b, i, h]
            S_final[b, h] = S
    return o, S_final, {"clamped_fraction": n_clamped / max(n_steps, 1), "eta": etas, "gamma": gammas,
                        "clamped": clamps, "prediction": preds, "valid": valid}


# ----------------------------------------------------------------------------- shared fixtures
@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models
    run faster so, and a 2-core machine is not oversubscribed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cpu_machine():
    """Run as on a machine without CUDA, on a GPU machine too, for this test and the processes it starts:
    tests of the CPU path (float64 references to float32 rounding, gloo processes, "-" for peak memory).
    Its patch is its own: a test that undoes its ``monkeypatch`` keeps running without CUDA."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


def git(repo, *args) -> str:
    """The standard output of ``git -C repo ARGS``, stripped (a failing command raises)."""
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def fake_gpu(monkeypatch):
    """The benchmark scripts' GPU checks pass on this machine (for tests of their records); their measurements
    are the tests' own."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git repository of one commit (``code.py``, ``README``, ``src/code.py``) standing in for the package's
    checkout (``provenance.source_checkout``), for tests of the commit and uncommitted changes a record names."""
    from falcon_fwa import provenance

    repo = tmp_path / "checkout"
    (repo / "src").mkdir(parents=True)
    git(repo, "init", "-q")
    for name, text in (("code.py", "x = 1\n"), ("README", "a\n"), ("src/code.py", "x = 1\n")):
        (repo / name).write_text(text)
    git(repo, "add", "code.py", "README", "src/code.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(provenance, "source_checkout", lambda: str(repo))
    return repo


def fake_git_commit(short: bool = True, cwd=None) -> str:
    """A checkout's commit for tests that keep runs of a known commit (40 hex digits, its first 7 when
    ``short``), also where the tests run outside a git checkout: patch it over a module's ``git_commit``."""
    commit = "0123abc" + "0" * 33
    return commit[:7] if short else commit


def save_tiny_falcon(folder):
    """A tiny random float32 Falcon (``initializer_range`` 0.5: varied greedy tokens) saved into ``folder`` with
    the byte tokenizer, as a training run exports one; the model, in eval mode."""
    from falcon_fwa import FalconForCausalLM, get_preset
    from falcon_fwa.data.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5)).eval()
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model


def signal_while_drawing(monkeypatch, module, sig, call: int) -> list:
    """Wrap ``module.training_batch`` so that it records the step of each batch it draws and sends ``sig`` to
    this process while drawing its ``call``-th one (counted from 1 over the test); the list of steps drawn."""
    original, drawn = module.training_batch, []

    def drawing(seed, step, *args, **kw):
        drawn.append(step)
        if len(drawn) == call:
            os.kill(os.getpid(), sig)
        return original(seed, step, *args, **kw)

    monkeypatch.setattr(module, "training_batch", drawing)
    return drawn


def tiny_lm_recipe(folder) -> str:
    """A corpus of random word paragraphs and a one-step ``train`` recipe of the ``tiny-falcon`` preset on it
    (byte tokenizer, 32-token rows, fp32), written into ``folder`` (a ``pathlib.Path``); the recipe's path.
    The run goes to ``folder / "run"`` and its exported model to ``folder / "run" / "model"``."""
    rng = random.Random(0)
    words = "the state memory key value write read gate decay token fast weight".split()
    with open(folder / "corpus.txt", "w") as f:
        for _ in range(120):
            f.write(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) + "\n\n")
    recipe = {"model": {"preset": "tiny-falcon"},
              "data": {"train_source": str(folder / "corpus.txt"), "text_split": "paragraph", "seq_len": 32,
                       "out_dir": str(folder / "data"), "val_every": 10},
              "optim": {"lr": 3e-3, "warmup_steps": 1},
              "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "dtype": "fp32",
                        "out_dir": str(folder / "run"), "eval_every": 0, "save_every": 0},
              "log": {"progress": False, "tensorboard": False}}
    with open(folder / "recipe.json", "w") as f:
        json.dump(recipe, f)
    return str(folder / "recipe.json")


def padded_and_packed_loss(model, x, mask, packed, cu_seqlens):
    """The loss of ``model`` on a padded batch plus a packed one, back-propagated from zeroed
    gradients: returns the loss and a copy of every parameter's gradient."""
    model.zero_grad()
    loss = model(x, attention_mask=mask, labels=x).loss + model(packed, cu_seqlens=cu_seqlens, labels=packed).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]

"""Addition task, end to end: what a run of ``falcon-fwa addition`` records, recomputed from the weights it saved.

The evaluation samples are rebuilt here from the documented recipe (``random.Random("{seed}/eval/{width}")``,
``a`` then ``b`` uniform over ``[0, base**width)``) and written out by hand; the model's logits on them are scored
position by position, so that neither the project's data functions nor its metrics are used to check themselves.
"""
import json
import os
import random
import signal

import pytest
import torch
from conftest import signal_while_drawing

from falcon_fwa.tasks.addition import cli, train
from falcon_fwa.tasks.addition.lineup import DigitPositions, build_model

VOCAB = "_$0123456789+="
SIZE = ["--hidden-size", "16", "--num-hidden-layers", "1", "--num-heads", "2", "--batch-size", "8", "--lr", "1e-2",
        "--device", "cpu", "--threads", "1", "--no-progress"]


def _digits(x: int, n: int, base: int) -> str:
    """``x`` in ``n`` base-``base`` digits, most significant first (schoolbook repeated division)."""
    out = ""
    for _ in range(n):
        x, d = divmod(x, base)
        out = "0123456789"[d] + out
    assert x == 0
    return out


def _text(a: int, b: int, n: int, base: int, order: str) -> str:
    """``digits(a) + digits(b) = reversed n+1 digits of the sum $``, operands reversed for ``lsd``."""
    x, y = _digits(a, n, base), _digits(b, n, base)
    if order == "lsd":
        x, y = x[::-1], y[::-1]
    total = _digits(a + b, n + 1, base)[::-1]
    assert int(total[::-1], base) == a + b
    return f"{x}+{y}={total}$"


def _places(n: int, order: str):
    """Each token's place in its number (1 the units), 0 for ``+ = $``."""
    operand = list(range(n, 0, -1)) if order == "msd" else list(range(1, n + 1))
    return operand + [0] + operand + [0] + list(range(1, n + 2)) + [0]


def _model(res, state, preset):
    m = build_model(res["config_fields"], res["size"], vocab_size=len(VOCAB))
    if res["abacus_offset"] is not None:  # places of the longest answer of training (with offset) or evaluation
        rows = max(preset["train_widths"][1] + res["abacus_offset"], preset["ood_widths"][1]) + 2
        m = DigitPositions(m, rows)
    m.load_state_dict(state)
    return m.eval()


def _score(res, state):
    """``{width: (hits [samples, width + 1] bool, suffix nll summed, suffix tokens)}`` of the weights ``state`` on
    the run's evaluation samples, each digit predicted from the gold prefix (argmax of the logits one position
    before it)."""
    p, base, order = res["preset"], res["base"], res["operand_order"]
    model = _model(res, state, p)
    (tlo, thi), (olo, ohi) = p["train_widths"], p["ood_widths"]
    out = {}
    for n in [*range(tlo, thi + 1), *range(olo, ohi + 1)]:
        count = p["val_per_width"] if tlo <= n <= thi else p["ood_per_width"]
        rng = random.Random(f"{res['eval_seed']}/eval/{n}")
        pairs = [(rng.randrange(base ** n), rng.randrange(base ** n)) for _ in range(count)]
        texts = [_text(a, b, n, base, order) for a, b in pairs]
        ids = torch.tensor([[VOCAB.index(c) for c in t] for t in texts])
        with torch.no_grad():
            if isinstance(model, DigitPositions):
                logits = model(ids, torch.tensor([_places(n, order)] * count)).logits
            else:
                logits = model(ids).logits
        logp = torch.log_softmax(logits.double(), -1)
        first = 2 * n + 2
        hits = torch.zeros(count, n + 1, dtype=torch.bool)
        nll = 0.0
        for i, t in enumerate(texts):
            for j in range(first, len(t)):  # the n + 1 sum digits and the end marker
                token = VOCAB.index(t[j])
                nll -= float(logp[i, j - 1, token])
                if j < first + n + 1:
                    hits[i, j - first] = int(logp[i, j - 1].argmax()) == token
        out[n] = (hits, nll, count * (n + 2))
    return out


def _pct(x) -> float:
    return 100.0 * float(x)


@pytest.mark.parametrize("task", [
    [],  # the paper's format: decimal, operands most significant digit first
    ["--model", "Transformer", "--base", "3", "--operand-order", "lsd", "--abacus-offset", "2"],
])
def test_the_recorded_accuracies_are_those_of_the_saved_weights(tmp_path, task):
    """At the best step (best.pt) every figure of ``results.json``'s ``best`` -- exact and digit accuracy per
    width, by answer position, the pooled validation accuracies, the OOD mean and Acc@ first/last OOD width --
    is what the saved weights score on the rebuilt samples; the last evaluation's figures and token-weighted
    losses are what checkpoint.pt scores; and the best step is the history's highest validation exact
    accuracy, then digit accuracy, then lowest validation loss, the earlier step on a full tie."""
    out = tmp_path / "run"
    assert cli.main(["--steps", "12", "--eval-every", "4", "--train-widths", "1", "3", "--ood-widths", "5", "6",
                     "--val-per-width", "12", "--ood-per-width", "7", *SIZE, *task, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    best, history = res["best"], res["history"]
    p = res["preset"]
    val, ood = range(1, 4), range(5, 7)

    chosen = None
    for h in history:  # the documented order, the earlier step kept on a full tie
        if chosen is None or (h["val_acc"], h["val_digit_acc"], -h["val_loss"]) > \
                (chosen["val_acc"], chosen["val_digit_acc"], -chosen["val_loss"]):
            chosen = h
    assert best["step"] == chosen["step"] and [h["step"] for h in history] == [4, 8, 12]

    saved = torch.load(out / "best.pt", weights_only=False)
    assert saved["step"] == best["step"]
    scored = _score(res, saved["model"])
    for n, (hits, _, _) in scored.items():
        assert best["per_width"][str(n)]["exact"] == pytest.approx(_pct(hits.all(1).double().mean()), abs=1e-9)
        assert best["per_width"][str(n)]["digit"] == pytest.approx(_pct(hits.double().mean()), abs=1e-9)
        assert best["per_position"][str(n)] == pytest.approx([_pct(x) for x in hits.double().mean(0)], abs=1e-9)
    exact = {n: _pct(h.all(1).double().mean()) for n, (h, _, _) in scored.items()}
    digit = {n: _pct(h.double().mean()) for n, (h, _, _) in scored.items()}
    # validation pools the samples (as many per width) and the digits (n + 1 per sample of width n)
    assert best["val_acc"] == pytest.approx(sum(exact[n] for n in val) / 3, abs=1e-9)
    assert best["val_digit_acc"] == pytest.approx(
        _pct(sum(int(scored[n][0].sum()) for n in val) / (p["val_per_width"] * sum(n + 1 for n in val))), abs=1e-9)
    assert best["mean_acc_ood"] == pytest.approx((exact[5] + exact[6]) / 2, abs=1e-9)
    assert best["digit_mean_acc_ood"] == pytest.approx((digit[5] + digit[6]) / 2, abs=1e-9)
    assert (best["acc_d5"], best["acc_d6"]) == pytest.approx((exact[5], exact[6]), abs=1e-9)
    assert (best["digit_acc_d5"], best["digit_acc_d6"]) == pytest.approx((digit[5], digit[6]), abs=1e-9)

    last = torch.load(out / "checkpoint.pt", weights_only=False)
    assert last["step"] == history[-1]["step"] == 12
    scored = _score(res, last["model"])
    h = history[-1]
    assert h["val_acc"] == pytest.approx(sum(_pct(scored[n][0].all(1).double().mean()) for n in val) / 3, abs=1e-9)
    assert h["mean_acc_ood"] == pytest.approx(
        sum(_pct(scored[n][0].all(1).double().mean()) for n in ood) / 2, abs=1e-9)
    for key, widths in (("val_loss", val), ("ood_loss", ood)):  # per suffix token, over the widths' tokens
        mine = sum(scored[n][1] for n in widths) / sum(scored[n][2] for n in widths)
        assert h[key] == pytest.approx(mine, rel=1e-5)


def test_a_run_stopped_by_sigint_mid_interval_resumes_to_the_straight_runs_weights(tmp_path, monkeypatch, capsys):
    """Ctrl-C (SIGINT) during step 6 of 12 (evaluations every 4): exit 130, a checkpoint at step 6; the same
    command then ends with the history, best step and the very weights (best.pt, checkpoint.pt) and optimizer
    state of the run never stopped -- bit for bit on the CPU."""
    argv = ["--model", "Falcon-1A.3", "--steps", "12", "--eval-every", "4", "--train-widths", "1", "3",
            "--ood-widths", "4", "5", "--val-per-width", "6", "--ood-per-width", "4", *SIZE]
    straight, out = tmp_path / "straight", tmp_path / "run"
    assert cli.main([*argv, "--out", str(straight)]) == 0
    calls = signal_while_drawing(monkeypatch, train, signal.SIGINT, 6)  # the first launch, during its sixth step
    assert cli.main([*argv, "--out", str(out)]) == 128 + signal.SIGINT
    assert "stopped by SIGINT at step 6 of 12" in capsys.readouterr().err
    stopped = json.loads((out / "results.json").read_text())
    assert stopped["steps_done"] == 6 and stopped["signal"] == "SIGINT" and not stopped["finished"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert calls[6:] == list(range(6, 12))  # the relaunch trained the steps left, once each
    a, b = (json.loads((d / "results.json").read_text()) for d in (straight, out))
    assert a["history"] == b["history"] and a["best"] == b["best"] and b["finished"] and "signal" not in b
    for name in ("best.pt", "checkpoint.pt"):
        x, y = (torch.load(d / name, weights_only=False) for d in (straight, out))
        assert x["step"] == y["step"] and x["model"].keys() == y["model"].keys()
        assert all(torch.equal(x["model"][k], y["model"][k]) for k in x["model"])
    x, y = (torch.load(d / "checkpoint.pt", weights_only=False)["optimizer"]["state"] for d in (straight, out))
    assert x.keys() == y.keys()
    assert all(torch.equal(x[i][k], y[i][k]) for i in x for k in x[i])


def test_evaluations_equal_on_all_three_keep_the_first_as_the_best_step(tmp_path):
    """A learning rate of 1e-300 leaves every float32 weight as it was (its updates round to zero), so the three
    evaluations score alike on validation exact and digit accuracy and validation loss: the best step is the
    first, as the doc's "a step equal on all three keeps the earlier one" says, and best.pt holds its weights."""
    out = tmp_path / "run"
    argv = [*SIZE[: SIZE.index("--lr")], *SIZE[SIZE.index("--lr") + 2:], "--lr", "1e-300"]
    assert cli.main(["--steps", "6", "--eval-every", "2", "--train-widths", "1", "2", "--ood-widths", "3", "3",
                     "--val-per-width", "5", "--ood-per-width", "3", *argv, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    history = res["history"]
    assert [h["step"] for h in history] == [2, 4, 6]
    assert len({(h["val_acc"], h["val_digit_acc"], h["val_loss"]) for h in history}) == 1
    assert res["best"]["step"] == 2
    saved = torch.load(out / "best.pt", weights_only=False)
    last = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    assert saved["step"] == 2 and all(torch.equal(saved["model"][k], last[k]) for k in last)


@pytest.mark.parametrize("stop_at,evaluated", [(3, [3]), (6, [4, 6])])
def test_a_stopped_run_ended_at_its_stop_by_a_shorter_steps_is_evaluated_at_its_last_step(
        tmp_path, monkeypatch, capsys, stop_at, evaluated):
    """Stopped by a SIGTERM at step 3 or 6 of 12 (evaluations every 4) and launched again with ``--steps`` at the
    step reached (a budget cut to where the run stands, which ``--steps`` may do): the run ends evaluated at its
    last step, as a run of that budget is, with that step's figures those of its weights; it is not marked
    finished before that evaluation, so that ``addition-compare`` never takes a run without one for done."""
    argv = ["--model", "Transformer", "--eval-every", "4", "--train-widths", "1", "2", "--ood-widths", "3", "3",
            "--val-per-width", "5", "--ood-per-width", "3", *SIZE, "--out", str(tmp_path / "run")]
    original = train.training_batch
    calls = []

    def stopping(seed, step, *args, **kw):
        calls.append(step)
        if len(calls) == stop_at:  # during the step that ends at stop_at
            os.kill(os.getpid(), signal.SIGTERM)
        return original(seed, step, *args, **kw)

    monkeypatch.setattr(train, "training_batch", stopping)
    assert cli.main(["--steps", "12", *argv]) == 128 + signal.SIGTERM
    monkeypatch.setattr(train, "training_batch", original)
    assert f"stopped by SIGTERM at step {stop_at} of 12" in capsys.readouterr().err

    evaluate = train.evaluate

    def failing(*args, **kw):
        raise OSError("evaluation failed")

    monkeypatch.setattr(train, "evaluate", failing)  # the relaunch ends before its evaluation...
    with pytest.raises(OSError, match="evaluation failed"):
        cli.main(["--steps", str(stop_at), *argv])
    held = json.loads((tmp_path / "run" / "results.json").read_text())
    assert held["steps_done"] == stop_at and not held["finished"]  # ...and leaves the run unfinished
    monkeypatch.setattr(train, "evaluate", evaluate)
    assert cli.main(["--steps", str(stop_at), *argv]) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["finished"] and res["steps_done"] == stop_at
    assert [h["step"] for h in res["history"]] == evaluated
    last = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert last["step"] == stop_at
    hits = _score(res, last["model"])
    h = res["history"][-1]
    assert h["lr"] == pytest.approx(1e-2 * stop_at / 100, rel=1e-12)  # its last step's: in the 100 warm-up steps
    assert h["val_acc"] == pytest.approx(
        sum(_pct(hits[n][0].all(1).double().mean()) for n in (1, 2)) / 2, abs=1e-9)
    assert h["digit_mean_acc_ood"] == pytest.approx(_pct(hits[3][0].double().mean()), abs=1e-9)

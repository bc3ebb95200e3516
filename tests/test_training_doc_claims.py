"""Statements of ``docs/training.md`` checked against the code: the Python interface section 7 lists and what its
example prints, the models the recipes build (their sizes as the docs quote them), the preset families, the
shard size, the small-recipe script, and the printed outputs the docs show, each against the recipe it came
from (tokens = steps x batch x length, ppl = exp(loss), a bucket table that adds up). (``tests/test_docs.py``
runs the examples; ``tests/test_doc_commands.py`` parses the commands; ``tests/test_train_infra_mutants.py``
reads the fields table.)"""
from __future__ import annotations

import contextlib
import inspect
import io
import math
import os
import pathlib
import re
import shlex
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "training.md").read_text()


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


FLAT = _flat(DOC)


def _section(number: int) -> str:
    """The text of ``## {number}. ...`` up to the next ``## `` heading."""
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", DOC, flags=re.S | re.M)
    assert m, number
    return m.group(0)


def _tiny_recipe(tmp_path) -> pathlib.Path:
    """The recipe section 2 writes (its heredoc), into ``tmp_path``."""
    m = re.search(r"cat > /tmp/fwa/tiny.yaml <<'EOF'\n(.*?)\nEOF\n", DOC, flags=re.S)
    assert m, "section 2 no longer writes /tmp/fwa/tiny.yaml"
    path = tmp_path / "tiny.yaml"
    path.write_text(m.group(1))
    return path


def _params(cfg, vocab_size=257, eos=256) -> int:
    """The parameter count of the model ``cfg`` trains on the byte tokenizer (257 tokens, end-of-text 256)."""
    from falcon_fwa.train.model_factory import build_model
    model = build_model(cfg.model, vocab_size=vocab_size, eos_token_id=eos)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# 7. From Python


def test_the_python_interface_is_the_one_section_7_lists():
    """``falcon_fwa.train`` exports what section 7 names, and only that; ``Trainer(cfg, model_fn=None)`` with
    ``train(stop_at=, should_stop=, stop_on_signal=)``, ``evaluate()``, ``save()``, ``export(folder)``,
    ``close()``; ``load_config(path, overrides)``."""
    import falcon_fwa.train as train
    text = _flat(_section(7).split("```python")[0])
    listed = re.findall(r"`(\w+)(?:\(|`)", text)
    names = {n for n in listed if n[0].isupper() or "_" in n}
    assert names == set(train.__all__), (names ^ set(train.__all__))
    assert "`Trainer(cfg, model_fn=None)`" in text
    sig = inspect.signature(train.Trainer)
    assert list(sig.parameters) == ["cfg", "model_fn"] and sig.parameters["model_fn"].default is None
    assert "(`train(stop_at=, should_stop=, stop_on_signal=)`" in text
    kw = inspect.signature(train.Trainer.train).parameters
    assert [k for k in kw if k != "self"] == ["stop_at", "should_stop", "stop_on_signal"]
    for method, args in (("evaluate", []), ("save", []), ("export", ["folder"]), ("close", [])):
        assert f"`{method}({', '.join(args)})`" in text, method
        assert [k for k in inspect.signature(getattr(train.Trainer, method)).parameters if k != "self"] == args
    assert "`load_config(path, overrides)`" in text
    assert list(inspect.signature(train.load_config).parameters) == ["path", "overrides"]


def test_the_python_example_prints_what_its_comments_say():
    """Section 7's example, run as written: it trains 6 steps of 4 rows of 32 tokens in two launches, and the
    checkpoint line prints what its comment shows (the step, and a data position of 6 micro-steps at
    ``micro_batch`` 4 in one process); the summary it prints has the 6 steps and 6 x 4 x 32 tokens, and
    ``val_ppl = exp(val_loss)``."""
    block = re.search(r"```python\n(.*?)```", _section(7), flags=re.S).group(1)
    shown = re.search(r"print\(state\[\"step\"\], state\[\"data\"\]\)\s+# (.*)", block).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block, "<training.md section 7>", "exec"), {"__name__": "__doc_example__"})
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    summary_line = next(line for line in lines if line.startswith("{'params'"))
    summary = eval(summary_line, {})  # noqa: S307 (a dict of numbers the example printed)
    assert (summary["steps"], summary["tokens"]) == (6, 6 * 4 * 32)
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-12)
    assert shown in lines, (shown, lines)


# --------------------------------------------------------------------------------------------------
# 2, 3, 4. The models the recipes build


def test_the_tiny_recipe_builds_the_model_section_2_describes(tmp_path):
    """Section 2: "a 46k-parameter Falcon-3A (preset ``tiny-falcon``: 2 layers, width 32, 2 heads)"; section 3's
    summary line prints its exact count, and the "Another rule" runs print theirs."""
    from falcon_fwa.models import get_preset
    from falcon_fwa.train import load_config
    assert "46k-parameter Falcon-3A (preset `tiny-falcon`: 2 layers, width 32, 2 heads)" in FLAT
    preset = get_preset("tiny-falcon")
    assert (preset.num_hidden_layers, preset.hidden_size, preset.num_heads) == (2, 32, 2)
    cfg = load_config(str(_tiny_recipe(tmp_path)))
    assert (cfg.model.preset, cfg.model.overrides["rule"]) == ("tiny-falcon", "3A")
    shown = int(re.search(r"\{'params': (\d+), 'steps': 40,", DOC).group(1))
    assert _params(cfg) == shown and round(shown / 1000) == 46


def test_the_small_recipe_is_the_size_section_3_gives():
    """Section 3: "the 11.7M-parameter small recipe" (``configs/small/falcon-1a.3.yaml`` on byte tokens)."""
    from falcon_fwa.train import load_config
    m = re.search(r"the ([\d.]+)M-parameter small recipe", FLAT)
    assert m
    cfg = load_config(str(ROOT / "configs" / "small" / "falcon-1a.3.yaml"), ["data.train_source=x"])
    assert round(_params(cfg) / 1e6, 1) == float(m.group(1))


def _compare_command():
    """The ``falcon-fwa compare`` command of section 4, as argv."""
    block = re.search(r"```bash\n(falcon-fwa compare .*?)\n```", _section(4), flags=re.S).group(1)
    first = block.split("\npython ")[0]
    return shlex.split(first.replace("\\\n", " "))


def test_the_compared_models_are_the_sizes_section_4_gives():
    """Section 4: "models of 137,608 parameters (137,612 for Gated DeltaNet)": the three recipes of its command
    with its ``--set`` model overrides, on byte tokens."""
    from falcon_fwa.train import load_config
    argv = _compare_command()
    configs = argv[argv.index("--configs") + 1: argv.index("--names")]
    names = argv[argv.index("--names") + 1: argv.index("--out")]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    m = re.search(r"models of ([\d,]+) parameters \(([\d,]+) for Gated DeltaNet\)", FLAT)
    assert m and len(configs) == len(names) == 3
    want = {"Gated DeltaNet": int(m.group(2).replace(",", ""))}
    for config, name in zip(configs, names):
        cfg = load_config(str(ROOT / config), [s for s in sets if s.startswith("model.")] + ["data.train_source=x"])
        assert _params(cfg) == want.get(name, int(m.group(1).replace(",", ""))), name



@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("after, status, finished", [
    ("a", {"a": "done", "b": "not_run"}, False),  # between the two recipes
    ("b", {"a": "done", "b": "done"}, True),  # as the last run ends
], ids=["between-recipes", "after-the-last"])
def test_a_sequential_compare_stop_between_recipes_and_after_the_last_is_as_section_4_says(
        tmp_path, monkeypatch, capsys, after, status, finished):
    """Section 4: a stop signal is the command's "from its first write of `compare.json` on", "it ends the command
    with 128 + the signal, `compare.json`'s `signal` names it, and the recipes it finds unstarted are `not_run`";
    "a stop between two recipes leaves the first as it ended"; "in either mode ... one that comes as the last run
    ends cuts nothing short: the comparison is marked finished (the command still ends with 128 + the signal)".
    A SIGTERM right after ``compare.json`` records recipe ``after`` done, two tiny recipes of 3 steps each."""
    import json
    import signal

    from test_compare_signal_edges import _guarded_compare, _signal_at_write
    for claim in ("from its first write of `compare.json` on, over calibration, set-up and runs alike, in either "
                  "mode: it ends the command with 128 + the signal, `compare.json`'s `signal` names it, and the "
                  "recipes it finds unstarted are `not_run`",
                  "a stop between two recipes leaves the first as it ended",
                  "one that comes as the last run ends cuts nothing short: the comparison is marked finished (the "
                  "command still ends with 128 + the signal)"):
        assert claim in FLAT, claim
    out = tmp_path / "cmp"
    written = _signal_at_write(monkeypatch, out, lambda report: report["status"][after] == "done")
    code = _guarded_compare(tmp_path, "--steps", "3")
    assert written and code == 128 + signal.SIGTERM
    report = json.loads((out / "compare.json").read_text())
    assert report["status"] == status and report["finished"] is finished and report["signal"] == "SIGTERM"
    assert report["runs"]["a"]["steps"] == 3 and "signal" not in report["runs"]["a"]  # the first, as it ended
    if after == "a":
        assert report["runs"]["b"]["signal"] == "SIGTERM" and not (out / "main" / "b").exists()
    else:
        assert report["runs"]["b"]["steps"] == 3
    assert "stopped by SIGTERM" in capsys.readouterr().err

def test_the_presets_are_the_families_the_fields_table_names():
    """The fields table: ``falcon_fwa.models.PRESETS``: ``tiny-*``, the paper's ``*-130m`` and
    ``transformer-124m``; every preset is of one of these, and each family has members."""
    from falcon_fwa.models import PRESETS
    assert "`tiny-*`, the paper's `*-130m` and `transformer-124m`" in FLAT
    tiny = [p for p in PRESETS if p.startswith("tiny-")]
    paper = [p for p in PRESETS if p.endswith("-130m")]
    assert len(tiny) >= 2 and len(paper) >= 2 and "transformer-124m" in PRESETS
    assert sorted(tiny + paper + ["transformer-124m"]) == sorted(PRESETS)


# --------------------------------------------------------------------------------------------------
# 1, 8. Data and the full-scale recipes


def test_a_split_is_written_in_shards_of_up_to_2_28_tokens(tmp_path, monkeypatch):
    """Section 1: "A split is written in shards of up to 2^28 tokens": ``write_token_shards``' default, which
    ``prepare_dataset`` leaves as it is."""
    from falcon_fwa.data import prepare as prepare_module
    from falcon_fwa.data.prepare import DataSpec, prepare_dataset
    from falcon_fwa.data.shards import write_token_shards
    assert "shards of up to 2^28 tokens" in FLAT
    assert inspect.signature(write_token_shards).parameters["shard_tokens"].default == 2 ** 28
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return write_token_shards(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "write_token_shards", recording)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i}" for i in range(40)))
    prepare_dataset(DataSpec(train_source=str(corpus), text_split="line"), str(tmp_path / "data"))
    assert len(seen) == 2 and all("shard_tokens" not in kw for kw in seen)


def test_run_small_trains_the_seven_small_recipes():
    """Section 8: "``results/lm/run_small.sh`` runs the seven small recipes": every recipe of ``configs/small/``
    (``base.yaml`` is their shared parent), each once, named."""
    assert "`results/lm/run_small.sh` runs the seven small recipes" in FLAT
    script = (ROOT / "results" / "lm" / "run_small.sh").read_text()
    m = re.search(r"--configs configs/small/\{([^}]*)\}\.yaml", script)
    run = m.group(1).split(",")
    names = shlex.split(re.search(r"--names (.*?) --out", script.replace("\\\n", " ")).group(1))
    recipes = sorted(p.stem for p in (ROOT / "configs" / "small").glob("*.yaml") if p.stem != "base")
    assert len(run) == len(set(run)) == len(names) == 7
    assert sorted(run) == recipes


# --------------------------------------------------------------------------------------------------
# The outputs the docs show, against the recipes that printed them


def test_the_shown_training_output_is_that_of_the_tiny_recipe(tmp_path):
    """Section 3's printed lines: the evaluations at ``eval_every`` up to ``train.steps``, the summary's tokens =
    steps x ``global_batch`` x ``seq_len``, ``val_ppl = exp(val_loss)``, and each evaluation line the summary's
    values rounded as printed (4 and 3 decimals)."""
    from falcon_fwa.train import load_config
    cfg = load_config(str(_tiny_recipe(tmp_path)))
    out = re.search(r"```\n(step 20: .*?)```", DOC, flags=re.S).group(1).splitlines()
    evals = [re.match(r"step (\d+): val_loss ([\d.]+) ppl ([\d.]+)$", line) for line in out[:-1]]
    assert [int(m.group(1)) for m in evals] == list(range(cfg.train.eval_every, cfg.train.steps + 1,
                                                          cfg.train.eval_every))
    for m in evals:
        assert float(m.group(3)) == pytest.approx(math.exp(float(m.group(2))), abs=2e-3)
    summary = eval(out[-1].replace("...", "None"), {})  # noqa: S307
    t = cfg.train
    assert (summary["steps"], summary["world_size"], summary["strategy"]) == (t.steps, 1, "single")
    assert summary["tokens"] == t.steps * t.global_batch * cfg.data.seq_len
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-12)
    assert (f"{summary['val_loss']:.4f}", f"{summary['val_ppl']:.3f}") == (evals[-1].group(2), evals[-1].group(3))
    assert f"the second command gives {summary['val_loss']:.4f}, the run's `val_loss`" in FLAT


def test_the_shown_perplexity_table_adds_up():
    """Section 5's ``ppl`` output: 32 windows of 512 are 16,384 predictions, the buckets 0-64, 64-128, 128-256,
    256-512 hold 32 x their width each, every ppl is exp of its loss, the whole loss is the token-weighted
    mean of the buckets', and the buckets from 128 (``--train-len``) on are marked beyond training length."""
    out = re.search(r"```\n(perplexity .*?)```", DOC, flags=re.S).group(1).splitlines()
    head = re.match(r"perplexity ([\d.]+) \(loss ([\d.]+)\) over (\d+) predictions, (\d+) windows of (\d+)", out[0])
    ppl, loss, n, windows, seq_len = (float(g) for g in head.groups())
    assert "--seq-len 512 \\\n    --train-len 128 --max-windows 32" in DOC
    assert (windows, seq_len, n) == (32, 512, 32 * 512)
    assert ppl == pytest.approx(math.exp(loss), abs=2e-3)
    rows = [re.match(r"\s*(\d+)-(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)(\s+\(beyond training length\))?$", line)
            for line in out[2:]]
    assert [(int(r.group(1)), int(r.group(2))) for r in rows] == [(0, 64), (64, 128), (128, 256), (256, 512)]
    total = 0.0
    for r in rows:
        lo, hi, tokens, bucket_loss, bucket_ppl = int(r.group(1)), int(r.group(2)), int(r.group(3)), \
            float(r.group(4)), float(r.group(5))
        assert tokens == windows * (hi - lo)
        assert bucket_ppl == pytest.approx(math.exp(bucket_loss), abs=5e-3)
        assert bool(r.group(6)) == (lo >= 128)
        total += tokens * bucket_loss
    assert total / n == pytest.approx(loss, abs=1e-4)


def test_another_rule_or_model_names_the_rules_and_model_fields_there_are():
    """Section 3: ``--set model.overrides.rule=2A`` takes ``1``, ``2``, ``3``, ``1A``, ``2A``, ``3A`` (``window`` for 3,
    3A), "likewise" the fields it names, each a ``FalconConfig`` field; a baseline is another preset or
    ``overrides.mixer``. Each rule and named field is taken by the recipe's model check."""
    from falcon_fwa.models.configuration import config_fields
    text = _flat(re.search(r"\*\*Another rule or model\*\*.*?```", DOC, flags=re.S).group(0))
    rules = re.search(r"\(((?:`\w+`, )+`\w+`); `window` for 3, 3A\)", text).group(1)
    assert [r.strip("`") for r in rules.split(", ")] == ["1", "2", "3", "1A", "2A", "3A"]
    named = re.search(r"likewise ((?:`\w+`, )+`\w+`) \(every `FalconConfig`", text).group(1)
    fields = [f.strip("`") for f in named.split(", ")] + ["mixer"]
    assert "(or `overrides.mixer`)" in text
    assert set(fields) <= config_fields(), set(fields) - config_fields()
    from falcon_fwa.train import config_from_dict
    for rule in ("1", "2", "3", "1A", "2A", "3A"):
        config_from_dict({"model": {"overrides": {"rule": rule}}, "data": {"train_source": "x"},
                          "optim": {"warmup_steps": 0}})


def test_the_full_scale_lm_eval_tasks_are_the_eight_of_the_papers_table_2():
    """Section 8's ``lm-eval`` command runs the eight tasks of Table 2 (section 6: then ``paper_tables`` holds
    their columns and the average of the eight)."""
    from falcon_fwa.eval.harness import PAPER_TABLE2
    m = re.search(r"falcon-fwa lm-eval --model runs/paper/.*?--tasks (\S+)", _section(8), flags=re.S)
    tasks = m.group(1).split(",")
    assert len(tasks) == len(set(tasks)) == 8
    assert sorted(tasks) == sorted(task for _, task, _ in PAPER_TABLE2)


def test_the_run_folder_holds_what_its_table_lists(tmp_path):
    """"The run folder" table, on a 7-step run logging every 3 steps, saving only as it stops, evaluating at
    ``train.steps``: training records at 3, 6 and 7 with the keys listed (``tokens`` = step x ``global_batch`` x
    ``seq_len``), one evaluation record; ``checkpoints/step-00000007`` with ``state.pt`` and ``meta.json``, named
    by ``LATEST``; ``model/`` with ``config.json``, ``model.safetensors`` and the tokenizer; ``summary.json`` with
    the keys listed (no ``signal``); ``loss.png``; ``data/`` (no ``data.out_dir``)."""
    import json

    from test_train import recipe, run_trainer

    from falcon_fwa.train.logger import read_log
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", DOC, flags=re.M)}
    raw = recipe(tmp_path, steps=7, save_every=0, eval_every=0, export_model=True)
    raw["data"]["out_dir"] = ""
    raw["train"]["eval_every"] = 7
    raw["log"]["every"] = 3
    run_trainer(raw)
    run = tmp_path / "run"
    train_keys = re.search(r"`(step, loss[\w, ]*)`", table["log.jsonl"]).group(1).split(", ")
    records = read_log(str(run / "log.jsonl"))
    trained = [r for r in records if "loss" in r]
    assert table["log.jsonl"].startswith("every `log.every` steps and at `train.steps`")
    assert [r["step"] for r in trained] == [3, 6, 7]
    assert all(sorted(r) == sorted(train_keys) for r in trained), train_keys
    t = raw["train"]
    assert [r["tokens"] for r in trained] == [s * t["global_batch"] * raw["data"]["seq_len"] for s in (3, 6, 7)]
    assert [sorted(r) for r in records if "val_loss" in r] == [sorted(["step", "val_loss", "val_ppl"])]
    assert "`step, val_loss, val_ppl`" in table["log.jsonl"]
    assert sorted(os.listdir(run / "checkpoints")) == ["LATEST", "step-00000007"]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000007"
    assert sorted(os.listdir(run / "checkpoints" / "step-00000007")) == ["meta.json", "state.pt"]
    exported = set(os.listdir(run / "model"))
    assert {"config.json", "model.safetensors"} <= exported and any(n.startswith("tokenizer") for n in exported)
    summary = json.loads((run / "summary.json").read_text())
    summary_keys = [k for k in re.findall(r"`(\w+)`", table["summary.json"]) if k != "signal"]
    assert sorted(summary) == sorted(summary_keys)
    assert (run / "loss.png").is_file() and (run / "data" / "prepared.json").is_file()


@pytest.mark.parametrize("text, want", [
    ("a\n  b c  \n\nd\n", ["a\n  b c  ", "d\n"]),  # the file's final line end stays on its last paragraph
    ("a\n\nd\n\n", ["a", "d"]),  # blank lines end the file: none stays
    ("a\n\n\n \nd", ["a", "d"]),
])
def test_paragraphs_keep_their_spaces_and_the_last_the_files_final_line_end(tmp_path, text, want):
    """Section 1, ``--text-split paragraph``: "its lines keep their spaces; a file's last one keeps the file's final
    line end, unless blank lines end the file"."""
    from falcon_fwa.data.sources import iter_documents
    assert "a file's last one keeps the file's final line end, unless blank lines end the file" in FLAT
    (tmp_path / "p.txt").write_text(text)
    assert list(iter_documents(str(tmp_path / "p.txt"), text_split="paragraph")) == want

"""Command-line journeys end to end: option combinations that would be silently ignored, or fail only after
the work, are refused naming the options before any model loads or any step trains; a folder of the wrong
kind (a run folder for --model, a prepared data folder for --data) is answered with the folder to give."""
import json

import pytest

from falcon_fwa import cli
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.models import FalconForCausalLM, get_preset


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """An untrained tiny Falcon with the byte tokenizer, saved as ``train`` exports one."""
    folder = tmp_path_factory.mktemp("journeys") / "model"
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("options, named", [
    (["--top-k", "5"], "--top-k"),
    (["--top-p", "0.9"], "--top-p"),
    (["--temperature", "0", "--top-k", "50", "--top-p", "0.95"], "--top-k"),
])
def test_generate_refuses_sampling_filters_with_greedy_decoding(model_folder, tmp_path, capsys, monkeypatch,
                                                                options, named):
    """--top-k and --top-p only shape a draw; greedy decoding (temperature 0, the default) takes the most likely
    token whatever they say, so a command asking for both gets an error naming the filter, not greedy output."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    out = tmp_path / "gen.json"
    status = cli.main(["generate", "--model", model_folder, "--device", "cpu", "--prompt", "a",
                       "--max-new-tokens", "2", "--json", str(out), *options])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"falcon-fwa generate: error: {named}") and "--temperature" in err
    assert not out.exists()


def test_generate_takes_the_filters_when_sampling(model_folder, tmp_path):
    out = tmp_path / "gen.json"
    assert cli.main(["generate", "--model", model_folder, "--device", "cpu", "--prompt", "a", "--max-new-tokens",
                     "2", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--json", str(out)]) == 0
    assert out.exists()


def compare_recipes(tmp_path):
    """Two tiny recipes (test_train's), ``a`` (Falcon) and ``b`` (Transformer), sharing data without a
    ``data.out_dir`` of their own: their paths."""
    import yaml
    from test_train import recipe

    paths = []
    for name, preset in (("a", "tiny-falcon"), ("b", "tiny-transformer")):
        raw = recipe(tmp_path)
        raw["model"]["preset"] = preset
        raw["data"]["out_dir"] = ""
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        paths.append(str(tmp_path / f"{name}.yaml"))
    return paths


def _compare(tmp_path, *extra):
    """``falcon-fwa compare`` of the two tiny recipes of :func:`compare_recipes` into ``tmp_path/cmp``."""
    import argparse

    from falcon_fwa.train import compare

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return compare.run(parser.parse_args(["--configs", *compare_recipes(tmp_path), "--names", "a", "b", "--out",
                                          str(tmp_path / "cmp"), *extra]))


@pytest.mark.parametrize("extra", [
    ["--steps", "2", "--calib-warmup", "3"],  # a fixed step count: nothing is calibrated
    ["--calib-warmup", "3"],  # the recipes' own train.steps: nothing is calibrated
    ["--concurrent", "--time-budget", "30", "--calib-warmup", "3"],  # concurrent calibration has no warm-up steps
])
def test_compare_refuses_calib_warmup_where_no_calibration_takes_it(tmp_path, monkeypatch, extra):
    """As --calib-steps and --max-steps are where nothing is calibrated: a warm-up count nothing would use is
    refused by name, before any recipe trains or any folder is written."""
    from falcon_fwa.train import compare

    def no_runs(*args, **kwargs):
        raise AssertionError("recipes ran before the options were checked")

    monkeypatch.setattr(compare, "run_all", no_runs)
    monkeypatch.setattr(compare, "calibrate_sequential", no_runs)
    with pytest.raises(ValueError, match=r"^\-\-calib\-warmup"):
        _compare(tmp_path, *extra)
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("extra, warmup", [([], 2), (["--calib-warmup", "3"], 3)])
def test_compare_sequential_calibration_takes_calib_warmup_or_two_steps(tmp_path, monkeypatch, extra, warmup):
    from falcon_fwa.train import compare

    seen = []

    class Calibrated(Exception):
        pass

    def calibrate(*args, **kwargs):
        seen.append(kwargs["warmup"])
        raise Calibrated

    monkeypatch.setattr(compare, "calibrate_sequential", calibrate)
    with pytest.raises(Calibrated):
        _compare(tmp_path, "--time-budget", "30", *extra)
    assert seen == [warmup]


@pytest.mark.parametrize("plot", ["ppl.xyz", "ppl.jpg", "ppl"])
def test_ppl_refuses_a_plot_path_that_is_no_png_before_evaluating(model_folder, tmp_path, capsys, monkeypatch, plot):
    """The plot is a PNG (--help); its format would follow the file name, and a name matplotlib cannot write
    would end the command only after the whole evaluation."""
    from falcon_fwa.eval import ppl_cli

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)

    def no_eval(*args, **kwargs):
        raise AssertionError("the evaluation ran before --plot was checked")

    monkeypatch.setattr(ppl_cli, "position_nll", no_eval)
    corpus = tmp_path / "val.txt"
    corpus.write_text("the state is a linear model trained online " * 20)
    status = cli.main(["ppl", "--model", model_folder, "--data", str(corpus), "--seq-len", "16", "--max-windows",
                       "2", "--device", "cpu", "--plot", str(tmp_path / plot)])
    assert status == 2
    assert capsys.readouterr().err.startswith("falcon-fwa ppl: error: --plot")


def test_ppl_writes_the_png_plot_it_is_asked_for(model_folder, tmp_path):
    corpus = tmp_path / "val.txt"
    corpus.write_text("the state is a linear model trained online " * 20)
    plot = tmp_path / "ppl.PNG"
    assert cli.main(["ppl", "--model", model_folder, "--data", str(corpus), "--seq-len", "16", "--max-windows", "2",
                     "--device", "cpu", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the PNG signature


def test_compare_refuses_a_run_folder_it_would_not_use(tmp_path, monkeypatch):
    """Every recipe trains in OUT/main/NAME; a --set train.out_dir would be overridden without a word, and the
    runs found elsewhere than asked."""
    from falcon_fwa.train import compare

    def no_runs(*args, **kwargs):
        raise AssertionError("recipes ran before the options were checked")

    monkeypatch.setattr(compare, "run_sequential", no_runs)
    with pytest.raises(ValueError, match=r"^\-\-set train\.out_dir="):
        _compare(tmp_path, "--steps", "2", "--set", f"train.out_dir={tmp_path / 'elsewhere'}")
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "elsewhere").exists()


def test_ppl_points_a_prepared_data_folder_to_its_split(model_folder, tmp_path, capsys, monkeypatch):
    """`falcon-fwa data --out DIR` writes DIR/train and DIR/val; --data DIR (the folder that command was given)
    holds no text, and the error names the shard folders that --data takes."""
    from falcon_fwa.data import DataSpec, prepare_dataset

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of the state" for i in range(40)))
    prepared = tmp_path / "prepared"
    prepare_dataset(DataSpec(train_source=str(corpus), text_split="line", val_every=4), str(prepared))
    capsys.readouterr()  # the tokenizing's progress bars
    args = ["ppl", "--model", model_folder, "--seq-len", "16", "--max-windows", "1", "--device", "cpu"]
    assert cli.main([*args, "--data", str(prepared)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa ppl: error: --data '{prepared}' is a prepared data folder")
    assert f"{prepared / 'val'} or {prepared / 'train'}" in err
    assert cli.main([*args, "--data", str(prepared / "val")]) == 0  # the split it names is taken


def test_a_run_folder_given_as_model_names_its_exported_model(tmp_path, capsys, monkeypatch):
    """`falcon-fwa train` exports to train.out_dir/model; --model given train.out_dir itself names that folder,
    or says that the run has exported none yet."""
    import json
    import shutil

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    data = tmp_path / "val.txt"
    data.write_text("text " * 50)
    for command in (["ppl", "--data", str(data)], ["generate", "--prompt", "a"]):
        assert cli.main([command[0], "--model", str(run), *command[1:], "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("falcon-fwa %s: error: --model: model folder" % command[0])
        assert "exported to model/ once it reaches train.steps" in err
    model = run / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({}))
    assert cli.main(["generate", "--model", str(run), "--prompt", "a", "--device", "cpu"]) == 2
    assert f"its model is {model}" in capsys.readouterr().err
    shutil.rmtree(run / "checkpoints")
    assert cli.main(["generate", "--model", str(run), "--prompt", "a", "--device", "cpu"]) == 2  # no run's folder
    assert "training run" not in capsys.readouterr().err


def test_compare_refuses_a_micro_batch_that_does_not_split_the_batch_before_any_recipe_trains(tmp_path, monkeypatch):
    """The recipes share train.global_batch but not micro_batch; one whose micro-batch does not divide it (every
    recipe trains in one process) would fail only after the recipes before it had trained."""
    import yaml

    from falcon_fwa.train import compare

    def no_runs(*args, **kwargs):
        raise AssertionError("recipes ran before the batch was checked")

    monkeypatch.setattr(compare, "run_sequential", no_runs)
    monkeypatch.setattr(compare, "calibrate_sequential", no_runs)
    real_load = compare.load_config

    def micro_batch_3_in_b(path, sets):
        if path.endswith("b.yaml"):
            sets = [*sets, "train.micro_batch=3"]
        return real_load(path, sets)

    monkeypatch.setattr(compare, "load_config", micro_batch_3_in_b)
    with pytest.raises(ValueError, match=r"b\.yaml: train\.global_batch = 4 is not a multiple of train\.micro_batch "
                                         r"= 3"):
        _compare(tmp_path, "--steps", "2")
    assert yaml.safe_load((tmp_path / "b.yaml").read_text())["train"]["global_batch"] == 4
    assert not (tmp_path / "cmp" / "compare.json").exists() and not (tmp_path / "cmp" / "data").exists()


def test_ppl_refuses_a_plot_without_matplotlib_before_the_work(model_folder, tmp_path, monkeypatch, capsys):
    """``--plot`` where matplotlib is not installed (an import of it fails) is refused by name before any window
    is scored, instead of failing once the evaluation is done."""
    import sys

    from falcon_fwa.eval import ppl_cli

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(ppl_cli, "position_nll", lambda *a, **k: pytest.fail("scored before --plot was checked"))
    corpus = tmp_path / "val.txt"
    corpus.write_text("the state is a linear model trained online " * 20)
    assert cli.main(["ppl", "--model", model_folder, "--data", str(corpus), "--seq-len", "16", "--device", "cpu",
                     "--plot", str(tmp_path / "ppl.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa ppl: error: --plot draws with matplotlib, which is not installed")
    assert not (tmp_path / "ppl.png").exists()


def test_compare_report_without_matplotlib_writes_its_rows_and_table_and_says_there_is_no_plot(tmp_path, monkeypatch,
                                                                                             capsys):
    """The report's JSON rows and markdown table need no matplotlib: without it they are written, the command
    ends with 0, and one line says no loss plot was drawn (it stopped with an ImportError after the table)."""
    import sys

    from falcon_fwa.train import compare_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = {"configs": ["a"], "steps": 2, "status": {"a": "done"},
              "runs": {"a": {"steps": 2, "params": 10, "tokens": 64, "val_ppl": 3.5, "log": [
                  {"step": 1, "tokens": 32, "loss": 1.5}, {"step": 2, "tokens": 64, "loss": 1.25, "val_loss": 1.3}]}}}
    (tmp_path / "compare.json").write_text(json.dumps(report))
    prefix = tmp_path / "rep" / "small"
    assert compare_report.main([str(tmp_path / "compare.json"), str(prefix)]) == 0
    rows = json.loads((tmp_path / "rep" / "small.json").read_text())
    assert [(r["model"], r["status"], r["val_ppl"]) for r in rows] == [("a", "done", 3.5)]
    assert "| a | done | 10 | 64 | 3.500 |" in (tmp_path / "rep" / "small_table.md").read_text()
    assert "matplotlib is not installed: no plot" in capsys.readouterr().out
    assert not (tmp_path / "rep" / "small_loss.png").exists()

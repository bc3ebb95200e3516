"""Addition task: a run relaunched in its folder with other settings is refused with an error that names the
option to change as typed (``--lr``, not the record's ``lr``), the run's value and the one given, how to resume
the run and how to start afresh instead."""
import re

import pytest
import torch

from falcon_fwa.tasks.addition import cli, compare

SMALL = ["--preset", "tiny", "--device", "cpu", "--batch-size", "4", "--val-per-width", "2", "--ood-per-width", "2",
         "--train-widths", "1", "3", "--ood-widths", "4", "5", "--threads", "1", "--hidden-size", "16",
         "--num-hidden-layers", "1", "--num-heads", "2", "--eval-every", "2"]
AFRESH = "give another --out, or --no-resume to start over there"


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A finished 2-step Transformer run of the tiny preset (its lr 0.003: the preset's, not given)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    assert cli.main(["--no-progress", "--model", "Transformer", "--steps", "2", "--out", str(out), *SMALL]) == 0
    return out


def _refusal(out, extra, model="Transformer"):
    with pytest.raises(ValueError) as err:
        cli.main(["--no-progress", "--model", model, "--steps", "2", "--out", str(out), *SMALL, *extra])
    return str(err.value)


# (options given on the relaunch, the option named, the run's value and the given one as the record writes them,
# the option that resumes the run as typed): the run's values are those of SMALL and the tiny preset
CHANGES = [
    (["--lr", "0.01"], "--lr", "lr 0.003", "0.01", "--lr 0.003"),
    (["--batch-size", "8"], "--batch-size", "batch_size 4", "8", "--batch-size 4"),
    (["--hidden-size", "32"], "--hidden-size", "hidden_size 16", "32", "--hidden-size 16"),
    (["--num-hidden-layers", "2"], "--num-hidden-layers", "num_hidden_layers 1", "2", "--num-hidden-layers 1"),
    (["--num-heads", "4"], "--num-heads", "num_heads 2", "4", "--num-heads 2"),
    (["--train-widths", "1", "2"], "--train-widths", "train_widths [1, 3]", "[1, 2]", "--train-widths 1 3"),
    (["--ood-widths", "4", "6"], "--ood-widths", "ood_widths [4, 5]", "[4, 6]", "--ood-widths 4 5"),
    (["--val-per-width", "3"], "--val-per-width", "val_per_width 2", "3", "--val-per-width 2"),
    (["--ood-per-width", "3"], "--ood-per-width", "ood_per_width 2", "3", "--ood-per-width 2"),
    (["--curriculum-steps", "2"], "--curriculum-steps", "curriculum_steps 0", "2", "--curriculum-steps 0"),
    (["--operand-order", "lsd"], "--operand-order", "operand_order 'msd'", "'lsd'", "--operand-order msd"),
    (["--base", "2"], "--base", "base 10", "2", "--base 10"),
    (["--seed", "3"], "--seed", "seed 0", "3", "--seed 0"),
    (["--eval-seed", "7"], "--eval-seed", "eval_seed 1234", "7", "--eval-seed 1234"),
    (["--dtype", "bf16"], "--dtype", "dtype 'float32'", "'bfloat16'", "--dtype float32"),
]


@pytest.mark.parametrize("extra, option, held, given, resume", CHANGES, ids=[c[1] for c in CHANGES])
def test_a_changed_option_is_named_as_typed_with_both_values(run_folder, extra, option, held, given, resume):
    msg = _refusal(run_folder, extra)
    assert msg == (f"{option}: {run_folder} holds a run with {held}, not {given}; resume it with {resume}, "
                   f"or {AFRESH}")


def test_digit_places_the_run_has_none_of_are_named_by_their_absence(run_folder):
    msg = _refusal(run_folder, ["--abacus-offset", "2"])
    assert msg.startswith(f"--abacus-offset: {run_folder} holds a run with abacus_offset None, not 2; ")
    assert msg.endswith(f"resume it without --abacus-offset, or {AFRESH}")


def test_another_model_is_named_with_both_models(run_folder):
    msg = _refusal(run_folder, [], model="Mamba-2")
    assert msg.startswith(f"--model: {run_folder} holds a run of Transformer {{'mixer': 'transformer'}}, "
                          f"not Mamba-2 {{'mixer': 'mamba2'}}; resume it with --model Transformer, or ")


def test_a_budget_below_the_steps_done_is_named_as_steps(run_folder):
    with pytest.raises(ValueError) as err:
        cli.main(["--no-progress", "--model", "Transformer", "--steps", "1", "--out", str(run_folder), *SMALL])
    assert str(err.value) == (f"--steps: {run_folder} holds a run of 2 steps, more than 1; resume it with --steps 2 "
                              f"or more, or {AFRESH}")


def test_a_setting_changed_by_another_preset_names_the_option_and_both_presets(run_folder):
    # the paper preset with every option of SMALL given: its lr 0.001 is the first setting still its own
    msg = _refusal(run_folder, ["--preset", "paper"])
    assert msg == (f"--lr: {run_folder} holds a run with lr 0.003, not 0.001 (the run's --preset is tiny, this "
                   f"command's paper); resume it with --lr 0.003 and --preset tiny, or {AFRESH}")


def test_a_rule_of_the_same_mixer_is_named_as_rule(tmp_path):
    out = tmp_path / "run"
    argv = ["--no-progress", "--model", "falcon", "--rule", "1", "--steps", "2", "--out", str(out), *SMALL]
    assert cli.main(argv) == 0
    with pytest.raises(ValueError) as err:
        cli.main(["--no-progress", "--model", "falcon", "--rule", "2", "--steps", "2", "--out", str(out), *SMALL])
    assert str(err.value).startswith(
        f"--rule: {out} holds a run of falcon {{'mixer': 'falcon', 'rule': '1'}}, not falcon "
        f"{{'mixer': 'falcon', 'rule': '2'}}; resume it with --model falcon --rule 1, or ")
    # the option it names resumes the run: the finished run is launched again and its files stand
    assert cli.main(argv) == 0


def test_a_setting_of_the_preset_alone_is_named_as_the_preset(tmp_path):
    # a run whose record holds another warmup (no option sets it): only --preset could have changed it
    out = tmp_path / "run"
    argv = ["--model", "Transformer", "--steps", "2", "--out", str(out), *SMALL]
    assert cli.main(argv) == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    ckpt["results"]["preset"]["warmup"] = 50
    torch.save(ckpt, out / "checkpoint.pt")
    with pytest.raises(ValueError) as err:
        cli.main(argv)
    msg = str(err.value)
    assert msg.startswith(f"--preset: {out} holds a run with warmup 50, not 100 (warmup is set by the preset alone")
    assert msg.endswith(AFRESH)


def test_the_named_option_with_the_runs_value_resumes_it(run_folder):
    """Each refusal's "resume it with ..." is a command line that the run takes: given, the run resumes."""
    for extra, *_ in CHANGES[:3]:
        msg = _refusal(run_folder, extra)
        restated = re.search(r"resume it with (.*?), or ", msg).group(1).split()
        assert cli.main(["--no-progress", "--model", "Transformer", "--steps", "2", "--out", str(run_folder), *SMALL,
                         *extra, *restated]) == 0


def test_compare_names_its_own_options(tmp_path):
    runs, res = tmp_path / "runs", tmp_path / "res"
    argv = ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--runs", str(runs), "--results", str(res),
            "--name", "t", *SMALL]
    assert compare.main(argv) == 0
    run = runs / "Transformer" / "seed0"
    with pytest.raises(ValueError) as err:
        compare.main(argv + ["--lr", "0.01"])
    assert str(err.value) == (f"--lr: {run} holds a run with lr 0.003, not 0.01; resume it with --lr 0.003, "
                              "or give --runs another folder")
    # a run of another seed in the folder of seed 0: --seeds names several runs, so no single value resumes it
    results = run / "results.json"
    results.write_text(results.read_text().replace('"seed": 0', '"seed": 5'))
    with pytest.raises(ValueError) as err:
        compare.main(argv)
    assert str(err.value) == f"--seeds: {run} holds a run with seed 5, not 0; give --runs another folder"


def test_a_paper_name_defined_anew_since_the_run_is_named_without_a_resume():
    # the run's record holds Falcon-3A.3 of rule 3 (as if the name had been defined so): no option gives
    # those fields back under that name, so the refusal offers no "resume it with"
    from falcon_fwa.tasks.addition.train import check_same_setup

    preset = {"steps": 2}
    held = {"model": "Falcon-3A.3", "config_fields": {"mixer": "falcon", "rule": "3"}, "preset": preset}
    wanted = {"model": "Falcon-3A.3", "config_fields": {"mixer": "falcon", "rule": "3A"}, "preset": preset}
    with pytest.raises(ValueError) as err:
        check_same_setup(held, wanted, "run", "ADVICE")
    assert str(err.value) == ("--model: run holds a run of Falcon-3A.3 {'mixer': 'falcon', 'rule': '3'}, not "
                              "Falcon-3A.3 {'mixer': 'falcon', 'rule': '3A'}; ADVICE")

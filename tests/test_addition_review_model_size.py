"""Size options that give a model no valid config are refused before anything is written, naming the options as
typed (README: "A bad option value ends a command with a line naming the option"). The Transformer's RoPE rotates
pairs of dimensions, so its head dim ``hidden_size / num_heads`` must be even: 24 / 8 = 3 and, with the tiny
preset's 2 heads, 6 / 2 = 3 are odd; the recurrent mixers take both."""
import pytest

from falcon_fwa.tasks.addition import cli, compare

SMALL = ["--preset", "tiny", "--device", "cpu", "--batch-size", "4", "--val-per-width", "2", "--ood-per-width", "2",
         "--train-widths", "1", "3", "--ood-widths", "4", "5", "--threads", "1", "--num-hidden-layers", "1",
         "--no-progress"]


@pytest.mark.parametrize("size,named", [
    (["--hidden-size", "24", "--num-heads", "8"], "--hidden-size 24 and --num-heads 8"),
    (["--hidden-size", "6"], "--hidden-size 6"),
])
def test_a_transformer_with_an_odd_head_dim_is_refused_before_its_folder_is_made(tmp_path, size, named):
    out = tmp_path / "run"
    with pytest.raises(ValueError) as err:
        cli.main(["--model", "Transformer", *size, "--steps", "1", "--out", str(out), *SMALL])
    message = str(err.value)
    assert message.startswith(f"{named}: ") and "Transformer" in message and "odd head dim" in message
    assert not out.exists()
    # the same sizes build a recurrent model: it trains
    assert cli.main(["--model", "Mamba-2", *size, "--steps", "1", "--out", str(out), *SMALL]) == 0


def test_a_lineup_with_a_model_the_sizes_do_not_fit_starts_no_run(tmp_path, monkeypatch):
    def started(*a, **k):
        raise AssertionError("a run was started")

    monkeypatch.setattr(compare, "train_all", started)
    runs, res = tmp_path / "runs", tmp_path / "res"
    with pytest.raises(ValueError) as err:
        compare.main(["--models", "Falcon-3A.3", "Transformer", "--hidden-size", "6", "--steps", "1",
                      "--runs", str(runs), "--results", str(res), *SMALL[:-1]])
    assert str(err.value).startswith("--hidden-size 6: ") and "'Transformer'" in str(err.value)
    assert not runs.exists() and not res.exists()

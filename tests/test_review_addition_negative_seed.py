"""A negative training seed is refused by addition and addition-compare alike, naming the option and what
is accepted: a run's folder is seed<seed>, and seed -1's would be seed-1, read as seed 1's."""
import argparse

import pytest

from falcon_fwa.tasks.addition import cli, compare


def _parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("seed", [-1, -2, -2 ** 63])
def test_addition_refuses_a_negative_seed_before_anything_is_written(tmp_path, seed):
    with pytest.raises(ValueError, match=rf"^--seed must be an integer >= 0 \(a run's folder is named "
                                         rf"seed<seed>\), got {seed}$"):
        cli.run(_parse(cli, ["--device", "cpu", "--seed", str(seed), "--out", str(tmp_path / "r")]))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("seed", [-1, -2 ** 63])
def test_addition_compare_refuses_a_negative_seed_naming_seeds(seed):
    with pytest.raises(ValueError, match=rf"^--seeds must be an integer >= 0 \(a run's folder is named "
                                         rf"seed<seed>\), got {seed}$"):
        compare.check_compare_options(_parse(compare, ["--seeds", "0", "1", str(seed)]))


def test_seed_zero_and_the_largest_seed_torch_takes_pass():
    compare.check_compare_options(_parse(compare, ["--seeds", "0", "1", str(2 ** 64 - 1)]))
    cli.check_run_seed("--seed", 0)
    with pytest.raises(ValueError, match=r"^--seed must lie in \[-2\^63, 2\^64\), got 18446744073709551616$"):
        cli.check_run_seed("--seed", 2 ** 64)


def test_the_cli_names_a_negative_seed(capsys, monkeypatch, tmp_path):
    from falcon_fwa import cli as main_cli

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    for argv, option in ((["addition", "--seed", "-1"], "--seed"),
                         (["addition-compare", "--seeds", "0", "-1"], "--seeds")):
        assert main_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"falcon-fwa {argv[0]}: error: {option} must be an integer >= 0"), err
    assert not any(tmp_path.iterdir())

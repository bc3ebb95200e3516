"""Edges of the command-line layer and its atomic writes that the other CLI tests leave open.

- ``write_json`` and ``write_text`` flush a file's bytes to disk before renaming it over the target (as
  ``save_torch`` does), then the folder holding the rename; a write ended by Ctrl-C (``KeyboardInterrupt``,
  not an ``Exception``) leaves the previous version and no temporary file; a write makes the missing folders
  above its file.
- A plot asked for where matplotlib is not installed is refused before any work, naming the option that
  asks for it (``falcon-fwa ppl --plot``: exit status 2, one line, the model never loaded); a plot drawn
  without it is skipped with one line; plots are drawn on the Agg backend whatever backend was chosen before
  (no window, no display needed).
- An error raised while a progress bar is open is printed on a line of its own after the bar's, the bar
  closed (not drawn again below the error).
- ``check_seed`` lets an option left out (``None``) pass, as ``at_least`` does."""
import os
import sys
import types

import numpy as np
import pytest

from falcon_fwa import atomic, cli, plotting

# ----------------------------------------------------------------------------------------------
# atomic writes


@pytest.mark.parametrize("write", [
    lambda path: atomic.write_json(path, {"a": 2}),
    lambda path: atomic.write_text(path, '{"a": 2}\n'),
], ids=["write_json", "write_text"])
def test_json_and_text_are_flushed_to_disk_before_the_rename_then_the_folder(write, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):  # which file or folder: its inode, compared below
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    path = tmp_path / "r.json"
    write(path)
    file_ino, folder_ino = path.stat().st_ino, tmp_path.stat().st_ino
    # the bytes on disk, then the rename, then the folder's entry: a power loss finds the old file or the new one
    assert events == [("fsync", file_ino), ("replace", file_ino), ("fsync", folder_ino)]
    assert atomic.read_json(path) == {"a": 2}


def test_a_write_ended_by_ctrl_c_keeps_the_previous_version_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    atomic.write_json(path, {"a": 1})

    def interrupted(obj):  # json.dump's default, called half-way through the write
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.write_json(path, {"a": 2, "b": object()}, default=interrupted)
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_path(path) as tmp:
            with open(tmp, "w") as f:
                f.write('{"a": ')  # half a file
            raise KeyboardInterrupt
    assert atomic.read_json(path) == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


def test_a_write_makes_the_missing_folders_above_its_file(tmp_path):
    path = tmp_path / "run" / "eval" / "r.json"  # neither folder there yet
    atomic.write_json(path, {"a": 1})
    assert atomic.read_json(path) == {"a": 1} and os.listdir(path.parent) == ["r.json"]


# ----------------------------------------------------------------------------------------------
# plots without matplotlib


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` raises ImportError, as where it is not installed."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_a_plot_asked_for_without_matplotlib_is_refused_naming_the_option(no_matplotlib):
    with pytest.raises(ValueError, match=r"^--plot draws with matplotlib, which is not installed "
                                         r"\(pip install 'falcon-fwa\[plot\]'\)$"):
        plotting.require("--plot")


def test_a_plot_drawn_without_matplotlib_is_skipped_with_one_line(no_matplotlib, capsys):
    assert plotting.pyplot() is None
    assert capsys.readouterr().out == "matplotlib is not installed: no plot (pip install 'falcon-fwa[plot]')\n"


def test_plots_are_drawn_on_agg_whatever_backend_was_chosen_before():
    import matplotlib

    plotting.require("--plot")  # installed with the test extras: nothing to refuse
    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # another backend (on a desktop: a window's), chosen before the package draws
        plt = plotting.pyplot()
        assert plt is sys.modules["matplotlib.pyplot"] and matplotlib.get_backend().lower() == "agg"
    finally:
        matplotlib.use(before)


def test_ppl_with_a_plot_and_no_matplotlib_ends_before_loading_the_model(no_matplotlib, monkeypatch, tmp_path,
                                                                          capsys):
    from falcon_fwa.eval import ppl_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    (tmp_path / "d.txt").write_text("held-out text\n")
    loaded = []

    def load_model(path, **kwargs):
        loaded.append(path)
        return "model", types.SimpleNamespace(eos_token_id=0)

    monkeypatch.setattr(ppl_cli, "load_model", load_model)
    monkeypatch.setattr(ppl_cli, "token_stream", lambda *a, **k: np.arange(100))
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    status = cli.main(["ppl", "--model", "m", "--data", "d.txt", "--seq-len", "8", "--device", "cpu",
                       "--out", "ppl.json", "--plot", "ppl.png"])
    assert status == 2 and loaded == []
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa ppl: error: --plot draws with matplotlib, which is not installed")
    assert "raised at" in err and not (tmp_path / "ppl.json").exists() and not (tmp_path / "ppl.png").exists()


# ----------------------------------------------------------------------------------------------
# option checks


def test_a_seed_left_out_passes_and_the_edges_of_the_range_are_kept():
    from falcon_fwa.cli_options import check_seed

    check_seed("--seed", None)
    check_seed("--seed", -2 ** 63)
    check_seed("--seed", 2 ** 64 - 1)
    with pytest.raises(ValueError, match=r"^--seed must lie in \[-2\^63, 2\^64\), got 18446744073709551616$"):
        check_seed("--seed", 2 ** 64)


# ----------------------------------------------------------------------------------------------
# an error inside a progress bar's loop


def test_an_error_inside_a_progress_bar_is_printed_on_a_line_of_its_own_and_the_bar_closed(monkeypatch, capsys):
    from tqdm import tqdm

    bars = []

    def run(args):
        # a bar updated by hand (a for loop over a bar would close it as the error leaves the loop)
        bars.append(tqdm(total=10, desc="counting", mininterval=0, file=sys.stderr))
        for i in range(10):
            bars[0].update()
            if i == 3:
                raise ValueError("--x must be >= 1, got 0")

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.run_command("falcon-fwa demo", run, types.SimpleNamespace()) == 2
    err = capsys.readouterr().err
    before, line = err.split("falcon-fwa demo: error: ", 1)
    assert "counting" in before and before.endswith("\n")  # the bar's line is finished, not run on into the error
    assert line.startswith("--x must be >= 1, got 0\n") and "counting" not in line  # the bar is not drawn again below
    assert bars[0].disable  # closed: nothing more of it is drawn when it is collected
    assert bars[0] not in tqdm._instances

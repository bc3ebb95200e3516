"""A recipe whose model overrides restate the preset's own values (``mixer: falcon`` on ``tiny-falcon``,
``conv_size: 3``, ``rms_norm_eps: 1e-6``) builds the same model as the recipe without them: a run folder of one
is resumed by the other, and ``falcon-fwa compare`` and ``falcon-fwa scaling`` keep a finished run of one for the
other (``compare.kept_result``). A real difference of the model is still refused, and named."""
import json

import pytest
from test_train import recipe, run_trainer

from falcon_fwa.provenance import CLEAN_TREE
from falcon_fwa.train import compare
from falcon_fwa.train.config import config_from_dict
from falcon_fwa.train.trainer import ResumeRefused, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# the tiny-falcon preset's own values, written out: the mixer, an integer and a float field
RESTATED = {"mixer": "falcon", "conv_size": 3, "rms_norm_eps": 1e-6}


def with_overrides(raw: dict, **overrides) -> dict:
    return {**raw, "model": {"preset": "tiny-falcon", "overrides": overrides}}


def test_resume_takes_overrides_that_restate_the_preset_and_refuses_another_model(tmp_path):
    run_trainer(recipe(tmp_path, "run"), stop_at=2)  # no overrides
    for restated in ({"mixer": "falcon"}, {"conv_size": 3}, RESTATED):
        trainer = Trainer(config_from_dict(with_overrides(recipe(tmp_path, "run"), **restated)))
        try:
            assert trainer.step == 2, restated
        finally:
            trainer.close()
    with pytest.raises(ResumeRefused, match=r"holds a run of other settings than this recipe's "
                                            r"\(model\.conv_size 3 there, 4 here\)"):
        Trainer(config_from_dict(with_overrides(recipe(tmp_path, "run"), mixer="falcon", conv_size=4)))
    with pytest.raises(ResumeRefused, match=r"\(model\.window 4 there, 16 here\)"):
        Trainer(config_from_dict(with_overrides(recipe(tmp_path, "run"), mixer="falcon", window=16)))


@pytest.fixture
def finished(tmp_path):
    """A finished run of the tiny recipe without overrides (:func:`finished_run`)."""
    return finished_run(tmp_path)


def finished_run(tmp_path):
    """A finished run of the tiny recipe: its folder and its result as compare records it; its summary names
    commit ``c0`` with no uncommitted changes (whatever the checkout's own)."""
    run_trainer(recipe(tmp_path, "run"))
    path = tmp_path / "run" / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(commit="c0", dirty=False, diff_sha256=CLEAN_TREE)
    path.write_text(json.dumps(summary))
    earlier = {"status": "done", "tokens": summary["tokens"], "tokens_per_s": summary["tokens_per_s"]}
    return tmp_path / "run", earlier


def kept(earlier, run_dir, raw, capsys):
    """``compare.kept_result`` for the recipe ``raw`` (as compare and scaling pass it) and the line it says."""
    result = compare.kept_result(earlier, str(run_dir), config_from_dict(raw).to_dict(), "c0", CLEAN_TREE, "a")
    return result, capsys.readouterr().out


def test_compare_and_scaling_keep_a_run_whose_recipe_restates_the_preset(tmp_path, finished, capsys):
    run_dir, earlier = finished
    for restated in ({"mixer": "falcon"}, {"conv_size": 3}, RESTATED):
        assert kept(earlier, run_dir, with_overrides(recipe(tmp_path, "run"), **restated), capsys) == (earlier, ""), \
            restated
    # a data and an optim field at their defaults, written out: recorded as the recipe without them
    raw = recipe(tmp_path, "run")
    raw["data"]["text_split"], raw["optim"]["eps"] = "file", 1e-8
    assert kept(earlier, run_dir, raw, capsys) == (earlier, "")


@pytest.mark.parametrize("overrides, named", [
    ({"mixer": "falcon", "conv_size": 4}, "model.conv_size 3 there, 4 here"),
    ({"mixer": "falcon", "window": 16}, "model.window 4 there, 16 here"),
    # a field that changes only how the model computes is another timing: trained again (a resume takes it)
    ({"chunk_size": 16}, "model.chunk_size 8 there, 16 here"),
])
def test_compare_and_scaling_train_another_model_again_naming_the_difference(tmp_path, finished, capsys,
                                                                              overrides, named):
    run_dir, earlier = finished
    assert kept(earlier, run_dir, with_overrides(recipe(tmp_path, "run"), **overrides), capsys) == (
        None, f"a: trained again, not kept from the earlier launch: its summary.json holds another recipe than "
              f"this launch trains ({named})\n")


def test_another_data_or_optim_setting_is_still_another_recipe(tmp_path, finished, capsys):
    run_dir, earlier = finished
    raw = recipe(tmp_path, "run")
    raw["optim"]["eps"] = 1e-6
    assert kept(earlier, run_dir, raw, capsys) == (
        None, "a: trained again, not kept from the earlier launch: its summary.json holds another recipe than this "
              "launch trains (optim.eps 1e-08 there, 1e-06 here)\n")


def test_recipe_differences_by_hand():
    from falcon_fwa.train.config import recipe_differences

    model = {"preset": "tiny-falcon", "overrides": {}}
    assert recipe_differences({"model": model}, {"model": {"preset": "tiny-falcon",
                                                           "overrides": {"rule": "1a", "window": 4}}}) == []
    differ = recipe_differences({"model": model}, {"model": {"preset": "tiny-falcon", "overrides": {"window": 16}},
                                                   "log": {"every": 1}})
    assert [(k, repr(a), b) for k, a, b in differ] == [("log", "absent", {"every": 1}), ("model.window", "4", 16)]
    # a field one recorded recipe lacks (a recipe of another version) differs, even where the other holds None
    differ = recipe_differences({"data": {"val_source": None}, "train": {"steps": 4}},
                                {"data": {}, "train": {"steps": 4}})
    assert [(k, a, repr(b)) for k, a, b in differ] == [("data.val_source", None, "absent")]
    # a preset this version does not have is compared as written
    differ = recipe_differences({"model": {"preset": "gone", "overrides": {"window": 4}}},
                                {"model": {"preset": "gone", "overrides": {}}})
    assert [(k, a, repr(b)) for k, a, b in differ] == [("model.overrides.window", 4, "absent")]

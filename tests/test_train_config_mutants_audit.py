"""Recipe overrides: a ``--set section.field=value`` assignment splits at its first ``=``, so a value that itself
holds ``=`` (a path such as ``runs/lr=3e-3``, a file name ``a=b.jsonl``) is kept whole as the field's value, as
``docs/training.md`` documents ``--set section.field=value``; the field path before it is what is set. A resume
check against the recipe of a checkpoint older than a data field (one that records no such field) does not ask
about that field, and still names the fields the checkpoint records that differ."""
from test_train import recipe

from falcon_fwa.train.config import apply_overrides, config_from_dict
from falcon_fwa.train.trainer import resume_differences


def test_a_set_value_holding_an_equals_sign_is_kept_whole():
    assert apply_overrides({}, ["data.train_source=a=b.jsonl"]) == {"data": {"train_source": "a=b.jsonl"}}
    assert apply_overrides({"train": {"steps": 4}}, ["train.out_dir=runs/lr=3e-3,wd=0.1"]) == {
        "train": {"steps": 4, "out_dir": "runs/lr=3e-3,wd=0.1"}}


def test_a_recipe_takes_a_set_path_holding_an_equals_sign(tmp_path):
    out = str(tmp_path / "runs" / "lr=3e-3")
    cfg = config_from_dict(apply_overrides(recipe(tmp_path), [f"train.out_dir={out}", "train.steps=6"]))
    assert cfg.train.out_dir == out and cfg.train.steps == 6


def test_a_checkpoint_older_than_a_data_field_is_not_asked_about_it(tmp_path):
    cfg = config_from_dict(recipe(tmp_path))
    saved = cfg.to_dict()
    del saved["data"]["bpe_documents"], saved["data"]["max_documents"]  # recorded before these fields existed
    assert resume_differences(saved, cfg) == []
    saved["data"]["seq_len"] = 32
    assert resume_differences(saved, cfg) == ["data.seq_len 32 there, 24 here"]

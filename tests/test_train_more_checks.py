"""More checks of the single-process training stack against independent references."""
from falcon_fwa.train.config import load_config, read_recipe

BASE = """\
data: {train_source: corpus.jsonl, seq_len: 24}
optim: {lr: 3.0e-3, warmup_steps: 2}
train: {steps: 7, global_batch: 4, micro_batch: 2, dtype: fp32}
log: {every: 1}
"""


def test_an_empty_section_in_a_recipe_that_extends_another_keeps_the_parents_fields(tmp_path):
    """A section left empty in a recipe that extends another (its one field commented out: YAML reads the
    section as null) changes nothing: the parent's fields stay, as they do for a section the child leaves out
    or writes as ``{}``; they are not replaced by the defaults (100,000 steps of 480 sequences)."""
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ntrain:\n  # steps: 9\nlog:\noptim: {lr: 1.0e-3}\n")
    assert read_recipe(str(tmp_path / "child.yaml"))["train"] == {"steps": 7, "global_batch": 4, "micro_batch": 2,
                                                                   "dtype": "fp32"}
    cfg = load_config(str(tmp_path / "child.yaml"))
    t = cfg.train
    assert (t.steps, t.global_batch, t.micro_batch, t.dtype) == (7, 4, 2, "fp32")
    assert cfg.log.every == 1
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (1e-3, 2)  # a section the child does write merges as before

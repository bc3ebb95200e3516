"""The model a recipe builds and its optimizer groups: the vocabulary grown from the tokenizer's to the next
multiple of 64, the end-of-text id on the config, no empty group, and non-reentrant activation checkpointing.
``falcon-fwa lm-eval``: the ``--dtype`` the harness gets, what ``--out`` records, and the module named where the
harness is installed but one of its own dependencies is not."""
import pytest
import torch
from torch import nn

from falcon_fwa.train.config import ModelSection
from falcon_fwa.train.model_factory import build_model, enable_activation_checkpointing, param_groups


@pytest.mark.parametrize("tokens, expected", [
    (65, 128),  # tiny-falcon's 64 grows past the tokenizer's 65: the next multiple of 64
    (128, 128),  # already a multiple of 64: kept, no extra 64 rows
    (257, 320),  # the byte tokenizer
    (50257, 50304),  # GPT-2's
])
def test_the_preset_vocabulary_grows_to_the_tokenizers_rounded_up_to_a_multiple_of_64(tokens, expected):
    model = build_model(ModelSection("tiny-falcon"), vocab_size=tokens, eos_token_id=tokens - 1)
    assert model.config.vocab_size == expected
    assert model.get_input_embeddings().weight.shape[0] == expected


def test_the_config_records_the_tokenizers_end_of_text_id():
    model = build_model(ModelSection("tiny-falcon"), vocab_size=257, eos_token_id=256)
    assert model.config.eos_token_id == 256
    model = build_model(ModelSection("tiny-falcon", {"vocab_size": 300}), vocab_size=257, eos_token_id=3)
    assert (model.config.vocab_size, model.config.eos_token_id) == (300, 3)


def test_a_model_without_vectors_gets_one_group_and_no_empty_one():
    """A bias-free linear layer has matrices only: one group, with the weight decay; the vector group, which would
    be empty, is left out (and a frozen bias is in no group)."""
    plain = nn.Linear(4, 3, bias=False)
    groups = param_groups(plain, lr=0.1, weight_decay=0.5)
    assert len(groups) == 1
    assert groups[0]["params"] == [plain.weight] and groups[0]["weight_decay"] == 0.5
    assert groups[0]["lr"] == 0.1 and groups[0]["lr_multiplier"] == 1.0
    frozen = nn.Linear(4, 3)
    frozen.bias.requires_grad_(False)
    groups = param_groups(frozen, lr=0.1, weight_decay=0.5)
    assert [g["params"] for g in groups] == [[frozen.weight]]


def test_activation_checkpointing_is_non_reentrant_and_keeps_the_gradients():
    """``torch.autograd.grad`` through the checkpointed blocks (which the reentrant variant refuses) gives the
    gradients of the plain model, bit for bit."""
    torch.manual_seed(0)
    model = build_model(ModelSection("tiny-falcon"), vocab_size=64, eos_token_id=63).train()
    ids = torch.randint(0, 64, (2, 12))
    params = [p for p in model.parameters() if p.requires_grad]

    def grads():
        loss = model(input_ids=ids, labels=ids).loss
        return torch.autograd.grad(loss, params)

    plain = grads()
    enable_activation_checkpointing(model)
    checkpointed = grads()
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- falcon-fwa lm-eval
def _lm_eval(monkeypatch, tmp_path, *extra):
    """``falcon-fwa lm-eval`` on a model folder by its form, with the harness's ``evaluate`` replaced by a recorder
    that returns a fixed result; (exit status, recorded keyword arguments)."""
    pytest.importorskip("lm_eval")
    import lm_eval.utils

    from falcon_fwa.cli import main
    from falcon_fwa.eval import harness

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    calls = []
    result = {"tasks": ["piqa"], "results": {"piqa": {"acc,none": 0.5}}, "versions": {"piqa": 1}, "other": 1}
    monkeypatch.setattr(harness, "evaluate", lambda *a, **k: calls.append(k) or result)
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda r: "harness table")
    return main(["lm-eval", "--model", str(model), "--tasks", "piqa", "--device", "cpu", *extra]), calls


@pytest.mark.parametrize("given, dtype", [([], "float32"), (["--dtype", "bf16"], "bfloat16"),
                                          (["--dtype", "float16"], "float16")])
def test_lm_eval_hands_the_harness_the_dtype_asked_for(monkeypatch, tmp_path, given, dtype):
    rc, calls = _lm_eval(monkeypatch, tmp_path, *given)
    assert rc == 0 and [k["dtype"] for k in calls] == [dtype]


def test_lm_eval_out_holds_the_results_and_the_command(monkeypatch, tmp_path):
    import json

    out = tmp_path / "res.json"
    rc, _ = _lm_eval(monkeypatch, tmp_path, "--out", str(out), "--batch-size", "3")
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["tasks"] == ["piqa"] and report["results"] == {"piqa": {"acc,none": 0.5}}
    assert report["versions"] == {"piqa": 1} and "other" not in report
    options = report["provenance"]["options"]
    assert (options["model"], options["tasks"], options["batch_size"]) == (str(tmp_path / "model"), "piqa", 3)


def test_a_missing_dependency_of_the_harness_is_named_itself(monkeypatch, tmp_path, capsys):
    """An ``lm_eval`` that is there but fails to import one of its own dependencies: the error names that module."""
    import sys

    from falcon_fwa.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    (tmp_path / "lm_eval").mkdir()
    (tmp_path / "lm_eval" / "__init__.py").write_text("import falcon_fwa_absent_dependency\n")
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["lm-eval", "--model", str(model), "--tasks", "piqa", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "'lm-eval' package" in err and "no module 'falcon_fwa_absent_dependency'" in err, err

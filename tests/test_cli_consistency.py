"""Sibling commands agree on how they take the same thing: a preset with fields changed
(``params`` as ``throughput --preset``), a dtype's spellings (``train.dtype`` as the ``--dtype`` of
``ppl`` and ``lm-eval``), what reaches the terminal (``throughput``: a table, the JSON rows in
``--out``), and the names in error messages (``lm-eval``: its own options)."""
from __future__ import annotations

import json

import pytest
import torch

from falcon_fwa import cli


def _count(config) -> int:
    """Parameters of the model a config builds, each tensor counted once (tied embeddings too)."""
    from falcon_fwa.models import FalconForCausalLM

    torch.manual_seed(0)
    return sum(p.numel() for p in FalconForCausalLM(config).parameters())


def _total_column(stdout: str, preset: str) -> int:
    """The ``total`` column of ``preset``'s row of ``falcon-fwa params``'s markdown table."""
    header, *rows = [line for line in stdout.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0] == preset:
            return int(cells[columns.index("total")].split()[0].replace(",", ""))
    raise AssertionError(f"no row {preset!r} in {stdout}")


# ---- params takes throughput's NAME:field=value,... form ------------------------------------------------------

def test_params_counts_a_preset_with_fields_changed_as_throughput_names_it(capsys):
    from falcon_fwa.models import get_preset

    spec = "tiny-falcon:num_hidden_layers=1,intermediate_size=64"
    assert cli.main(["params", spec, "tiny-falcon"]) == 0
    out = capsys.readouterr().out
    changed = get_preset("tiny-falcon", num_hidden_layers=1, intermediate_size=64)
    assert _total_column(out, spec) == _count(changed)
    assert _total_column(out, "tiny-falcon") == _count(get_preset("tiny-falcon"))
    assert _count(changed) < _count(get_preset("tiny-falcon"))  # the fields did change the model


def test_params_vocab_size_applies_under_the_specs_own_fields(capsys):
    from falcon_fwa.models import get_preset

    assert cli.main(["params", "tiny-falcon:num_hidden_layers=1", "tiny-falcon:vocab_size=128",
                     "--vocab-size", "100"]) == 0
    out = capsys.readouterr().out
    assert _total_column(out, "tiny-falcon:num_hidden_layers=1") == _count(
        get_preset("tiny-falcon", num_hidden_layers=1, vocab_size=100))
    assert _total_column(out, "tiny-falcon:vocab_size=128") == _count(get_preset("tiny-falcon", vocab_size=128))


def test_params_and_throughput_read_a_spec_with_one_function(monkeypatch, capsys):
    from falcon_fwa.train import throughput

    seen, original = [], throughput.parse_preset
    monkeypatch.setattr(throughput, "parse_preset", lambda spec, *a, **kw: seen.append(spec) or original(spec, *a, **kw))
    assert cli.main(["params", "tiny-falcon:rule=1", "tiny-transformer"]) == 0
    assert seen == ["tiny-falcon:rule=1", "tiny-transformer"]


@pytest.mark.parametrize("spec, message", [
    ("tiny-falcon:rul=1", "PRESET 'tiny-falcon:rul=1': unknown config field 'rul' (did you mean 'rule'?)"),
    ("tiny-falcon:rule", "PRESET 'tiny-falcon:rule': 'rule' is not field=value"),
    ("no-such-preset", "PRESET 'no-such-preset': unknown preset 'no-such-preset'"),
])
def test_params_names_a_bad_spec_as_throughput_does(spec, message, capsys):
    assert cli.main(["params", spec]) == 2
    err = capsys.readouterr().err
    assert "falcon-fwa params: error: " + message in err, err
    # throughput says the same of the same spec, under its own option
    assert cli.main(["throughput", "--preset", spec, "--device", "cpu"]) == 2
    assert "falcon-fwa throughput: error: " + message.replace("PRESET", "--preset") in capsys.readouterr().err

"""``lm-eval --tasks`` patterns (``arc_*``, ``hellaswag*``): expanded as lm-evaluation-harness's own command line
expands them, against its task library and the tasks of ``--include-path``; the results JSON records the expanded
list, and an entry that matches nothing is refused naming ``--tasks`` with the close names."""
import functools
import json

import pytest
from conftest import tiny_lm_recipe

pytest.importorskip("lm_eval")

# three local tasks: ``fwapat_*`` matches the first two, not the third
PATTERN_TASKS = ("fwapat_alpha", "fwapat_beta")
OTHER_TASK = "fwaother_gamma"


def _write_local_tasks(folder):
    """The three tasks as YAML files in ``folder``, each two multiple-choice documents of its own data file."""
    folder.mkdir(exist_ok=True)
    for n, task in enumerate(PATTERN_TASKS + (OTHER_TASK,)):
        data = folder / f"{task}.jsonl"
        with open(data, "w") as f:
            for i in range(2):
                f.write(json.dumps({"context": f"the state memory {task} {i}", "choices": [" key", " value"],
                                    "label": (n + i) % 2}) + "\n")
        (folder / f"{task}.yaml").write_text(f"""task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    return folder


def test_patterns_expand_as_the_harness_command_line_expands_them(tmp_path):
    """Against the harness's whole task library plus the local folder: each entry's matches in sorted order, the
    first of repeated names kept, in the order the entries come; the same list as the harness's own command line
    (``EvaluatorConfig.process_tasks``) makes of the same entries."""
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks import TaskManager

    from falcon_fwa.eval.harness import expand_tasks

    tasks = _write_local_tasks(tmp_path / "tasks")
    manager = TaskManager(include_path=str(tasks))
    entries = ["fwapat_b*", "fwa*_gamma", "fwapat_*", "arc_e?sy", "fwapat_[ab]lpha"]
    # by hand: fwapat_b* -> beta; fwa*_gamma -> gamma; fwapat_* -> alpha, beta (beta already there);
    # arc_e?sy -> the harness's arc_easy; fwapat_[ab]lpha -> alpha (already there)
    want = ["fwapat_beta", "fwaother_gamma", "fwapat_alpha", "arc_easy"]
    assert expand_tasks(manager, entries) == want
    harness_cli = EvaluatorConfig(tasks=",".join(entries), include_path=str(tasks))
    harness_cli.process_tasks()
    assert harness_cli.tasks == want
    # a plain name is itself; a YAML file of a task is kept as its path
    assert expand_tasks(manager, ["fwapat_beta", str(tasks / "fwapat_alpha.yaml")]) == [
        "fwapat_beta", str(tasks / "fwapat_alpha.yaml")]


def test_entries_that_match_nothing_are_refused_naming_tasks_and_the_close_names(tmp_path, capsys):
    """The refusal comes before the model folder is read (this one holds no tokenizer) and names every entry that
    matches nothing; ``'fwapta_*'`` is a misspelt ``fwapat_*``: its close names are the two tasks that pattern
    matches (``difflib``'s ratio 2 * 6 matching characters / 19 for ``fwapat_beta``, / 20 for
    ``fwapat_alpha``; 2 * 5 / 22 for ``fwaother_gamma``, below the 0.6 cutoff), none for ``nope_zzz``."""
    from falcon_fwa.cli import main

    tasks = _write_local_tasks(tmp_path / "tasks")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main(["lm-eval", "--model", str(folder), "--tasks", "fwapat_*,fwapta_*,nope_zzz",
                 "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert ("falcon-fwa lm-eval: error: --tasks: unknown 'fwapta_*', 'nope_zzz': each entry is a task, group or tag "
            "name, or a pattern of them such as arc_* or hellaswag*, and must match at least one; close matches of "
            "'fwapta_*': fwapat_beta, fwapat_alpha\n") in err, err
    # without --include-path the local tasks are unknown to the harness: the pattern matches nothing
    assert main(["lm-eval", "--model", str(folder), "--tasks", "fwapat_*"]) == 2
    err = capsys.readouterr().err
    assert "--tasks: unknown 'fwapat_*' (local task YAML files need --include-path): each entry" in err, err


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Falcon trained for one step through the ``train`` command and exported."""
    from falcon_fwa.train.cli import main

    tmp = tmp_path_factory.mktemp("lm")
    assert main(["--config", tiny_lm_recipe(tmp)]) == 0
    return tmp / "run" / "model"


def test_a_pattern_runs_the_tasks_it_matches_and_the_results_record_them(model_folder, tmp_path, monkeypatch):
    """``--tasks 'fwapat_*'`` runs fwapat_alpha and fwapat_beta and not fwaother_gamma; the results JSON's
    ``tasks`` is that expanded list, while its provenance keeps the option as given. From Python the same."""
    import lm_eval.tasks

    from falcon_fwa.cli import main
    from falcon_fwa.eval.harness import evaluate

    # the tasks are local: skip indexing the harness's own task library (most of the run time)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    tasks = _write_local_tasks(tmp_path / "tasks")
    out = tmp_path / "res.json"
    assert main(["lm-eval", "--model", str(model_folder), "--tasks", "fwapat_*", "--include-path", str(tasks),
                 "--device", "cpu", "--out", str(out)]) == 0
    res = json.load(open(out))
    assert res["tasks"] == ["fwapat_alpha", "fwapat_beta"]
    assert sorted(res["results"]) == ["fwapat_alpha", "fwapat_beta"]
    assert res["provenance"]["options"]["tasks"] == "fwapat_*"
    results = evaluate(str(model_folder), ["fwaother_gamma", "fwa*a"], include_path=str(tasks))
    assert results["tasks"] == ["fwaother_gamma", "fwapat_alpha", "fwapat_beta"]
    assert sorted(results["results"]) == ["fwaother_gamma", "fwapat_alpha", "fwapat_beta"]

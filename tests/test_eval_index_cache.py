"""``evaluate()`` builds lm-evaluation-harness's task index (its ``TaskManager``, seconds for the harness's own
task library) once per process for each include folder: a second call with the same folder reuses it and scores
the same, another folder gets an index of its own, and a folder whose task YAML files changed since gets a new one
that knows the new task."""
import collections
import json

import pytest
from conftest import tiny_lm_recipe

pytest.importorskip("lm_eval")

pytestmark = pytest.mark.usefixtures("one_thread")


def _write_task(folder, task, label_shift=0):
    """A multiple-choice task of two documents (its data file and YAML file) in ``folder``."""
    folder.mkdir(exist_ok=True)
    data = folder / f"{task}.jsonl"
    with open(data, "w") as f:
        for i in range(2):
            f.write(json.dumps({"context": f"the state memory {task} {i}", "choices": [" key", " value"],
                                "label": (i + label_shift) % 2}) + "\n")
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


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Falcon trained for one step through the ``train`` command and exported."""
    from falcon_fwa.train.cli import main

    tmp = tmp_path_factory.mktemp("lm")
    assert main(["--config", tiny_lm_recipe(tmp)]) == 0
    return tmp / "run" / "model"


@pytest.fixture
def builds(monkeypatch):
    """The include path of every ``TaskManager`` built from here on (each of the local tasks alone: the harness's
    own library is not indexed), and no index kept from before."""
    import lm_eval.tasks

    from falcon_fwa.eval import harness

    real, seen = lm_eval.tasks.TaskManager, []

    def counted(*args, **kwargs):
        seen.append(kwargs.get("include_path"))
        return real(*args, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", counted)
    monkeypatch.setattr(harness, "_TASK_MANAGERS", collections.OrderedDict(), raising=False)
    return seen


def _scores(results, task):
    """Per document: its two choices' log-likelihoods, in document order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def test_a_second_call_with_the_same_include_path_reuses_the_index(model_folder, tmp_path, builds):
    from falcon_fwa.eval.harness import evaluate

    a = str(_write_task(tmp_path / "a", "fwacache_one"))
    first = evaluate(str(model_folder), ["fwacache_one"], include_path=a, log_samples=True)
    second = evaluate(str(model_folder), ["fwacache_one"], include_path=a, log_samples=True)
    assert builds == [a]  # one index for both calls
    assert second["tasks"] == first["tasks"] == ["fwacache_one"]
    assert _scores(second, "fwacache_one") == _scores(first, "fwacache_one")
    assert second["results"]["fwacache_one"]["acc,none"] == first["results"]["fwacache_one"]["acc,none"]
    # the same folder spelt otherwise (a trailing separator) is the same folder
    evaluate(str(model_folder), ["fwacache_one"], include_path=a + "/")
    assert builds == [a]


def test_another_include_path_gets_its_own_index(model_folder, tmp_path, builds):
    from falcon_fwa.eval.harness import evaluate

    a = str(_write_task(tmp_path / "a", "fwacache_one"))
    b = str(_write_task(tmp_path / "b", "fwacache_two", label_shift=1))
    evaluate(str(model_folder), ["fwacache_one"], include_path=a)
    out = evaluate(str(model_folder), ["fwacache_two"], include_path=b)
    assert builds == [a, b]
    assert out["tasks"] == ["fwacache_two"] and list(out["results"]) == ["fwacache_two"]
    # b's index knows only b's task (not a's, as one index shared by both folders would)
    with pytest.raises(ValueError, match="unknown 'fwacache_one'"):
        evaluate(str(model_folder), ["fwacache_one"], include_path=b)
    assert builds == [a, b]
    evaluate(str(model_folder), ["fwacache_one"], include_path=a)  # a's is still there
    assert builds == [a, b]


def test_a_task_added_to_the_folder_gets_a_new_index_that_knows_it(model_folder, tmp_path, builds):
    from falcon_fwa.eval.harness import evaluate

    a = tmp_path / "a"
    _write_task(a, "fwacache_one")
    evaluate(str(model_folder), ["fwacache_one"], include_path=str(a))
    _write_task(a, "fwacache_three")
    out = evaluate(str(model_folder), ["fwacache_*"], include_path=str(a))
    assert builds == [str(a), str(a)]
    assert out["tasks"] == ["fwacache_one", "fwacache_three"]
    evaluate(str(model_folder), ["fwacache_three"], include_path=str(a))
    assert builds == [str(a), str(a)]


def test_the_index_without_an_include_path_is_built_once_too(model_folder, builds):
    """Without ``include_path`` (here an index of no task at all): both calls refuse the unknown name from one
    index."""
    from falcon_fwa.eval.harness import evaluate

    for _ in range(2):
        with pytest.raises(ValueError, match="unknown 'fwacache_one'"):
            evaluate(str(model_folder), ["fwacache_one"])
    assert builds == [None]

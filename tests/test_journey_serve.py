"""Evaluating a saved model as after training: a context length (``--max-length``) too short for a task's
requests is refused naming the option, where the harness would stop on a bare assertion; a length that fits
scores the left-truncated context (log-likelihoods and greedy generation against direct computations)."""
import pytest
import torch
from conftest import save_tiny_falcon

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("lm_eval")

EOS = 256  # the byte tokenizer's end-of-text id


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(model, folder) of a tiny random Falcon saved with the byte tokenizer."""
    path = tmp_path_factory.mktemp("journey_serve") / "model"
    return save_tiny_falcon(path), str(path)


def _lm(path, **kwargs):
    from falcon_fwa.eval.harness import lm_class

    return lm_class()(pretrained=path, device="cpu", trust_remote_code=False, batch_size=2, **kwargs)


def _requests(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _log_probs(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double().log_softmax(-1)


def test_a_continuation_longer_than_max_length_is_refused_naming_the_option(folder):
    model, path = folder
    pairs = [("the state", " memory"), ("a fast", " weight memory")]  # continuations of 7 and 14 bytes
    lm = _lm(path, max_length=10, max_length_name="--max-length")
    with pytest.raises(ValueError, match=r"--max-length 10 is shorter than a continuation of 14 tokens "
                                         r"\(' weight memory'\): give a --max-length of at least 14"):
        lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    # at exactly 14 both fit: each is scored after the last max_length + 1 tokens of [eos] + context +
    # continuation, the last of them left out (the harness's left truncation)
    lm = _lm(path, max_length=14)
    got = [g[0] for g in lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)]
    want = []
    for context, continuation in pairs:
        cont = list(continuation.encode())
        full = ([EOS] + list(context.encode()) + cont)[-15:]
        lp = _log_probs(model, full[:-1])
        first = len(full) - 1 - len(cont)
        want.append(sum(float(lp[first + j, t]) for j, t in enumerate(cont)))
    assert got == pytest.approx(want, abs=1e-4)
    assert len([EOS, *b"a fast", *b" weight memory"]) > 15  # the second context was cut, end-of-text included


def test_generation_that_leaves_no_context_is_refused_and_a_short_context_is_cut_from_the_left(folder):
    model, path = folder
    lm = _lm(path, max_length=8, max_length_name="--max-length")
    with pytest.raises(ValueError, match=r"--max-length 8 leaves no tokens of context: the task generates up to 8 "
                                         r"tokens \(max_gen_toks\).*--max-length above 8"):
        lm.generate_until(_requests("generate_until", [("the state", {"until": ["\n\n"], "max_gen_toks": 8})]),
                          disable_tqdm=True)
    # 5 new tokens leave 3 of context: the last 3 tokens of [eos] + prompt, then greedy over the byte ids
    prompts = ["the state", "ab"]
    got = lm.generate_until(_requests("generate_until", [(p, {"until": ["\n\n"], "max_gen_toks": 5,
                                                              "do_sample": False}) for p in prompts]),
                            disable_tqdm=True)
    for prompt, text in zip(prompts, got):
        ids, new = ([EOS] + list(prompt.encode()))[-3:], []
        for _ in range(5):
            t = int(_log_probs(model, ids)[-1, :257].argmax())
            if t == EOS:
                break
            ids.append(t)
            new.append(t)
        assert text == bytes(new).decode("utf-8", errors="replace").split("\n\n")[0]


def test_the_command_names_max_length_where_the_harness_would_assert(folder, tmp_path, monkeypatch, capsys):
    import functools

    import lm_eval.tasks

    from falcon_fwa.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",  # the local task alone: the harness's own are not indexed
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    _, path = folder
    (tmp_path / "mc.jsonl").write_text('{"context": "A function is defined with", "choices": ["def", "class"], '
                                       '"label": 0}\n')
    (tmp_path / "mc.yaml").write_text(f"task: journey_mc\ndataset_path: json\ndataset_kwargs: {{data_files: "
                                      f"{{test: {tmp_path / 'mc.jsonl'}}}}}\ntest_split: test\noutput_type: "
                                      "multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
                                      "doc_to_target: '{{label}}'\nmetric_list: [{metric: acc}]\n")
    capsys.readouterr()
    rc = main(["lm-eval", "--model", path, "--tasks", "journey_mc", "--include-path", str(tmp_path), "--device", "cpu",
               "--max-length", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-length 3 is shorter than a continuation of 6 tokens (' class')" in err, err


def test_a_limit_that_is_neither_a_count_nor_a_fraction_is_refused_by_name(folder, monkeypatch, capsys):
    """The harness reads ``--limit`` below 1 as a fraction of the documents and from 1 as a count, cutting
    ``1.5`` to one document: such a value is named before the harness runs; counts and fractions reach it."""
    import lm_eval.utils

    from falcon_fwa.cli import main
    from falcon_fwa.eval import harness

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    _, path = folder
    calls = []
    monkeypatch.setattr(harness, "evaluate", lambda *a, **k: calls.append(k["limit"]) or {"results": {}})
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda results: "")
    for limit in ("1.5", "2.25", "100000.5"):  # (the value as given: not rounded to six digits, '100000')
        capsys.readouterr()
        assert main(["lm-eval", "--model", path, "--tasks", "x", "--device", "cpu", "--limit", limit]) == 2
        err = capsys.readouterr().err
        assert f"--limit takes a whole number of documents per task or a fraction of them below 1, got {limit}" in err
    assert calls == []
    for limit in ("2", "0.5", "1"):
        assert main(["lm-eval", "--model", path, "--tasks", "x", "--device", "cpu", "--limit", limit]) == 0
    assert calls == [2.0, 0.5, 1.0]

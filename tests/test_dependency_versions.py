"""The package at the old ends of its dependency ranges (torch >= 2.4, transformers >= 4.56; results/compat.md), each
case made here the way that version behaves: a transformers that turns its PyTorch models off for the installed torch
is refused at import by both versions; a Triton older than the kernels take is refused by the kernels' import, and
``backend="auto"`` runs the PyTorch forms; a ``tokenizer.json`` folder loads where ``AutoTokenizer`` wants a model
type (transformers 4); FSDP2 on the CPU with torch 2.4 is refused by the strategy."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

# transformers decides at run time whether its PyTorch models are on; the child process makes it decide "off" the
# way it does for a torch below its minimum, then imports the package as a user would.
_TORCH_OFF = """
import transformers.utils
transformers.utils.is_torch_available = lambda: False
import falcon_fwa
"""


def test_import_refuses_transformers_that_turned_torch_off():
    run = subprocess.run([sys.executable, "-c", _TORCH_OFF], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: falcon_fwa needs transformers' PyTorch models")
    assert f"transformers {transformers.__version__}" in last and f"torch {torch.__version__}" in last
    assert "pip install 'transformers>=4.56,<5'" in last


def test_import_goes_through_where_transformers_has_torch():
    from transformers.utils import is_torch_available
    assert is_torch_available()
    run = subprocess.run([sys.executable, "-c", "import falcon_fwa; print(falcon_fwa.FalconForCausalLM.__name__)"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "FalconForCausalLM"


# Triton's version is read when the kernels' package is imported; the child process sets it as torch 2.5's pinned
# Triton reports it, then runs the op through Triton's interpreter (CPU tensors).
_OLD_TRITON = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import triton
triton.__version__ = "3.1.0"
import torch
from falcon_fwa import falcon_attention
g = torch.Generator().manual_seed(0)
q, k = torch.randn(2, 1, 6, 2, 4, generator=g)
v = torch.randn(1, 6, 2, 3, generator=g)
beta, lam = torch.rand(2, 1, 6, 2, generator=g)
auto = falcon_attention(q, k, v, beta=beta, lam=lam, rule="1", backend="auto")
ref = falcon_attention(q, k, v, beta=beta, lam=lam, rule="1", backend="torch")
assert torch.equal(auto[0], ref[0])
try:
    falcon_attention(q, k, v, beta=beta, lam=lam, rule="1", backend="triton")
except ImportError as e:
    print(e)
    sys.exit(0)
sys.exit("backend='triton' ran with triton 3.1.0")
"""


def test_kernels_refuse_a_triton_older_than_their_floor_and_auto_runs_the_pytorch_forms():
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _OLD_TRITON], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    message = run.stdout.strip()
    assert message.startswith("falcon_fwa's Triton kernels need triton >= 3.2 (checked on GPUs with 3.6)")
    assert "triton 3.1.0 is installed" in message and "backend='auto' runs the PyTorch forms" in message


@pytest.mark.parametrize("version,release", [("3.6.0", (3, 6)), ("3.2.0+git1a2b3c", (3, 2)), ("3.10.1", (3, 10)),
                                             ("2.3.1", (2, 3)), ("nightly", (0, 0))])
def test_triton_release_is_read_as_numbers(version, release):
    from falcon_fwa.ops.kernel_limits import MIN_TRITON, _release
    assert _release(version) == release
    assert (_release(version) < MIN_TRITON) == (release < (3, 2))


def _refused_as_by_transformers_4(*args, **kwargs):
    raise ValueError("Unrecognized model in the folder. Should have a `model_type` key in its config.json")


def _tokenizer_json(folder):
    """A folder holding a byte-level BPE ``tokenizer.json`` made with the ``tokenizers`` library, and that object."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # transformers 4 would turn it off
    tok.train_from_iterator(["the cat sat on the mat", "a cat and a hat"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return tok


def test_a_tokenizer_json_folder_loads_where_autotokenizer_wants_a_model_type(tmp_path, monkeypatch):
    """transformers 4's ``AutoTokenizer`` refuses a folder of ``tokenizer.json`` and a ``tokenizer_config.json`` that
    names no class (it looks for one in a ``config.json``); such a folder loads as the fast tokenizer it holds,
    as transformers 5 loads it, with the same checks after: the end-of-text token named, and, without
    ``tokenizer_config.json``, refused for having none. A folder naming another class keeps AutoTokenizer's error."""
    import json

    import transformers

    from falcon_fwa.data.tokenizer import load_tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _refused_as_by_transformers_4)
    folder = tmp_path / "tok"
    made = _tokenizer_json(folder)
    with pytest.raises(ValueError, match="defines no eos_token"):
        load_tokenizer(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(folder))
    text = "the hat sat on a cat"
    assert tok(text, add_special_tokens=False)["input_ids"] == made.encode(text).ids
    assert (tok.eos_token_id, len(tok)) == (made.token_to_id("</s>"), made.get_vocab_size())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "tokenizer_class": "BertTokenizer"}))
    with pytest.raises(ValueError, match="loading .* failed: Unrecognized model in the folder"):
        load_tokenizer(str(folder))


def test_fsdp2_on_the_cpu_with_torch_2_4_is_refused_by_the_strategy(monkeypatch):
    """torch 2.4's FSDP2 opens CUDA streams when it shards: on the CPU it failed deep inside the first step with a
    CUDA driver error (seen with torch 2.4.1). The trainer refuses it first, naming ``train.strategy``; on a CUDA
    device, and with a newer torch, nothing is refused here."""
    from falcon_fwa.train import distributed
    from falcon_fwa.train.distributed import DistInfo

    sharded = []
    monkeypatch.setattr(distributed, "_fully_shard", lambda: lambda module, mesh: sharded.append(module))
    monkeypatch.setattr("torch.distributed.device_mesh.init_device_mesh", lambda *a, **k: "mesh")
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    with pytest.raises(RuntimeError, match=r"^train\.strategy='fsdp2' on the CPU: the FSDP2 of torch 2\.4\.1\+cu121 "
                                           r"opens CUDA streams"):
        distributed.wrap(model, DistInfo(0, 2, 0, torch.device("cpu"), "fsdp2"))
    assert sharded == []
    assert distributed.wrap(model, DistInfo(0, 2, 0, torch.device("cuda", 0), "fsdp2")) is model
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    assert distributed.wrap(model, DistInfo(0, 2, 0, torch.device("cpu"), "fsdp2")) is model
    assert len(sharded) == 6  # each block, then the root, in both runs

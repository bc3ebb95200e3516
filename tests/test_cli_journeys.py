"""Command-line journeys end to end: option combinations that would be silently ignored are refused, naming
the options, before any model loads or any step trains."""
import pytest

from falcon_fwa import cli
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.models import FalconForCausalLM, get_preset


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """An untrained tiny Falcon with the byte tokenizer, saved as ``train`` exports one."""
    folder = tmp_path_factory.mktemp("journeys") / "model"
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("options, named", [
    (["--top-k", "5"], "--top-k"),
    (["--top-p", "0.9"], "--top-p"),
    (["--temperature", "0", "--top-k", "50", "--top-p", "0.95"], "--top-k"),
])
def test_generate_refuses_sampling_filters_with_greedy_decoding(model_folder, tmp_path, capsys, monkeypatch,
                                                                options, named):
    """--top-k and --top-p only shape a draw; greedy decoding (temperature 0, the default) takes the most likely
    token whatever they say, so a command asking for both gets an error naming the filter, not greedy output."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    out = tmp_path / "gen.json"
    status = cli.main(["generate", "--model", model_folder, "--device", "cpu", "--prompt", "a",
                       "--max-new-tokens", "2", "--json", str(out), *options])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"falcon-fwa generate: error: {named}") and "--temperature" in err
    assert not out.exists()


def test_generate_takes_the_filters_when_sampling(model_folder, tmp_path):
    out = tmp_path / "gen.json"
    assert cli.main(["generate", "--model", model_folder, "--device", "cpu", "--prompt", "a", "--max-new-tokens",
                     "2", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--json", str(out)]) == 0
    assert out.exists()

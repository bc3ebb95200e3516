"""Decoding steps replayed from a CUDA graph (``serve.graphs``) give the eager steps' tokens and logits."""
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.serve import generate_text
from falcon_fwa.serve.graphs import GraphedDecoder, graphable

CUDA = torch.cuda.is_available()
CASES = {"falcon-1A": ("falcon", {}), "falcon-1": ("falcon", {"rule": "1"}),
         "falcon-3A": ("falcon", {"rule": "3A", "window": 3}), "falcon-2": ("falcon", {"rule": "2"}),
         "falcon-3A-normalized-read": ("falcon", {"rule": "3A", "window": 3, "eps_attn": 1e-3,
                                                  "feature_map": "elu1", "qk_norm": "none"}),
         "mamba2": ("mamba2", {}), "retnet": ("retnet", {}), "gated_deltanet": ("gated_deltanet", {})}


def _model(mixer, overrides, device="cpu"):
    torch.manual_seed(0)
    config = get_preset(f"tiny-{mixer}", vocab_size=320, initializer_range=0.5, **overrides)
    return FalconForCausalLM(config).to(device).eval()


def test_on_a_cpu_steps_are_eager_and_the_reason_is_recorded():
    model = _model("falcon", {})
    assert graphable(model, torch.device("cpu")) == (False, "CUDA graphs need a CUDA device")
    assert graphable(_model("transformer", {}), torch.device("cuda"))[0] is False
    out = generate_text(model, byte_tokenizer(), ["state"], max_new_tokens=4, stop_at_eos=False)
    assert out.timing.decode_mode == "eager" and "CUDA" in out.timing.graph_note
    with pytest.raises(ValueError, match="cuda_graphs=True is not possible"):
        generate_text(model, byte_tokenizer(), ["state"], max_new_tokens=4, cuda_graphs=True)


def test_command_refuses_cuda_graphs_on_a_cpu(tmp_path, capsys):
    from falcon_fwa.cli import main

    model = _model("falcon", {})
    model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "x", "--device", "cpu",
                 "--cuda-graphs", "on"]) == 2
    assert "--cuda-graphs on needs a CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_graphed_steps_equal_eager_steps(case):
    """Step by step over a left-padded prefilled cache: the graph's logits are the eager call's, and
    the cache it updated in place continues eagerly as the eager cache does."""
    mixer, overrides = CASES[case]
    model = _model(mixer, overrides, "cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (3, 9), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :2] = 0
    with torch.inference_mode():
        outs = [model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1) for _ in range(2)]
        eager_cache, graph_cache = (getattr(o, "cache", None) or o.past_key_values for o in outs)
        decoder = GraphedDecoder(model, graph_cache, 3)
        token = outs[0].logits[:, -1].argmax(-1)
        for _ in range(12):
            want = model(input_ids=token[:, None], past_key_values=eager_cache, use_cache=True,
                         logits_to_keep=1).logits[:, -1]
            got = decoder.step(token)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            token = want.argmax(-1)
        assert graph_cache.num_positions == eager_cache.num_positions == 9 + 12
        assert torch.equal(graph_cache.seen, eager_cache.seen)
        nxt = token[:, None]
        a = model(input_ids=nxt, past_key_values=eager_cache, use_cache=True).logits
        b = model(input_ids=nxt, past_key_values=graph_cache, use_cache=True).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_generate_text_with_graphs_equals_eager_and_falls_back_for_the_transformer():
    tok = byte_tokenizer()
    prompts = ["fast weights", "a state", "the online learner reads"]
    model = _model("falcon", {"rule": "3A", "window": 3}, "cuda")
    kw = dict(max_new_tokens=40, batch_size=3, stop_at_eos=False)
    graphed = generate_text(model, tok, prompts, cuda_graphs=True, **kw)
    eager = generate_text(model, tok, prompts, cuda_graphs=False, **kw)
    assert graphed.timing.decode_mode == "cuda graph" and eager.timing.decode_mode == "eager"
    assert [c.token_ids for c in graphed.completions] == [c.token_ids for c in eager.completions]
    assert len(set(graphed.completions[0].token_ids)) > 4
    out = generate_text(_model("transformer", {}, "cuda"), tok, prompts, **kw)
    assert out.timing.decode_mode == "eager" and "key/value" in out.timing.graph_note

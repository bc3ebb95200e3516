"""Models built on the meta device, against models built the ordinary way: ``with torch.device("meta")`` then
``to_empty`` and ``init_weights()`` (FSDP2's flow, with ``fully_shard`` before ``to_empty`` too) gives the
same starting parameters as ``FalconForCausalLM(config)`` (the deterministic ones equal, the drawn ones of the
same distribution), ``from_pretrained(low_cpu_mem_usage=True)`` the saved tensors and outputs, and a forward on
the meta device the shapes of a real forward (or an error naming the argument whose values it would need)."""
import os

import pytest
import torch

from falcon_fwa.models import FalconForCausalLM, get_preset

# Every Falcon rule (the per-column ones have gate offsets of another width) and the five baselines.
FAMILIES = [("falcon", {"rule": r}) for r in ("1", "2", "3", "1A", "2A", "3A")] + \
           [(m, {}) for m in ("transformer", "deltanet", "gated_deltanet", "mamba2", "retnet")]
FAMILY_IDS = [f"falcon-{o['rule']}" if m == "falcon" else m for m, o in FAMILIES]

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(mixer, overrides, **more):
    return get_preset(f"tiny-{mixer}", **{**overrides, **more})


def _built(config, seed):
    torch.manual_seed(seed)
    return FalconForCausalLM(config)


def _check_like(config, got, parts=1):
    """``got`` (name -> tensor) against two models built the ordinary way with different seeds: a tensor equal in
    both (norm gains, gate offsets, decays, ``D``) must be equal in ``got``; a drawn one must have the shape, the
    mean and the spread of the first (memory left as ``to_empty`` made it would not). ``parts``: the drawn
    tensors hold that many repeats of independent draws (the estimates' errors grow by its square root)."""
    ref, other = _built(config, 0).state_dict(), _built(config, 1).state_dict()
    assert set(got) == set(ref)
    drawn = 0
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape and g.dtype == r.dtype, name
        if torch.equal(r, other[name]):
            assert torch.equal(g, r), name
            continue
        drawn += 1
        n, s = r.numel() / parts, float(r.std())
        assert abs(float(g.std()) / s - 1) < 5 / (2 * n) ** 0.5 + 0.05, name
        assert abs(float(g.mean())) < 5 * s / n ** 0.5, name
        assert float(g.abs().max()) < 7 * s, name
    assert drawn >= 6  # the embedding and every block's matrices are drawn


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("mixer,overrides", FAMILIES, ids=FAMILY_IDS)
def test_built_on_meta_then_materialized_starts_as_a_model_built_on_the_cpu(mixer, overrides, tie):
    config = _config(mixer, overrides, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = FalconForCausalLM(config)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    _check_like(config, {k: v.detach() for k, v in model.state_dict().items()})
    assert model.get_output_embeddings() is None if tie else model.lm_head.weight is not model.model.embed_tokens.weight


def test_initialized_on_meta_as_transformers_4_builds_then_materialized_starts_as_a_model_built_on_the_cpu():
    """transformers 4 runs the weight initialization when a model is built, on the meta device too, and marks every
    module done there; ``init_weights()`` after ``to_empty`` must still set and draw every value (nothing was set on
    meta), not leave the memory as ``to_empty`` made it."""
    config = _config("falcon", {"rule": "2"})
    with torch.device("meta"):
        model = FalconForCausalLM(config)
    model.initialize_weights()  # what transformers 4's post_init does on the meta device
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    _check_like(config, {k: v.detach() for k, v in model.state_dict().items()})


def _fsdp2_meta_init(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from falcon_fwa.train.distributed import _fully_shard  # torch.distributed.fsdp's from torch 2.6, 2.4's own place

    fully_shard = _fully_shard()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        states = {}
        for (mixer, overrides), name in zip(FAMILIES, FAMILY_IDS):
            with torch.device("meta"):
                model = FalconForCausalLM(_config(mixer, overrides))
            for block in model.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            model.init_weights()
            states[name] = {k: v.full_tensor().detach() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(states, os.path.join(out_dir, "states.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_on_meta_then_materialized_starts_as_a_model_built_on_the_cpu(tmp_path):
    # the gate offsets and decays are copied into the sharded parameters: each process keeps its part. On a CPU
    # mesh each process draws its part of a matrix from its own generator, so the two parts, seeded alike, repeat
    import torch.multiprocessing as mp

    mp.spawn(_fsdp2_meta_init, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    states = torch.load(tmp_path / "states.pt")
    for (mixer, overrides), name in zip(FAMILIES, FAMILY_IDS):
        _check_like(_config(mixer, overrides), states[name], parts=2)


@pytest.mark.parametrize("mixer,overrides", FAMILIES, ids=FAMILY_IDS)
def test_low_cpu_mem_usage_loads_the_saved_model(tmp_path, mixer, overrides):
    from transformers import AutoModelForCausalLM

    saved = _built(_config(mixer, overrides, tie_word_embeddings=False), 3).eval()
    saved.save_pretrained(tmp_path)
    ids = torch.randint(0, saved.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = saved(ids, use_cache=False).logits
        torch.manual_seed(5)  # another seed than the saved model's: a parameter not loaded would differ
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, low_cpu_mem_usage=True).eval()
        assert not any(p.is_meta for p in loaded.parameters())
        state = loaded.state_dict()
        assert set(state) == set(saved.state_dict())
        for name, value in saved.state_dict().items():
            assert torch.equal(state[name], value), name
        assert torch.equal(loaded(ids, use_cache=False).logits, expected)


def _outputs(model, device):
    """Shapes and dtypes of a forward with labels and every block's input, a cached prompt, a decoding step
    continuing it, a forward of embeddings, and the gradients of the loss, run on ``device``."""
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    out = model(ids, labels=ids, use_cache=False, output_hidden_states=True)
    seen = {"logits": out.logits, "loss": out.loss, **{f"hidden{i}": h for i, h in enumerate(out.hidden_states)}}
    out.loss.backward()
    seen.update({f"grad {n}": p.grad for n, p in model.named_parameters()})
    with torch.no_grad():
        prompt = model(ids, use_cache=True)
        cache = getattr(prompt, "cache", None) or prompt.past_key_values
        seen["step"] = model(ids[:, -1:], cache=cache, use_cache=True).logits
        seen["last"] = model(ids, use_cache=False, logits_to_keep=1).logits
        seen["embeds"] = model(inputs_embeds=torch.ones(2, 5, 32, device=device), use_cache=False).logits
    return {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in seen.items()}


@pytest.mark.parametrize("mixer,overrides", FAMILIES, ids=FAMILY_IDS)
def test_a_forward_on_meta_gives_the_shapes_of_a_forward_on_the_cpu(mixer, overrides):
    # the value checks of input_ids and labels (token ids in the vocabulary) have no values to read there
    config = _config(mixer, overrides)
    with torch.device("meta"):
        model = FalconForCausalLM(config)
    got = _outputs(model, "meta")
    expected = _outputs(_built(config, 0), "cpu")
    assert got == {k: (shape, dtype, "meta") for k, (shape, dtype, _) in expected.items()}


@pytest.mark.parametrize("mask_on", ["meta", "cpu"])
def test_on_meta_a_mask_or_packed_offsets_are_refused_by_name(mask_on):
    # which tokens are pads or where documents start is read from these values
    with torch.device("meta"):
        model = FalconForCausalLM(_config("falcon", {}))
    ids = torch.zeros(1, 6, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"^attention_mask: .*meta device"):
        model(ids, attention_mask=torch.ones(1, 6, dtype=torch.long, device=mask_on), use_cache=False)
    with pytest.raises(ValueError, match=r"^cu_seqlens: .*meta device"):
        model(ids, cu_seqlens=torch.tensor([0, 2, 6], device=mask_on), use_cache=False)
    with pytest.raises(ValueError, match=r"attention_mask must have shape"):  # its shape is still checked first
        model(ids, attention_mask=torch.ones(1, 7, dtype=torch.long, device=mask_on), use_cache=False)

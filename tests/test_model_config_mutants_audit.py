"""``FalconConfig`` and ``count_parameters`` at the edges the presets do not reach: an untied output head is
counted with the embedding (the parameter groups of a Transformer computed by hand from its shapes, tied and
untied); each head dim left unset is ``hidden_size / num_heads`` whatever the other is set to; ``decay_floor``
lies in the open interval (0, 1), so 1 is refused by name when the config is built and when it is assigned
afterwards; a Transformer of one-wide heads has an odd head dim and is refused; and the muP width multiplier
is the true quotient ``hidden_size / mup_base_width`` also where the base does not divide the width."""
import pytest

from falcon_fwa.models import FalconConfig, count_parameters, get_preset

SMALL = dict(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1)


@pytest.mark.parametrize("tied", [True, False])
def test_a_transformers_parameter_groups_are_its_shapes_counted_by_hand(tied):
    V, d, L, inter = 80, 32, 3, 96
    cfg = get_preset("tiny-transformer", vocab_size=V, hidden_size=d, num_hidden_layers=L, intermediate_size=inter,
                     tie_word_embeddings=tied)
    want = dict(embedding=V * d * (1 if tied else 2),  # the input embedding, and the output head when untied
                mixer=L * 4 * d * d,  # q, k, v, o
                mlp=L * 3 * d * inter,  # SwiGLU: gate, up, down
                norms=(2 * L + 1) * d)  # two Pre-Norms per block and the final norm
    want["total"] = sum(want.values())
    assert dict(count_parameters(cfg)) == want


def test_an_untied_head_adds_one_vocabulary_by_width_matrix_to_the_embedding_group():
    tied = count_parameters(get_preset("tiny-falcon"))
    untied = count_parameters(get_preset("tiny-falcon", tie_word_embeddings=False))
    V, d = 64, 32
    assert untied["embedding"] - tied["embedding"] == V * d
    assert untied["total"] - tied["total"] == V * d
    assert {k: untied[k] for k in ("mixer", "mlp", "norms")} == {k: tied[k] for k in ("mixer", "mlp", "norms")}


@pytest.mark.parametrize("given", [dict(head_k_dim=8), dict(head_v_dim=8), dict(head_k_dim=24, head_v_dim=None)])
def test_a_head_dim_left_unset_is_the_width_over_the_heads(given):
    cfg = FalconConfig(**SMALL, mixer="deltanet", **given)
    for field in ("head_k_dim", "head_v_dim"):
        assert getattr(cfg, field) == (given.get(field) or 32 // 2), field
    assert cfg.query_scale == pytest.approx(cfg.head_k_dim ** -0.5)  # deltanet's scale follows the key dim


def test_a_decay_floor_of_one_is_refused_built_and_assigned():
    with pytest.raises(ValueError, match="'decay_floor' must lie in \\(0, 1\\), got 1.0"):
        FalconConfig(**SMALL, decay_floor=1.0)
    cfg = FalconConfig(**SMALL, decay_floor=0.999)
    assert cfg.decay_floor == 0.999
    cfg.decay_floor = 1.0
    with pytest.raises(ValueError, match="'decay_floor' must lie in \\(0, 1\\)"):
        cfg.validate_fields()


@pytest.mark.parametrize("width", [1, 2, 3])
def test_a_transformer_of_one_wide_heads_has_an_odd_head_dim_and_is_refused(width):
    with pytest.raises(ValueError, match="'num_heads' = .* odd head dim"):
        FalconConfig(vocab_size=64, hidden_size=width, num_heads=width, num_hidden_layers=1, mixer="transformer")
    assert FalconConfig(vocab_size=64, hidden_size=2 * width, num_heads=width, num_hidden_layers=1,
                        mixer="transformer").head_k_dim == 2


@pytest.mark.parametrize("width, base, m", [(96, 64, 1.5), (80, 64, 1.25), (48, 96, 0.5), (768, 256, 3.0)])
def test_the_width_multiplier_is_the_width_over_the_base_width(width, base, m):
    cfg = FalconConfig(vocab_size=64, hidden_size=width, num_heads=2, num_hidden_layers=1, mup_base_width=base)
    assert cfg.width_multiplier == m
    assert FalconConfig(**SMALL).width_multiplier == 1.0

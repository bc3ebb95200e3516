"""The write gain of the ``ctx-eta`` gate held to its documented formula at every ridge scale, against a float64
reference written here: ``eta-bar_t = c * sigmoid(w^T h_t + b)`` with ``c = min(1, 2 / (1 + lambda_scale))``,
passed as ``beta_t = eta-bar_t (1 + lambda-bar_t)``. Below ``lambda_scale = 1`` (and with no ridge at all) the
cap is 1, so the normalized step never exceeds one inverse write energy; above it the cap falls as
``2 / (1 + lambda_scale)``, so that ``beta_t <= 2``. And ``LayerCache.num_rows``: the rows a cache holds,
whichever part holds them (the recurrent state, the short-convolution buffers or the keys and values), ``None``
while it holds nothing."""
import pytest
import torch

from falcon_fwa.layers import ContextGates, LayerCache
from falcon_fwa.ops import FalconState

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


def _sigmoid(z):
    return 1.0 / (1.0 + torch.exp(-z))


@pytest.mark.parametrize("scale,cap", [(0.0, 1.0), (0.25, 1.0), (1.0, 1.0), (3.0, 0.5)])
def test_ctx_eta_gain_is_the_capped_normalized_step_times_one_plus_the_ridge(scale, cap):
    """``beta = min(1, 2 / (1 + s)) sigmoid(W_g h + b_g) (1 + s sigmoid(W_l h + b_l))``, the cap written out by
    hand for each ``s``; with gain pre-activations pushed to +-8 the largest ``eta-bar`` comes within 1e-3 of
    the cap, so a cap above it (``2 / (1 + s)`` taken alone below ``s = 1``) shows in the values."""
    torch.manual_seed(0)
    H, D = 3, 8
    gates = ContextGates(D, H, 4, gate="ctx-eta", log_gate="none", lambda_scale=scale, per_column=False).double()
    with torch.no_grad():
        gates.gain_bias.copy_(torch.tensor([8.0, 0.0, -8.0], dtype=F64))
    h = torch.randn(2, 5, D, dtype=F64)
    with torch.no_grad():
        beta, lam, log_gate = gates(h)
        eta_bar = cap * _sigmoid(h @ gates.gain_proj.weight.T + gates.gain_bias)
        if scale > 0:
            want_lam = scale * _sigmoid(h @ gates.lam_proj.weight.T + gates.lam_bias)
        else:
            want_lam = torch.zeros(2, 5, H, dtype=F64)
    assert log_gate is None and beta.shape == (2, 5, H)
    torch.testing.assert_close(lam, want_lam, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(beta, eta_bar * (1.0 + want_lam), rtol=1e-12, atol=1e-12)
    assert float((beta / (1.0 + lam)).max()) > cap * (1 - 1e-3)
    assert float(beta.max()) <= 2.0


def test_num_rows_counts_the_rows_of_whatever_part_the_cache_holds():
    """An empty cache holds no rows yet (``None``: the first call fills it); a state, short-convolution buffers
    or key/value buffers alone each give their own first dimension."""
    assert LayerCache().num_rows is None
    state = FalconState(rule="1A", window=1, shift=True, S=torch.zeros(2, 1, 3, 3, dtype=F64))
    assert LayerCache(state=state).num_rows == 2
    assert LayerCache(conv={"k": torch.zeros(4, 3, 5, dtype=F64)}).num_rows == 4
    keys = torch.zeros(3, 2, 6, 4, dtype=F64)
    assert LayerCache(keys=keys, values=keys.clone(), lengths=[6, 2, 0]).num_rows == 3

"""A layer input modified in place after the layer ran must raise, not give a wrong gradient."""
import pytest
import torch
from torch import nn

import dptrain
from dptrain.testing import attached_engine, clipped_gradient, reference_clipped_gradient


class ResidualInPlace(nn.Module):
    def __init__(self, out_of_place: bool):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.out_of_place = out_of_place

    def forward(self, x):
        h = self.a(x)
        if self.out_of_place:
            h = h + self.b(h)
        else:
            h += self.b(h)  # overwrites b's input after b used it
        return h


def losses_fn(model, x):
    return model(x).square().sum(1)


@pytest.mark.parametrize("mode", dptrain.CLIPPING_MODES)
def test_input_modified_in_place_is_refused(mode, float64):
    torch.manual_seed(0)
    model, x = ResidualInPlace(out_of_place=False), torch.randn(4, 3)
    engine, _ = attached_engine(model, mode=mode, max_grad_norm=1.0, sample_size=10)
    with pytest.raises(RuntimeError, match="modified (in place|by an inplace)"):
        engine.backward(losses_fn(model, x))


@pytest.mark.parametrize("mode", dptrain.CLIPPING_MODES)
def test_out_of_place_residual_is_exact(mode, float64):
    torch.manual_seed(0)
    model, x = ResidualInPlace(out_of_place=True), torch.randn(4, 3)
    ref = reference_clipped_gradient(model, losses_fn, (x,), max_grad_norm=1.0)
    got = clipped_gradient(model, losses_fn, (x,), mode=mode, max_grad_norm=1.0, sample_size=10)
    for name, _ in model.named_parameters():
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-12)

"""The README's custom-layer example works as printed and is exact."""
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.testing import reference_clipped_gradient

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if marker in b)


def test_custom_layer_example_is_exact(float64):
    namespace: dict = {}
    exec(readme_block("class ScaleRule"), namespace)
    Scale = namespace["Scale"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Scale(6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    x, y = torch.randn(5, 2, 4), torch.randint(0, 3, (5, 2))

    def losses_fn(m, x, y):
        return F.cross_entropy(m(x).transpose(1, 2), y, reduction="none").sum(1)

    ref = reference_clipped_gradient(model, losses_fn, (x, y), max_grad_norm=0.5)
    for mode in dptrain.CLIPPING_MODES:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=10, max_grad_norm=0.5,
                                       noise_multiplier=0.0, clipping_mode=mode)
        engine.attach(optimizer)
        engine.backward(losses_fn(model, x, y))
        optimizer.step()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-10, atol=1e-12)
        engine.detach()
        optimizer.zero_grad()

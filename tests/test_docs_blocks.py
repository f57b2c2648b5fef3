"""Code blocks of the docs pages work as printed: docs/layers.md's custom layer is exact."""
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.testing import assert_rule_exact

DOCS = Path(__file__).resolve().parents[1] / "docs"


def docs_block(page: str, marker: str) -> str:
    """The python block of ``docs/<page>`` that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    return next(b for b in blocks if marker in b)


def test_custom_layer_example_is_exact(float64):
    namespace: dict = {}
    exec(docs_block("layers.md", "class ScaleRule"), namespace)  # registers ScaleRule and checks it in every mode
    try:
        _check_in_a_model(namespace["Scale"])
        assert "clipped_grads" not in vars(namespace["ScaleRule"])  # the default one is used
    finally:
        dptrain.unregister_layer(namespace["ScaleRule"])
    assert dptrain.find_rule(namespace["Scale"](2)) is None


def _check_in_a_model(Scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Scale(6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    x, y = torch.randn(5, 2, 4), torch.randint(0, 3, (5, 2))

    def losses_fn(m, x, y):
        return F.cross_entropy(m(x).transpose(1, 2), y, reduction="none").sum(1)

    assert_rule_exact(model, (x, y), losses_fn=losses_fn, max_grad_norm=0.5, atol=1e-12)

"""Hugging Face modules declared (``reads_child_params``) as reading descendants' parameters in their own forward:
the per-sample fallback replays them, exactly (the zoo's classification: float64, every sweep mode, against the
one-sample oracle), and a batch of one is clipped to the bound."""
from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))

import zoo  # noqa: E402
from helpers import Case, engine_clipped_sum  # noqa: E402


def _case(model_type: str, layers: int) -> Case:
    spec = {k: v for k, v in zoo.load_table("hf")[model_type].items() if k != "result"}
    spec["layers"] = layers
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return zoo.hf_case(spec)
    finally:
        torch.set_default_dtype(previous)


# (model type, layers, the class that claims, float32 inside): two layers where a bias computed once is passed on
CLAIMS = [
    ("mpnet", 2, "MPNetEncoder", False),            # relative_attention_bias, looked up once for every layer
    # layer 0's rel_attn_embed, its bias passed on to layer 1 (not batch first); q/k/v/out_proj read by
    # F.multi_head_attention_forward
    ("wavlm", 2, "WavLMEncoder", False),
    ("umt5", 1, "UMT5Attention", True),             # each attention's own relative_attention_bias
    ("gpt_neox_japanese", 1, "GPTNeoXJapaneseLayer", False),  # attention.dense_bias, added by the layer
    ("lfm3", 1, "Lfm3ShortConv", True),             # conv.weight through causal_conv1d_fn
    # the stacks' relative_attention_bias tables, looked up in block 0 and passed on to block 1 (the stacks build
    # their masks with a branch on the mask's values: replayed one sample at a time, vmap cannot run them)
    ("t5", 2, "T5Stack", True),
    ("mt5", 2, "MT5Stack", True),
    ("longt5", 2, "LongT5Stack", True),
    # SEW-D's encoder: rel_embeddings and the LayerNorm on it ([positions, d], no batch), and every layer's
    # query_proj / key_proj, which project the table besides the hidden states
    ("sew-d", 2, "SEWDTransformerEncoder", False),
    # JetMoE's mixtures call their experts on the batch's tokens sorted by expert (the attention reads experts.bias)
    ("jetmoe", 1, "JetMoeAttention", True),
    ("jetmoe", 1, "JetMoeMoE", True),
    # children run on a table without the batch inside the attention: Swin V2's position-bias MLP on the relative
    # coordinates (the attention called on windows folded into the batch), the Conformer's linear_pos
    ("swinv2", 1, "Swinv2SelfAttention", False),
    ("wav2vec2-conformer", 2, "Wav2Vec2ConformerSelfAttention", False),
    # learned positions looked up on [T] ids, added to every sample's embeddings: the encoder and decoder claim them
    ("blenderbot", 2, "BlenderbotDecoder", False),
    ("blenderbot-small", 1, "BlenderbotSmallEncoder", False),
    ("bigbird_pegasus", 1, "BigBirdPegasusDecoder", False),
    # XLNet's layers run sequence-first inside the batch-first model: the model claims every relative attention's
    # parameters (two layers: the relative embeddings and masks passed on)
    ("xlnet", 2, "XLNetModel", False),
    ("switch_transformers", 1, "SwitchTransformersStack", True),  # (its router is float32: one layer builds in float64)
]


@pytest.mark.filterwarnings("ignore:.*one sample at a time:UserWarning")
@pytest.mark.parametrize("model_type,layers,claimer,float32", CLAIMS, ids=[f"{c[0]}-{c[2]}" for c in CLAIMS])
def test_claimed_parameters_are_exact_through_the_fallback(model_type, layers, claimer, float32):
    result = zoo.classify_case(_case(model_type, layers))
    assert result["status"] == "fallback", result
    assert claimer in result["fallback"]
    assert result["max_rel_error"] <= (zoo.FLOAT32_RTOL if float32 else zoo.RTOL)


# A minute or more each on two cores (every token's delta rule replayed one sample at a time): like the zoo sweep's
# slowest models, they run with DPTRAIN_ZOO_ALL=1 (their classification is in tests/zoo_hf.json and docs/models.md)
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DPTRAIN_ZOO_ALL") != "1", reason="a minute or more each: DPTRAIN_ZOO_ALL=1")
@pytest.mark.parametrize("model_type,claimer", [("kimi_linear", "KimiLinearDeltaAttention"),
                                                ("bailing_hybrid", "BailingHybridDeltaAttention")])
def test_delta_attention_conv_is_exact_through_the_fallback(model_type, claimer):
    result = zoo.classify_case(_case(model_type, 1))
    assert result["status"] == "fallback", result
    assert claimer in result["fallback"]


# lfm3 normalises in float32 inside the float64 model: its norms are exact to float32 precision
@pytest.mark.filterwarnings("ignore:.*one sample at a time:UserWarning")
@pytest.mark.parametrize("model_type,layers,rtol", [("mpnet", 2, 1e-9), ("wavlm", 2, 1e-9),
                                                    ("gpt_neox_japanese", 1, 1e-9), ("lfm3", 1, zoo.FLOAT32_RTOL),
                                                    ("t5", 2, zoo.FLOAT32_RTOL), ("sew-d", 2, 1e-9),
                                                    ("jetmoe", 1, zoo.FLOAT32_RTOL), ("swinv2", 1, 1e-9),
                                                    ("wav2vec2-conformer", 2, 1e-9), ("blenderbot", 2, 1e-9),
                                                    ("xlnet", 2, 1e-9)])
def test_a_batch_of_one_is_clipped_to_the_bound(model_type, layers, rtol):
    case = _case(model_type, layers)
    one = Case(case.model, case.losses_fn, tuple(t[:1] for t in case.batch))
    R = 1e-3
    for mode in zoo.SWEEP_MODES:
        got = engine_clipped_sum(one, model=copy.deepcopy(one.model), quiet=True, mode=mode, max_grad_norm=R)
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in got.values()))
        assert 0 < norm <= R * (1 + rtol), (mode, norm)

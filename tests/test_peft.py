"""Parameter-efficient fine-tuning: PEFT LoRA adapters and bias-only fine-tuning (BiTFiT).

Only the adapters (and the heads PEFT keeps trainable with ``modules_to_save``), or only the
biases, are trainable; the frozen weights still carry the output gradients back. Every
clipping mode must give the oracle's clipped gradient in float64, through engine.backward and
(single-backward modes) through a plain loss.backward().
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import dptrain
from dptrain.losses import sequence_losses
from helpers import (
    MODES,
    SINGLE_BACKWARD_MODES,
    Case,
    assert_matches,
    classify,
    engine_clipped_sum,
    spread_init,
    with_oracle,
)

B = 4


def _lm_losses(model, ids, labels):
    return sequence_losses(model(input_ids=ids).logits, labels, shift=True, reduction="mean")


def _gpt2(seed):
    T = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)
    return spread_init(T.GPT2LMHeadModel(cfg))


def _lm_batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (B, 6), generator=g)
    labels = ids.clone()
    labels[0, -2:] = -100
    return ids, labels


def _lora(model, **kwargs):
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, **kwargs))
    with torch.no_grad():  # PEFT starts lora_B at zero, which would make lora_A's gradients zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


def gpt2_lora_case():
    """LoRA on GPT-2's Conv1D attention and MLP projections (fan_in_fan_out)."""
    model = _lora(_gpt2(0), target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    return Case(model, _lm_losses, _lm_batch(0))


def _bert_classifier(seed):
    T = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = T.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=40,
                       max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       num_labels=3)
    return spread_init(T.BertForSequenceClassification(cfg))


def _classify_ids(model, ids, mask, y):
    return F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y, reduction="none")


def _cls_batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (B, 6), generator=g)
    mask = torch.ones(B, 6, dtype=torch.long)
    mask[1, -2:] = 0
    return ids, mask, torch.randint(0, 3, (B,), generator=g)


def bert_lora_case():
    """LoRA on BERT's query/value projections; the classifier head trained in full (SEQ_CLS task)."""
    model = _lora(_bert_classifier(1), target_modules=["query", "value"], task_type="SEQ_CLS")
    return Case(model, _classify_ids, _cls_batch(1))


def _timm_vit(seed):
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    return spread_init(timm.models.VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2,
                                                     mlp_ratio=2.0, num_classes=3, qkv_bias=True))


def _images(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, 16, 16, generator=g), torch.randint(0, 3, (B,), generator=g)


def vit_lora_case():
    """LoRA on a timm ViT's qkv and MLP, a new classification head trained in full."""
    model = _lora(_timm_vit(2), target_modules=["qkv", "fc1", "fc2"], modules_to_save=["head"])
    return Case(model, classify, _images(2))


def bitfit(model):
    """BiTFiT: every weight frozen, every bias trainable."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    return model


def gpt2_bitfit_case():
    return Case(bitfit(_gpt2(3)), _lm_losses, _lm_batch(3))


def bert_bitfit_case():
    return Case(bitfit(_bert_classifier(4)), _classify_ids, _cls_batch(4))


def vit_bitfit_case():
    return Case(bitfit(_timm_vit(5)), classify, _images(5))


CASES = {
    "gpt2-lora": gpt2_lora_case,
    "bert-lora": bert_lora_case,
    "vit-lora": vit_lora_case,
    "gpt2-bitfit": gpt2_bitfit_case,
    "bert-bitfit": bert_bitfit_case,
    "vit-bitfit": vit_bitfit_case,
}

def _double(case: Case) -> Case:
    case.model.double().train()
    return case


@functools.cache
def built(name):
    return with_oracle(lambda: _double(CASES[name]()))


def _engine(case, **kwargs):
    return engine_clipped_sum(case, quiet=True, **kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_only_adapters_or_biases_are_trainable(name):
    case, _, ref = built(name)
    assert ref, "nothing trainable"
    if name.endswith("bitfit"):
        assert all(n.endswith("bias") for n in ref)
    else:
        assert all("lora_" in n or "modules_to_save" in n for n in ref), sorted(ref)
        assert any("lora_A" in n for n in ref) and any("lora_B" in n for n in ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_engine_backward_matches_oracle(name, mode):
    case, R, ref = built(name)
    assert_matches(_engine(case, mode=mode, max_grad_norm=R), ref, what=f"{name} {mode} engine.backward")


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_loss_backward_matches_oracle(name, mode):
    case, R, ref = built(name)
    assert_matches(_engine(case, mode=mode, max_grad_norm=R, path="mean"), ref, what=f"{name} {mode} loss.backward")


def test_lora_on_an_embedding_is_refused_naming_the_adapter_without_the_fallback():
    model = _lora(_gpt2(6), target_modules=["wte", "c_attn"], fan_in_fan_out=True)
    with pytest.raises(ValueError, match="lora_embedding_A"):
        dptrain.validate(model, allow_fallback=False)
    dptrain.validate(model)  # the fallback takes it (exact: tests/test_models_llm.py)

"""Today's open decoder LLM families, from tiny configs with random weights, against the oracle.

Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1-3, OPT, Falcon, GPT-NeoX and Cohere, fully trainable and with LoRA
adapters: every clipping mode through engine.backward(per-sequence losses), and the
single-backward modes through Hugging Face's own loss (``labels=...``) and a plain
``loss.backward()``. They need no fallback: their RMS norms are recognised by structure, and
OPT's positions, Gemma's scaled embedding and Falcon's linear layers have rules (so every
test here runs with ``allow_fallback=False``), except Cohere, whose layer norm only the fallback
covers.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import dptrain
from dptrain.layers import FallbackRule, fallback_modules, resolve_rule
from dptrain.losses import sequence_losses
from dptrain.testing import attached_engine, trainable_named_parameters
from helpers import MODES, SINGLE_BACKWARD_MODES, TWO_PASS_MODES, Case, assert_matches, spread_init, with_oracle
from test_fallback import check_against_oracle

T = pytest.importorskip("transformers")

B, L, V = 4, 6, 48  # B a power of two: Hugging Face's token mean over the batch scales without rounding

_COMMON = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32,
               attn_implementation="sdpa")
_ROPE = dict(intermediate_size=32, num_key_value_heads=1)  # grouped-query attention: 2 query heads, 1 kv head

FAMILIES = {
    # name: (config class, model class, config kwargs, LoRA target modules)
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, _ROPE, ["q_proj", "v_proj"]),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(_ROPE, sliding_window=4), ["q_proj", "v_proj"]),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, _ROPE, ["q_proj", "v_proj"]),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(_ROPE, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=2), ["qkv_proj"]),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(_ROPE, head_dim=8), ["q_proj", "v_proj"]),
    # Gemma 2 has no sdpa path in transformers: eager attention (softmax in float32 inside)
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(_ROPE, head_dim=8, sliding_window=4, attn_implementation="eager"),
               ["q_proj", "v_proj"]),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(_ROPE, head_dim=8, sliding_window=4),
               ["q_proj", "v_proj"]),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(_ROPE, head_dim=8), ["q_proj", "v_proj"]),  # q/k norms
    "opt": (T.OPTConfig, T.OPTForCausalLM, dict(ffn_dim=32, dropout=0.0, layerdrop=0.0, word_embed_proj_dim=16,
                                                pad_token_id=1), ["q_proj", "v_proj"]),
    "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(hidden_dropout=0.0, new_decoder_architecture=False,
                                                         multi_query=True, bias=True, alibi=False),
               ["query_key_value"]),
    "gpt-neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(intermediate_size=32, hidden_dropout=0.0),
                 ["query_key_value"]),
    # CohereLayerNorm is shaped like an RMS norm (one weight, an epsilon) but centres x: its numerical
    # check fails and the per-sample fallback takes it (the only family here that needs the fallback)
    "cohere": (T.CohereConfig, T.CohereForCausalLM, dict(_ROPE, pad_token_id=0, bos_token_id=1, eos_token_id=2),
               ["q_proj", "v_proj"]),
}
NEEDS_FALLBACK = {"cohere"}

# OPT's decoder layers fold the tokens into the batch for their feed-forward block
# (hidden_states.reshape(-1, d) before final_layer_norm, fc1 and fc2): the engine refuses those
# layers while trainable (they would be clipped per token, not per sequence), so OPT is tested
# with them frozen (its learned positions stay trainable) and with LoRA on the attention.
FOLDED_FFN = ("final_layer_norm", "fc1", "fc2")
VARIANTS = [(name, "frozen-ffn" if name == "opt" else "full") for name in FAMILIES] + [
    (name, "lora") for name in FAMILIES] + [("llama", "lora-embedding")]
# LoRA on the token embedding: PEFT keeps lora_embedding_A/B in ParameterDicts that its Embedding reads
# in its own forward; the per-sample fallback takes that module with its containers' parameters.
NEEDS_FALLBACK_VARIANTS = {"lora-embedding"}

# Their RMS norms compute in float32 inside a float64 model: a second backward of sum_i C_i L_i rounds
# C_i-scaled gradients there (see tests/test_fallback.py, check_against_oracle).
FLOAT32_INSIDE = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "cohere"}
# Gemma's norm scales by (1 + weight) in float32, so autograd (the oracle) sums its weight gradient
# over the tokens in float32; the rule sums the same products in float64. Cohere's layer norm does too:
# the fallback then sums per sample in float32, exactly as the oracle, but a re-weighted backward sums
# over the whole batch. Only float32 rounding, in these modes:
FLOAT32_GRADIENT = {"gemma": MODES, "gemma2": MODES, "gemma3": MODES, "cohere": TWO_PASS_MODES}


def _build(name: str, variant: str):
    config_cls, model_cls, extra, targets = FAMILIES[name]
    torch.manual_seed(sum(map(ord, name)))  # stable across processes (str hashes are salted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config_cls(**{**_COMMON, **extra}, attention_dropout=0.0))
    model = spread_init(model).double().train()
    if variant == "frozen-ffn":
        for pname, p in model.named_parameters():
            p.requires_grad_(not any(f".{part}." in pname for part in FOLDED_FFN))
    if variant.startswith("lora"):
        peft = pytest.importorskip("peft")
        if variant == "lora-embedding":
            targets = [*targets, "embed_tokens"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                               target_modules=targets))
        with torch.no_grad():  # PEFT starts lora_B at zero, which would make lora_A's gradients zero
            for pname, p in model.named_parameters():
                if "lora_B" in pname or "lora_embedding" in pname:  # PEFT zeroes lora_embedding_A
                    p.normal_(0, 0.3)
    return model


def _sequence_losses(model, ids, mask, labels):
    logits = model(input_ids=ids, attention_mask=mask).logits
    return sequence_losses(logits, labels, shift=True, reduction="mean")


def _hf_loss(model, ids, mask, labels):
    """Hugging Face's own causal-LM loss: the mean over every valid token of the batch."""
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _batch(seed: int, padded: bool):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    labels = ids.clone()
    if padded:  # right padding, and a prompt that is not trained on
        mask[1, -2:] = 0
        ids[1, -2:] = 1
        labels = labels.masked_fill(mask == 0, -100)
        labels[2, :2] = -100
    return ids, mask, labels


@functools.cache
def built(name: str, variant: str, hf_loss: bool = False):
    """(case, R, oracle). With ``hf_loss`` every sequence has the same number of valid tokens, so
    that Hugging Face's batch mean is the mean over sequences of each one's token mean."""
    return with_oracle(lambda: Case(_build(name, variant), _sequence_losses, _batch(len(name), padded=not hf_loss)),
                       oracle_losses_fn=_hf_loss if hf_loss else None)


def _run(name: str, variant: str, case: Case, mode: str, R: float, hf_loss: bool) -> dict:
    """p.grad after one step (noise 0, batch_size 1: the clipped sum) through engine.backward or, with ``hf_loss``,
    a plain backward of Hugging Face's own loss (a mean over tokens, not per-sample losses)."""
    model = copy.deepcopy(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, allow_fallback=name in NEEDS_FALLBACK
                                            or variant in NEEDS_FALLBACK_VARIANTS)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*uses the per-sample fallback instead")  # Cohere's norm
            if hf_loss:
                _hf_loss(model, *case.batch).backward()
            else:
                engine.backward(case.losses(model))
        optimizer.step()
        return {n: p.grad.detach().clone() for n, (_, p) in trainable_named_parameters(model).items()}
    finally:
        engine.detach()


def _check(name, case, R, ref, got, mode):
    if mode in FLOAT32_GRADIENT.get(name, ()):
        assert_matches(got, ref, rtol=1e-6, what=f"{name} {mode}: float32 sums inside the model only")
        return
    check_against_oracle(name, case, R, ref, got, mode, FLOAT32_INSIDE)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, variant", VARIANTS)
def test_engine_backward_matches_oracle(name, variant, mode):
    case, R, ref = built(name, variant)
    _check(name, case, R, ref, _run(name, variant, case, mode, R, hf_loss=False), mode)


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
@pytest.mark.parametrize("name, variant", VARIANTS)
def test_hugging_face_loss_backward_is_refused(name, variant, mode):
    """labels= makes the model return a token-mean loss: through loss.backward() it is refused at every step
    (the engine cannot read which sample each part of it comes from), with the fix."""
    model = _build(name, variant)
    engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, noise_multiplier=0.0, clipping_mode=mode)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    try:
        for seed in range(2):  # the second step too, after every layer's rows were read once
            engine.backward(_sequence_losses(model, *_batch(seed, padded=False)))
            with pytest.raises(ValueError, match="loss computed inside the model.*sequence_losses"):
                _hf_loss(model, *_batch(seed, padded=False)).backward()
    finally:
        engine.detach()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_no_module_needs_the_fallback_but_cohere_norms(name):
    model = _build(name, "full")
    assert [n for n, m in model.named_modules() if isinstance(resolve_rule(m), FallbackRule)] == []
    dptrain.validate(model, allow_fallback=False)  # by structure; only a call tells Cohere's norm apart
    if name in NEEDS_FALLBACK:
        engine = dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, noise_multiplier=0.0,
                                       allow_fallback=False)
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
        try:
            with pytest.raises(ValueError, match="CohereLayerNorm looks like an RMS norm.*allow_fallback=True"):
                engine.backward(_sequence_losses(model, *_batch(0, padded=False)))
        finally:
            engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_opt_full_fine_tuning_with_its_feed_forward_folded_into_the_batch_is_exact(mode):
    """OPT runs its feed-forward on [B * T, d]: the rows are read as T tokens per sample and regrouped."""
    case, R, ref = built("opt", "full")
    _check("opt", case, R, ref, _run("opt", "full", case, mode, R, hf_loss=False), mode)


def test_lora_embedding_is_taken_by_the_fallback_with_its_parameter_containers():
    model = _build("llama", "lora-embedding")
    embedding = model.get_submodule("base_model.model.model.embed_tokens")
    assert fallback_modules(model) == ["base_model.model.model.embed_tokens"]
    assert set(resolve_rule(embedding).param_names) >= {"lora_embedding_A.default", "lora_embedding_B.default"}
    with pytest.raises(ValueError, match=r"embed_tokens.*lora_embedding_A\.default.*allow_fallback=False"):
        dptrain.validate(model, allow_fallback=False)

"""The model-zoo sweep: every timm family and every Hugging Face task model, built tiny, against the oracle.

Each model is run in float64 with a batch of 3 (no other dim of the tiny models is 3) through
``engine.backward(losses)`` in the modes of ``SWEEP_MODES``, and compared with the one-sample-at-a-time
oracle. It is then one of

- ``exact``: every mode matches the oracle, no layer needs the per-sample fallback;
- ``fallback``: every mode matches, some layer goes through the fallback (the layers are listed);
- ``refused``: the engine raised an error that names a module of the model (the reason is kept);
- ``wrong``: a mode ran and did not match the oracle. Never acceptable: the test fails on it.

A model the sweep cannot build (or run without dptrain) at a tiny size is ``unbuilt``; those are not
dptrain's outcome and count nowhere.

``tests/zoo_timm.json`` and ``tests/zoo_hf.json`` hold how each model is built (found once by ``discover``, since many shrink
arguments are family-specific) and its classification. Regenerate (both, then docs/models.md's table):

    PYTHONPATH=src python tests/zoo.py discover timm|hf      # build arguments, slow (tries sizes)
    PYTHONPATH=src python tests/zoo.py classify timm|hf      # runs the sweep, writes the classifications
    PYTHONPATH=src python tests/zoo.py table                 # rewrites the table in docs/models.md
"""
from __future__ import annotations

import copy
import inspect
import json
import math
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import dptrain  # noqa: E402
from dptrain.layers import fallback_modules  # noqa: E402
from helpers import Case, engine_clipped_sum, max_relative_error, spread_init, with_oracle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TABLES = {lib: Path(__file__).with_name(f"zoo_{lib}.json") for lib in ("timm", "hf")}
DOCS = ROOT / "docs" / "models.md"
B = 3
# No other dim of the tiny models is 3 (the batch): classes, image channels, lengths and widths differ, so a layout
# that confuses the batch with another dim shows.
CLASSES = 6
CHANNELS = 4
SWEEP_MODES = ("bk-mixopt", "ghost", "per-sample")
RTOL = 1e-10
LARGE = 5_000_000  # parameters: a model above it is slow to sweep in float64 (discover tries narrower ones)
TOO_LARGE = 30_000_000  # ... and above this one is not swept
# A layer computing in float32 inside a float64 model (timm's LayerNormFp32, RMS norms that normalise in
# float32) rounds differently in the batch and in the oracle's one-sample forwards; such a model is exact
# to float32 precision. The table names which models needed it, and why.
FLOAT32_RTOL = 1e-5

# --------------------------------------------------------------------------- timm
_SIZE_WORDS = ("atto", "femto", "pico", "nano", "xxxs", "xxs", "xxsmall", "xs", "xsmall", "tiny", "mini", "t",
               "small", "s", "s0", "b0", "lite0", "m0", "18", "050", "100", "base")


def _size_rank(name: str) -> tuple:
    parts = re.split(r"[_.\-]|(?<=[a-z])(?=\d)", name)
    ranks = [_SIZE_WORDS.index(p) for p in parts if p in _SIZE_WORDS]
    return (min(ranks) if ranks else len(_SIZE_WORDS), len(name), name)


def _meta_params(name: str) -> float:
    import timm
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _params(timm.create_model(name, pretrained=False, num_classes=3))
    except Exception:  # noqa: BLE001
        return math.inf


def timm_candidates(family: str, limit: int = 3, screened: int = 10) -> list[str]:
    """The family's smallest variants: the names that read smallest, ordered by their parameter count."""
    import timm
    names = sorted(timm.list_models(module=family), key=_size_rank)[:screened]
    return sorted(names, key=_meta_params)[:limit]


_DEPTH_KEYS = ("depth", "depths", "layers", "num_blocks", "blocks", "block_count", "stage_blocks")
_HEAD_KEYS = ("num_heads", "heads")
_WIDTH_KEYS = ("channels", "widths", "embed_dims", "dims", "num_features", "hidden_sizes", "stem_width",
               "stem_chs", "growth_rate", "out_chs", "feature_dims", "num_init_features", "base_width")


def _shrunk(value, key):
    if key in _DEPTH_KEYS:
        if isinstance(value, int) and not isinstance(value, bool):
            return 1
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
            return type(value)(min(v, 1) for v in value)
    if key in _HEAD_KEYS:
        if isinstance(value, int) and not isinstance(value, bool):
            return min(value, 2)
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
            return type(value)(min(v, 2) for v in value)
    return value


def _model_class(name: str):
    import timm
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return type(timm.create_model(name, pretrained=False))


# Shrink arguments a family needs beyond the generic ones (found by reading the family's constructor).
TIMM_EXTRA = {"vgg": {"mlp_ratio": 1 / 64}}


def timm_attempts(name: str, family: str = "") -> list[dict]:
    """Build-argument sets to try for ``name``, smallest first."""
    extra = TIMM_EXTRA.get(family, {})
    return [dict(kwargs, **extra) for kwargs in _generic_attempts(name)]


def _generic_attempts(name: str) -> list[dict]:
    try:
        cls = _model_class(name)
        sig = inspect.signature(cls.__init__).parameters
    except Exception:
        return [{}]
    shrink = {}
    for key, p in sig.items():
        if p.default is inspect.Parameter.empty:
            continue
        new = _shrunk(p.default, key)
        if new != p.default:
            shrink[key] = new
    widths = {}
    for key in ("embed_dim", "hidden_dim", "width", "dim"):
        if key in sig and isinstance(sig[key].default, int):
            widths[key] = 32
    narrow = []  # channel widths of the stages divided by 8, then by 4 (many families need multiples of 8)
    for divisor in (8, 4):
        cut = {}
        for key in _WIDTH_KEYS:
            value = sig[key].default if key in sig else None
            if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) and v >= 16 for v in value):
                cut[key] = type(value)(max(8, v // divisor // 8 * 8) for v in value)
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 16:
                cut[key] = max(8, value // divisor // 8 * 8)
        if cut:
            narrow.append(cut)
    base = {k: v for k, v in (("drop_rate", 0.0), ("drop_path_rate", 0.0), ("attn_drop_rate", 0.0),
                              ("proj_drop_rate", 0.0)) if k in sig}
    return ([dict(base, **shrink, **widths, **cut) for cut in narrow]
            + [dict(base, **shrink, **widths), dict(base, **shrink), dict(base)])


def build_timm(spec: dict) -> nn.Module:
    import timm
    kwargs = dict(spec.get("kwargs", {}), in_chans=CHANNELS)
    if spec.get("img_size_arg"):
        kwargs["img_size"] = spec["img_size"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model(spec["name"], pretrained=False, num_classes=CLASSES, **kwargs)
    model = _no_dropout(_fixed(model))
    return spread_init(model).double().train()


def timm_case(spec: dict) -> Case:
    model = build_timm(spec)
    g = torch.Generator().manual_seed(0)
    size = spec["img_size"]
    chans = CHANNELS
    x = torch.randn(B, chans, size, size, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (B,), generator=g)
    return Case(model, timm_losses, (x, y))


def timm_losses(model, x, y):
    out = model(x)
    if isinstance(out, (tuple, list)):  # distilled heads in training: (class, distillation)
        out = sum(out) / len(out)
    return F.cross_entropy(out, y, reduction="none")


def _no_dropout(model: nn.Module) -> nn.Module:
    """Every dropout and stochastic depth at 0, also those a family builds with a fixed rate: the oracle's
    one-sample forwards would draw other masks than the batch forward (dropout itself is fine in training)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if hasattr(m, "drop_prob") and isinstance(m.drop_prob, float):
            m.drop_prob = 0.0
    return model


def _fixed(model: nn.Module) -> nn.Module:
    """``dptrain.fix(model)`` where it changes something (BatchNorm, torch's MultiheadAttention and RNNs), the
    documented remedy for what the engine refuses in them."""
    from dptrain.models.fixer import planned_fixes
    return dptrain.fix(model) if planned_fixes(model) else model


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def discover_timm_family(family: str, budget_s: float = 60.0) -> dict:
    """The first candidate and argument set that builds and runs a forward and backward quickly."""
    errors = []
    start = time.monotonic()
    for name in timm_candidates(family):
        cls_sig = {}
        try:
            cls_sig = inspect.signature(_model_class(name).__init__).parameters
        except Exception:
            pass
        for kwargs in timm_attempts(name, family):
            for size in (32, 64, 96, 224):
                if time.monotonic() - start > budget_s:
                    return {"family": family, "status": "unbuilt", "reason": "; ".join(errors[-3:]) or "too slow"}
                spec = {"family": family, "name": name, "kwargs": kwargs, "img_size": size,
                        "img_size_arg": "img_size" in cls_sig}
                try:
                    t0 = time.monotonic()
                    case = timm_case(spec)
                    timm_losses(case.model, *case.batch).sum().backward()
                    spec["seconds"] = round(time.monotonic() - t0, 3)
                    spec["params"] = _params(case.model)
                    return spec
                except Exception as err:  # noqa: BLE001 - any failure means: try the next size
                    errors.append(f"{name} {size}: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
    return {"family": family, "status": "unbuilt", "reason": "; ".join(errors[-3:])}


# --------------------------------------------------------------------------- classification
def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _names_a_module(message: str, model: nn.Module) -> bool:
    names = {n for n, _ in model.named_modules() if n}
    classes = {type(m).__name__ for m in model.modules()}
    return any(n in message for n in names) or "<root>" in message or any(c in message for c in classes)


def library_versions(lib: str) -> dict[str, str]:
    """The versions a classification depends on: torch, and the model library (``timm`` or ``transformers``)."""
    import importlib.metadata as md
    names = ("torch", "timm" if lib == "timm" else "transformers")
    return {n: md.version(n) for n in names}


def classify_case(case: Case, oracle_losses_fn=None) -> dict:
    """{"status": exact | fallback | refused | wrong, "detail": ...} for a built case."""
    try:
        copy.deepcopy(case.model)  # the runners train copies of the model
        with torch.no_grad():
            if not bool(torch.isfinite(case.losses()).all()):
                raise ValueError("the sweep's loss on this model's output is not finite")
        case, R, ref = with_oracle(lambda: case, oracle_losses_fn)
    except Exception as err:  # noqa: BLE001
        return {"status": "unbuilt", "detail": f"oracle: {_first_line(err)}"}
    worst = 0.0
    for mode in SWEEP_MODES:
        try:
            got = engine_clipped_sum(case, quiet=True, mode=mode, max_grad_norm=R)
        except Exception as err:  # noqa: BLE001
            message = str(err)
            if "deepcopy protocol" in message:  # the runner's copy, not the engine
                return {"status": "unbuilt", "detail": "the sweep copies the model after the oracle's forwards, and "
                        "this model keeps tensors of their graphs as attributes (not deep-copyable)"}
            detail = re.sub(r"\s+", " ", f"{type(err).__name__}: {message}").strip()
            return {"status": "refused", "detail": detail[:400], "mode": mode,
                    "names_module": _names_a_module(message, case.model)}
        rel, name = max_relative_error(got, ref)
        if not rel <= FLOAT32_RTOL:
            return {"status": "wrong", "detail": f"{mode}: relative error {rel:.3g} at {name}", "mode": mode}
        worst = max(worst, rel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fallbacks = fallback_modules(case.model)
    out = {"status": "fallback" if fallbacks else "exact", "max_rel_error": float(f"{worst:.3g}")}
    if fallbacks:
        out["fallback"] = sorted({_class_of(case.model, n) for n in fallbacks})
    if worst > RTOL:
        out["float32"] = True
    return out


def _class_of(model, name):
    return type(model if name == "<root>" else model.get_submodule(name)).__name__


# --------------------------------------------------------------------------- the table file
def load_table(lib: str) -> dict:
    return json.loads(TABLES[lib].read_text()) if TABLES[lib].exists() else {}


def save_table(lib: str, table: dict) -> None:
    TABLES[lib].write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def discover_timm(families=None) -> None:
    import timm
    table = load_table("timm")
    if families == ["large"]:  # again, the families found only at sizes too large to sweep quickly
        families = [f for f, spec in table.items() if spec.get("params", 0) > LARGE]
    for family in families or timm.list_modules():
        t0 = time.monotonic()
        spec = discover_timm_family(family)
        spec["build_seconds"] = round(time.monotonic() - t0, 2)
        before = table.get(family, {})
        if "params" in before and not spec.get("params", math.inf) < before["params"]:
            spec = before  # keep the smaller build found before
        table[family] = spec
        print(family, spec.get("name"), spec.get("img_size"), spec.get("params"), spec.get("status", ""),
              spec.get("reason", "")[:200], flush=True)
        save_table("timm", table)


def _classify_and_save(lib: str, table: dict, spec: dict, make_case, label: str) -> None:
    """Run one model's sweep (or mark it too large), record its outcome and time, and save the table."""
    if spec.get("params", 0) > TOO_LARGE:
        spec["result"] = {"status": "unbuilt", "detail": f"{spec['params']:,} parameters at the smallest size found"}
    else:
        t0 = time.monotonic()
        try:
            result = classify_case(make_case(spec))
        except Exception as err:  # noqa: BLE001
            result = {"status": "unbuilt", "detail": _first_line(err)}
        # the fastest time seen: the test's default selection (QUICK) should not shrink on a busy machine
        seconds = round(time.monotonic() - t0, 2)
        result["seconds"] = min(seconds, spec.get("result", {}).get("seconds", seconds))
        result["versions"] = library_versions(lib)
        spec["result"] = result
        print(label, result, flush=True)
    save_table(lib, table)


def classify_timm(families=None) -> None:
    table = load_table("timm")
    if families == ["refused"]:  # again, the families refused last time
        families = [f for f, spec in table.items() if spec.get("result", {}).get("status") == "refused"]
    for family, spec in sorted(table.items()):
        if families and family not in families:
            continue
        if spec.get("status") == "unbuilt" and "name" not in spec:
            continue
        _classify_and_save("timm", table, spec, timm_case, f"{family} {spec['name']}")


# --------------------------------------------------------------------------- Hugging Face
# One task head per model type, the first of these mappings that has one (text, vision, audio heads).
HF_MAPPINGS = ("SEQUENCE_CLASSIFICATION", "IMAGE_CLASSIFICATION", "AUDIO_CLASSIFICATION", "SEQ_TO_SEQ_CAUSAL_LM",
               "CAUSAL_LM", "MASKED_LM", "CTC", "TOKEN_CLASSIFICATION", "QUESTION_ANSWERING")
_HF_WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "dim", "embedding_size", "word_embed_proj_dim",
             "pooler_hidden_size", "projection_dim", "text_embed_dim", "vision_embed_dim")
# sizes of attention parts that families define apart from the width (rotary and latent dims)
_HF_PARTS = {"rotary_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16,
             "q_lora_rank": 16, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
             "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2}
_HF_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
              "num_encoder_layers", "num_decoder_layers")
_HF_HEADS = ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads",
             "num_heads", "num_key_value_heads")
_HF_FFN = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "d_inner")
VOCAB, LENGTH, IMAGE = 61, 7, 32


def hf_head_classes() -> dict[str, str]:
    """{model type: task-head class name}."""
    import transformers.models.auto.modeling_auto as auto
    out: dict[str, str] = {}
    for task in HF_MAPPINGS:
        for model_type, cls in getattr(auto, f"MODEL_FOR_{task}_MAPPING_NAMES").items():
            if isinstance(cls, (tuple, list)):
                cls = cls[0]
            out.setdefault(model_type, cls)
    return out


def _set(config, key, value) -> None:
    try:
        setattr(config, key, value)
    except AttributeError:  # a property without a setter (derived from other fields)
        pass


def _tiny(config, layers: int, depth: int = 0, image: int = IMAGE) -> None:
    from transformers import PretrainedConfig
    _set(config, "use_cache", False)
    _set(config, "_experts_implementation", "eager")  # grouped matmuls have no float64 kernel on the CPU
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig) and depth < 2:
            _tiny(value, layers, depth + 1, image)
            continue
        if key in ("conv_dim", "hidden_sizes", "embed_dims", "dims", "depths", *_HF_HEADS) and isinstance(value, (list, tuple)):
            small = 1 if key == "depths" else 2 if key in _HF_HEADS else 32
            if all(isinstance(v, int) for v in value):
                _set(config, key, type(value)(small for _ in value))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("mask_") and key.endswith("_prob") and isinstance(value, float):  # SpecAugment: random
            _set(config, key, 0.0)
        elif ("dropout" in key or "drop_prob" in key or key.endswith("_pdrop") or "drop_path" in key
                or key in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")) and isinstance(value, float):
            _set(config, key, 0.0)
        elif key in _HF_WIDTH and isinstance(value, int):
            _set(config, key, 32)
        elif key in _HF_LAYERS and isinstance(value, int):
            _set(config, key, layers)
        elif key in _HF_HEADS and isinstance(value, int):
            _set(config, key, 2)
        elif key in _HF_FFN and isinstance(value, int):
            _set(config, key, 64)
        elif key in _HF_PARTS and isinstance(value, int):
            _set(config, key, min(value, _HF_PARTS[key]))
        elif key == "head_dim" and isinstance(value, int):
            _set(config, key, 16)
        elif key in ("vocab_size", "decoder_vocab_size") and isinstance(value, int):
            _set(config, key, VOCAB)
        elif key.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            _set(config, key, 2)
        elif key == "image_size" and isinstance(value, int):
            _set(config, key, image)
        elif key == "num_channels" and value == 3:  # images: not the batch size
            _set(config, key, CHANNELS)
        elif key == "patch_size" and isinstance(value, int):
            _set(config, key, 8)
        elif key in ("max_position_embeddings", "max_source_positions", "max_target_positions") and value > 64:
            _set(config, key, 64)
    if hasattr(config, "num_labels"):
        config.num_labels = CLASSES
    if depth == 0 and getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0
    if depth == 0 and getattr(config, "pad_token_id", 0) is None:  # sequence classification finds the last token by it
        config.pad_token_id = 0
    if isinstance(getattr(config, "layer_types", None), list):
        n = getattr(config, "num_hidden_layers", None)
        if isinstance(n, int):
            _set(config, "layer_types", config.layer_types[:n])


def build_hf(spec: dict) -> nn.Module:
    import transformers
    config = transformers.AutoConfig.for_model(spec["model_type"])
    _tiny(config, spec.get("layers", 1), image=spec.get("image", IMAGE))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, spec["class"])(config)
    model = _no_dropout(_fixed(model))
    return spread_init(model).double().train()


def _meta_size_hf(spec: dict) -> int:
    import transformers
    config = transformers.AutoConfig.for_model(spec["model_type"])
    _tiny(config, spec.get("layers", 1), image=spec.get("image", IMAGE))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _params(getattr(transformers, spec["class"])(config))


def _hf_inputs(model, spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    params = inspect.signature(model.forward).parameters
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    inputs = {}
    if main == "input_ids" or "input_ids" in params and main not in ("pixel_values", "input_values", "input_features"):
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", VOCAB)
        inputs["input_ids"] = torch.randint(3, min(vocab, VOCAB), (B, LENGTH), generator=g)
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int) and eos < VOCAB:  # encoder-decoder classifiers read the last end-of-sequence token
            inputs["input_ids"][:, -1] = eos
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones(B, LENGTH, dtype=torch.long)
    if main == "pixel_values":
        size = getattr(config, "image_size", spec.get("image", IMAGE))
        size = size[0] if isinstance(size, (tuple, list)) else size
        inputs["pixel_values"] = torch.randn(B, getattr(config, "num_channels", CHANNELS), size, size, generator=g,
                                             dtype=torch.float64)
    if main == "input_values":
        inputs["input_values"] = torch.randn(B, spec.get("audio_length", 4000), generator=g, dtype=torch.float64)
    if main == "input_features":
        mels = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", 32)
        inputs["input_features"] = torch.randn(B, mels, frames, generator=g, dtype=torch.float64)
    if (getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params
            and "SequenceClassification" not in spec["class"]):
        vocab = getattr(config, "vocab_size", VOCAB)
        inputs["decoder_input_ids"] = torch.randint(3, min(vocab, VOCAB), (B, 5), generator=g)
    return inputs


def _output_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out
    return next(t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point())


def hf_case(spec: dict) -> Case:
    model = build_hf(spec)
    inputs = _hf_inputs(model, spec)
    keys = tuple(inputs)
    with torch.no_grad():
        out = _output_tensor(model(**inputs))
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)

    def losses(model, *batch):
        *values, y = batch
        pred = _output_tensor(model(**dict(zip(keys, values))))
        return 0.5 * (pred - y).square().reshape(pred.shape[0], -1).sum(1)

    return Case(model, losses, (*inputs.values(), target))


def discover_hf(types=None) -> None:
    table = load_table("hf")
    heads = hf_head_classes()
    if types == ["unbuilt"]:  # again, the model types not built last time
        types = [t for t, spec in table.items() if spec.get("status") == "unbuilt"]
    for model_type in types or sorted(heads):
        t0 = time.monotonic()
        spec = {"model_type": model_type, "class": heads[model_type]}
        errors = []
        for layers, image in ((1, IMAGE), (2, IMAGE), (1, 2 * IMAGE), (2, 4 * IMAGE)):
            spec["layers"], spec["image"] = layers, image
            try:
                size = _meta_size_hf(spec)
                if size > TOO_LARGE:  # built on the meta device first: some configs stay huge (memory)
                    raise ValueError(f"{size:,} parameters at the smallest size found")
                case = hf_case(spec)
                case.losses().sum().backward()
                spec.pop("status", None), spec.pop("reason", None)
                spec["params"] = _params(case.model)
                break
            except Exception as err:  # noqa: BLE001
                errors.append(_first_line(err)[:200])
                spec.update(status="unbuilt", reason=errors[-1])
        spec["build_seconds"] = round(time.monotonic() - t0, 2)
        table[model_type] = spec
        print(model_type, spec["class"], spec.get("params"), spec.get("reason", ""), flush=True)
        save_table("hf", table)


def classify_hf(types=None) -> None:
    table = load_table("hf")
    if types == ["refused"]:  # again, the model types refused last time, and those not classified yet
        types = [t for t, spec in table.items() if spec.get("result", {}).get("status") in ("refused", None)]
    for model_type, spec in sorted(table.items()):
        if (types and model_type not in types) or spec.get("status") == "unbuilt":
            continue
        _classify_and_save("hf", table, spec, hf_case, f"{model_type} {spec['class']}")


# --------------------------------------------------------------------------- the table in docs/models.md
TABLE_START = "<!-- zoo table: generated by `python tests/zoo.py table`, do not edit by hand -->"
TABLE_END = "<!-- end of zoo table -->"
OUTCOMES = ("exact", "fallback", "refused", "wrong")


def counts(table: dict) -> dict[str, int]:
    out = {k: 0 for k in (*OUTCOMES, "unbuilt")}
    for spec in table.values():
        out[spec.get("result", {}).get("status", "unbuilt")] += 1
    return out


def _why(result: dict) -> str:
    status = result.get("status", "unbuilt")
    if status == "fallback":
        text = "through the fallback: " + ", ".join(f"`{c}`" for c in result.get("fallback", []))
    elif status in ("refused", "wrong", "unbuilt"):
        text = result.get("detail", "")
    else:
        text = ""
    if result.get("float32"):
        text = ("exact to float32 precision (it computes in float32 inside); " + text).rstrip("; ")
    text = re.sub(r"\s+", " ", text).replace("|", "\\|")
    return text if len(text) <= 300 else text[:297] + "..."


def _rows(table: dict, label) -> list[str]:
    rows = []
    for key in sorted(table):
        spec = table[key]
        result = spec.get("result", {"status": "unbuilt", "detail": spec.get("reason", "")})
        rows.append(f"| {label(key, spec)} | {result.get('status', 'unbuilt')} | {_why(result)} |")
    return rows


def _summary(name: str, table: dict) -> str:
    c = counts(table)
    swept = sum(c[k] for k in OUTCOMES)
    good = c["exact"] + c["fallback"]
    share = f"{100 * good / swept:.0f}%" if swept else "-"
    return (f"| {name} | {swept} | {c['exact']} | {c['fallback']} | {c['refused']} | {c['wrong']} | {share} | "
            f"{c['unbuilt']} |")


def _versions_line(tables: dict[str, dict]) -> str:
    """Which versions the classifications were made with (each result records its own)."""
    seen: dict[str, dict[str, int]] = {}
    for table in tables.values():
        for spec in table.values():
            for name, version in spec.get("result", {}).get("versions", {}).items():
                seen.setdefault(name, {}).setdefault(version, 0)
                seen[name][version] += 1
    if not seen:
        return "Classified with versions not recorded."
    parts = [f"{name} {', '.join(sorted(seen[name], key=seen[name].get, reverse=True))}" for name in sorted(seen)]
    return f"Classified with {'; '.join(parts)} (each model's versions are in `tests/zoo_*.json`)."


def render_table() -> str:
    timm_table, hf_table = load_table("timm"), load_table("hf")
    lines = [
        TABLE_START, "",
        _versions_line({"timm": timm_table, "hf": hf_table}), "",
        "| library | swept | exact | fallback | refused | silently wrong | exact in every mode | not built |",
        "|---|---|---|---|---|---|---|---|",
        _summary("timm (one model per family)", timm_table),
        _summary("transformers (one task head per model type)", hf_table),
        "", "### timm", "",
        "| family (model as built) | outcome | why |", "|---|---|---|",
        *_rows(timm_table, lambda k, s: f"{k} (`{s.get('name', '?')}`, {s.get('img_size', '?')}px)"),
        "", "### transformers", "",
        "| model type (`class`) | outcome | why |", "|---|---|---|",
        *_rows(hf_table, lambda k, s: f"{k} (`{s.get('class', '?')}`)"),
        "", TABLE_END,
    ]
    return "\n".join(lines)


def write_docs_table() -> None:
    text = DOCS.read_text()
    table = render_table()
    if TABLE_START in text:
        start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
        text = text[:start] + table + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    DOCS.write_text(text)


if __name__ == "__main__":
    torch.set_num_threads(1)
    what, lib, *rest = sys.argv[1:] + ["", ""]
    rest = [r for r in rest if r]
    if what == "discover" and lib == "timm":
        discover_timm(rest or None)
    elif what == "classify" and lib == "timm":
        classify_timm(rest or None)
    elif what == "discover" and lib == "hf":
        discover_hf(rest or None)
    elif what == "classify" and lib == "hf":
        classify_hf(rest or None)
    elif what == "table":
        write_docs_table()
    else:
        raise SystemExit(__doc__)

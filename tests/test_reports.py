"""What the engine and plan() report, read by people and by programs: ``privacy_report()`` is a dict whose ``str()``
says epsilon at delta after t of T steps; ``plan()`` is the list of decisions whose ``str()`` is ``dptrain plan``'s
table; ``dptrain plan`` builds a Hugging Face model with its task head (an untied ``lm_head`` included) and plans
LoRA."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.cli import main
from dptrain.core.plan_report import Plan
from dptrain.models.build import SmallCNN
from dptrain.privacy.report import PrivacyReport


def run(argv, capsys):
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def stepped_engine(taken: int, **kwargs):
    """An engine after ``taken`` steps on one batch of 10 of 100 samples."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = dptrain.PrivacyEngine(model, batch_size=10, sample_size=100, seed=0, **kwargs)
    engine.attach(optimizer)
    x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    for _ in range(taken):
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.step()
        optimizer.zero_grad()
    return engine


# ====================================================================== privacy_report()


def test_privacy_report_is_the_dict_it_was_and_reads_as_a_sentence():
    engine = stepped_engine(3, target_epsilon=3.0, steps=5)
    report = engine.privacy_report()
    assert isinstance(report, PrivacyReport) and isinstance(report, dict)
    assert report["steps"] == 3 and report["planned_steps"] == 5 and report["epsilon"] == engine.get_epsilon()
    assert json.loads(json.dumps(report)) == json.loads(json.dumps(dict(report)))  # programs read the same data
    first, second = str(report).splitlines()
    assert first == (f"epsilon = {report['epsilon']:.3g} at delta = 0.001 after 3 of 5 planned steps "
                     "(target 3, pld accountant)")
    assert second == f"  noise multiplier {engine.noise_multiplier:.4g}, sample rate 0.1, max grad norm 1, per example"


def test_privacy_report_says_what_applies_to_the_run():
    given = stepped_engine(2, noise_multiplier=1.5, accountant="rdp", max_batch_size=30)
    text = str(given.privacy_report(1e-4))
    assert text.startswith(f"epsilon = {given.get_epsilon(1e-4):.3g} at delta = 0.0001 after 2 steps (rdp accountant)")
    truncation = given.privacy_report()["truncation_delta"]
    assert f"fixed-shape batches of 30 rows: truncation takes {truncation:.3g} of delta" in text
    past = stepped_engine(4, target_epsilon=3.0, steps=2)
    assert "past the plan by 2 steps: epsilon is above what the noise was calibrated for" in str(
        past.privacy_report())
    report = past.privacy_report()
    report.update(sampling="shuffled fixed-size batches", epsilon_is_proven_bound=False, note="not Poisson")
    assert str(report).splitlines()[-3:] == ["  sampling: shuffled fixed-size batches",
                                             "  epsilon is NOT a proven bound for this sampling", "  note: not Poisson"]


# ====================================================================== plan()


def test_plan_is_the_list_of_decisions_and_prints_the_commands_table(capsys):
    model = SmallCNN(1, 10).eval()
    planned = dptrain.plan(model, torch.zeros(1, 1, 8, 8))
    assert isinstance(planned, Plan) and isinstance(planned, list) and len(planned) == 5
    assert [d.type for d in planned] == ["Conv2d", "GroupNorm", "Conv2d", "GroupNorm", "Linear"]
    assert planned.ghost_available == [True, False, True, False, True]
    assert str(planned).startswith("SmallCNN, input [1, 1, 8, 8], per sample; clipping mode bk-mixopt")
    status, out, err = run(["plan", "--model", "cnn", "--input-size", "1", "8", "8"], capsys)
    assert status == 0, err
    assert planned.table("cnn, input 1x8x8") + "\n" == out  # the command prints the same table, nothing else
    status, out, err = run(["plan", "--model", "cnn", "--input-size", "1", "8", "8", "--json"], capsys)
    assert {k: v for k, v in json.loads(out).items() if k not in ("model", "input", "problems", "noise_state")} == \
        json.loads(json.dumps(planned.report()))
    with pytest.raises(ValueError, match="a plan of 5 layers needs as many ghost_available and parameters entries"):
        Plan(planned, ghost_available=[True], parameters=planned.parameters, clipping_mode="bk",
             decision_rule="memory", title="x")


# ====================================================================== dptrain plan: heads and LoRA


@pytest.fixture
def tiny_llama(tmp_path):
    """A local Llama config (an untied lm_head, as Llama is published): dptrain plan --model hf:<dir>."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    config.save_pretrained(tmp_path / "llama")
    return f"hf:{tmp_path / 'llama'}"


def plan_json(argv, capsys) -> dict:
    status, out, err = run(argv + ["--json"], capsys)
    assert status == 0, err
    return json.loads(out)


def test_plan_builds_the_model_with_its_head(tiny_llama, capsys):
    layers = {layer["name"]: layer for layer in plan_json(["plan", "--model", tiny_llama, "--seq-len", "8"],
                                                           capsys)["layers"]}
    head = layers["lm_head"]  # untied: a parameter of its own, which AutoModel left out
    assert (head["type"], head["T"], head["p"], head["d"]) == ("Linear", 8, 64, 16)
    bare = plan_json(["plan", "--model", tiny_llama, "--seq-len", "8", "--head", "none"], capsys)["layers"]
    assert "lm_head" not in {layer["name"] for layer in bare} and len(bare) == len(layers) - 1
    classifier = plan_json(["plan", "--model", tiny_llama, "--seq-len", "8", "--head", "sequence-classification",
                            "--num-classes", "3"], capsys)["layers"]
    assert [(layer["name"], layer["p"]) for layer in classifier][-1] == ("score", 3)
    status, out, _ = run(["plan", "--model", tiny_llama, "--seq-len", "8"], capsys)
    assert "note: built with its causal-lm head: LlamaForCausalLM" in out


@pytest.mark.parametrize("argv, message", [
    (["--head", "masked-lm"], "(llama) has no masked-lm head; its heads: causal-lm, sequence-classification"),
    (["--num-classes", "3"], "--head causal-lm has none: add --head sequence-classification or token-classification"),
    (["--lora-targets", "q_proj"], "--lora-targets names the modules of --lora R: give --lora R too"),
    (["--lora", "2", "--lora-targets", "nowhere"], "LoRA cannot be put on hf:"),
])
def test_plan_head_and_lora_errors_say_what_to_do(tiny_llama, capsys, argv, message):
    status, _, err = run(["plan", "--model", tiny_llama, "--seq-len", "8"] + argv, capsys)
    assert status == 1 and message in err and len(err.strip().splitlines()) == 1


def test_head_is_for_hf_models(capsys):
    status, _, err = run(["plan", "--model", "cnn", "--head", "causal-lm"], capsys)
    assert status == 1 and "--head is for hf: models; cnn is planned with its classifier" in err


def test_plan_lora_lists_the_adapters_only(tiny_llama, capsys):
    pytest.importorskip("peft")
    doc = plan_json(["plan", "--model", tiny_llama, "--seq-len", "8", "--lora", "2"], capsys)
    names = [layer["name"] for layer in doc["layers"]]
    # peft's default modules for Llama: the attention's q_proj and v_proj, an A and a B adapter each
    assert len(names) == 4 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in names} == {"q_proj", "v_proj"}
    a = next(layer for layer in doc["layers"] if "q_proj.lora_A" in layer["name"])
    assert (a["p"], a["d"]) == (2, 16)  # rank 2 from the hidden size 16
    status, out, _ = run(["plan", "--model", tiny_llama, "--seq-len", "8", "--lora", "2"], capsys)
    assert "note: LoRA r=2 on q_proj, v_proj: " in out
    image = plan_json(["plan", "--model", "cnn", "--lora", "2", "--lora-targets", "9"], capsys)
    assert [layer["name"] for layer in image["layers"]] == ["base_model.model.9.lora_A.default",
                                                            "base_model.model.9.lora_B.default"]
    status, _, err = run(["plan", "--model", "cnn", "--lora", "2"], capsys)
    assert status == 1 and "name the modules to adapt with --lora-targets NAME" in err


def test_plan_lora_without_peft_names_the_extra(tiny_llama, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    status, _, err = run(["plan", "--model", tiny_llama, "--seq-len", "8", "--lora", "2"], capsys)
    assert status == 1 and "peft is not installed; install the optional extra: pip install 'dptrain[peft]'" in err


def test_plan_gives_an_encoder_decoder_its_decoder_tokens(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    config.save_pretrained(tmp_path / "t5")
    doc = plan_json(["plan", "--model", f"hf:{tmp_path / 't5'}", "--seq-len", "4"], capsys)
    layers = {layer["name"]: layer for layer in doc["layers"]}
    assert layers["decoder.block.0.layer.1.EncDecAttention.k"]["T"] == 4  # the encoder's 4 tokens, read by the decoder
    assert layers["decoder.block.0.layer.0.SelfAttention.q"]["T"] == 4  # the decoder's own 4 tokens
    status, out, _ = run(["plan", "--model", f"hf:{tmp_path / 't5'}", "--seq-len", "4"], capsys)
    assert "note: built with its seq2seq-lm head: T5ForConditionalGeneration" in out

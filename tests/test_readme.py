"""The README's code works as printed, and every link in it resolves.

The README is a guide whose details live in docs/: its links must reach those pages (and their headings), and every
one of its python blocks is run here, as printed, with the substitutions listed in ``SUBSTITUTIONS`` and nothing
else: a model or tokenizer downloaded from the Hugging Face hub is built small from a config here (no network), and
a long run is shortened. A substitution that no longer matches its block fails the test, so none goes stale.
"""
import ast
import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import dptrain

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# Each python block of the README, named by a line only it contains; test_every_python_block_is_run checks that
# these name all of them.
BLOCKS = {
    "training loop": "loader = poisson_loader(train_set, batch_size=100)",
    "trainer": "trainer = DPTrainer(",
    "plain language-model loop": "losses = sequence_losses(logits",
    "timm": "timm.create_model(",
}
HUB_MODEL = ('AutoModelForCausalLM.from_pretrained("gpt2")', "_small_gpt2()")  # a GPT-2 of 1 layer, width 16
HUB_TOKENIZER = ('AutoTokenizer.from_pretrained("gpt2")', "_word_tokenizer()")  # the words of the README's texts
# block -> [(text as printed, what runs here instead, how many times it occurs)]
SUBSTITUTIONS = {
    "trainer": [(*HUB_MODEL, 1), (*HUB_TOKENIZER, 1), ("max_steps=100", "max_steps=3", 1)],  # 3 steps, not 100
    "plain language-model loop": [
        (*HUB_MODEL, 1), (*HUB_TOKENIZER, 1),
        ("* 500", "* 1", 1),  # 2 texts, not 1000, in expected batches of 1: a quarter of the batches are empty
        ("batch_size=64", "batch_size=1", 2),
        # a seed whose draws include an empty batch, for the guard (the test checks that one was met)
        ("poisson_loader(train_set, ", "poisson_loader(train_set, generator=torch.Generator().manual_seed(1), ", 1),
    ],
}


def readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def readme_block(name: str) -> str:
    """The python block of the README that ``BLOCKS[name]`` names, with its ``SUBSTITUTIONS`` made."""
    found = [b for b in readme_blocks() if BLOCKS[name] in b]
    assert len(found) == 1, f"{len(found)} python blocks of README.md contain {BLOCKS[name]!r}"
    block = found[0]
    for printed, here, count in SUBSTITUTIONS.get(name, []):
        assert block.count(printed) == count, f"the README's {name} block has {printed!r} {block.count(printed)} " \
                                              f"times, not {count}: update SUBSTITUTIONS"
        block = block.replace(printed, here)
    return block


def test_every_python_block_is_run():
    unnamed = [b.splitlines()[0] for b in readme_blocks() if not any(marker in b for marker in BLOCKS.values())]
    assert not unnamed, f"README python blocks no test runs (first lines): {unnamed}; add them to BLOCKS"
    for name in BLOCKS:
        readme_block(name)  # each names one block, and its substitutions match


def test_a_stale_substitution_fails(monkeypatch):
    monkeypatch.setitem(SUBSTITUTIONS, "training loop", [("epochs=5", "epochs=1", 2)])
    with pytest.raises(AssertionError, match="has 'epochs=5' 1 times, not 2"):
        readme_block("training loop")


def slug(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's toc (mkdocs) and GitHub make it for the headings used here."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


def local_links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_every_readme_link_resolves():
    links = local_links(README.read_text())
    assert any(link.startswith("docs/") for link in links)  # the guide does link its pages
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        if not target.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {path or 'README.md'}")
    assert not broken, "README.md has broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# The `dptrain plan` command, and more\n\n```python\n# not a heading\n```\n")
    assert anchors(page) == {"the-dptrain-plan-command-and-more"}
    assert local_links("[a](docs/x.md#y) [b](https://example.org) `[c](z.md)`\n```\n[d](w.md)\n```") == [
        "docs/x.md#y", "z.md"]


def test_readme_names_every_docs_page():
    """'Where to go next' and the sections reach every guide page of docs/ (the site's nav has the rest)."""
    linked = {Path(link.partition("#")[0]).name for link in local_links(README.read_text()) if link.startswith("docs/")}
    guide = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert guide <= linked, f"docs pages the README never links: {sorted(guide - linked)}"


def test_the_cpu_install_line_brings_torchvision_with_torch():
    """torchvision requires the torch of its own release: installed later from PyPI (the test and vision extras) it
    would replace a CPU torch with PyPI's CUDA build, so the README installs the two together from the CPU index."""
    lines = [line for line in README.read_text().splitlines() if "download.pytorch.org/whl/cpu" in line]
    assert lines and all(re.search(r"pip install torch torchvision --index-url \S+/whl/cpu", line) for line in lines)


def test_training_loop_runs_learns_and_spends_at_most_the_target():
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(readme_block("training loop"), namespace)
    epsilons = [float(line.rsplit(" ", 1)[1]) for line in out.getvalue().splitlines()]
    assert len(epsilons) == 5 and epsilons == sorted(epsilons)
    engine, model = namespace["engine"], namespace["model"]
    assert 0 < epsilons[-1] <= engine.target_epsilon == 3.0
    assert engine.steps_taken == 5 * round(1 / engine.sample_rate) == 50
    x, y = namespace["train_set"].tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85, accuracy  # the README calls it training: it learns x[:, 0] > 0 (chance 0.5)


class HubStandIns:
    """What the README loads from the hub, built here: a word-level tokenizer of the README's texts, a small GPT-2
    over its vocabulary; ``calls`` counts the model's forward calls."""

    WORDS = ("<eos>", "<unk>", "the", "cat", "sees", "moon", ".", "a", "dog", "likes", "sea")

    def __init__(self):
        self.calls = 0
        self.originals: list = []  # (parameter, its value when built)

    def tokenizer(self):
        tokenizers = pytest.importorskip("tokenizers")
        transformers = pytest.importorskip("transformers")
        words = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(self.WORDS)},
                                                                 unk_token="<unk>"))
        words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        return transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="<unk>")

    def model(self):
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=len(self.WORDS), n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config).eval()  # as from_pretrained returns it
        model.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))
        self.originals += [(p, p.detach().clone()) for p in model.parameters()]
        return model

    def namespace(self) -> dict:
        return {"_small_gpt2": self.model, "_word_tokenizer": self.tokenizer}


@pytest.mark.slow
def test_trainer_block_trains_privately_and_prints_its_report(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)  # the block's output_dir="gpt2-dp"
    hub = HubStandIns()
    namespace = hub.namespace()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(readme_block("trainer"), namespace)
    engine = namespace["trainer"].privacy_engine
    assert engine.steps_taken == 3 and 0 < engine.get_epsilon() <= 3.0
    assert "after 3 of 3 planned steps (target 3, pld accountant)" in out.getvalue()  # the report, readable


@pytest.mark.slow
def test_plain_language_model_loop_trains_the_lora_adapters_only_and_steps_on_empty_batches():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    hub = HubStandIns()
    namespace = hub.namespace()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(readme_block("plain language-model loop"), namespace)
    peft_model, engine, loader = namespace["model"], namespace["engine"], namespace["loader"]
    assert engine.steps_taken == 3 * len(loader) == 6  # every batch a step, the empty ones too
    assert hub.calls < engine.steps_taken, "no empty batch was drawn: the guard went untested (change the seed)"
    epsilons = [float(line.rsplit(" ", 1)[1]) for line in out.getvalue().splitlines()]
    assert len(epsilons) == 3 and 0 < epsilons[-1] <= 3.0
    kept = {id(p) for p in peft_model.parameters()}
    assert all(id(p) in kept for p, _ in hub.originals)  # LoRA wraps the original weights, frozen
    assert all(torch.equal(p, before) for p, before in hub.originals), "a frozen weight moved"
    adapters = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert adapters and all(p.abs().sum() > 0 for p in adapters)  # lora_B starts at 0: the private steps moved it


def test_timm_models_have_nothing_the_engine_refuses():
    pytest.importorskip("timm")
    namespace: dict = {}
    models = 0
    for statement in ast.parse(readme_block("timm")).body:  # each model the block builds
        exec(compile(ast.Module([statement], []), "README.md", "exec"), namespace)
        if isinstance(statement, ast.Assign) and statement.targets[0].id == "model":
            assert dptrain.find_problems(namespace["model"]) == [], ast.unparse(statement)
            models += 1
    assert models == 3

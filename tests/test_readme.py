"""The README's code works as printed, and every link in it resolves.

The README is a guide whose details live in docs/: its links must reach those pages (and their headings), and its
code blocks are run here (the training loop whole; the fine-tuning blocks on small models standing in for the
ones a reader loads).
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


def readme_block(marker: str) -> str:
    """The python block of the README that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} python blocks of README.md contain {marker!r}"
    return found[0]


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


def test_training_loop_runs_learns_and_spends_at_most_the_target():
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(readme_block("poisson_loader(train_set"), namespace)
    epsilons = [float(line.rsplit(" ", 1)[1]) for line in out.getvalue().splitlines()]
    assert len(epsilons) == 5 and epsilons == sorted(epsilons)
    engine, model = namespace["engine"], namespace["model"]
    assert 0 < epsilons[-1] <= engine.target_epsilon == 3.0
    assert engine.steps_taken == 5 * round(1 / engine.sample_rate) == 50
    x, y = namespace["train_set"].tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85, accuracy  # the README calls it training: it learns x[:, 0] > 0 (chance 0.5)


@pytest.mark.slow
def test_hugging_face_plain_loop_trains_the_lora_adapters_only():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=12, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)  # stands in for from_pretrained(...)
    ids = torch.randint(0, 40, (24, 12))
    mask = (torch.arange(12) < torch.randint(4, 13, (24, 1))).long()
    loader = [(ids[i:i + 8], mask[i:i + 8]) for i in range(0, 24, 8)]
    namespace = {"torch": torch, "dptrain": dptrain, "model": model, "loader": loader, "train_set": range(512)}
    originals = [(p, p.detach().clone()) for p in model.parameters()]
    exec(readme_block("sequence_losses(logits"), namespace)
    peft_model, engine = namespace["model"], namespace["engine"]
    assert engine.steps_taken == len(loader)
    kept = {id(p) for p in peft_model.parameters()}
    assert all(id(p) in kept for p, _ in originals)  # LoRA wraps the original weights, frozen
    assert all(torch.equal(p, before) for p, before in originals), "a frozen weight moved"
    adapters = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert adapters and all(p.abs().sum() > 0 for p in adapters)  # lora_B starts at 0: the private steps moved it


def test_timm_models_have_nothing_the_engine_refuses():
    pytest.importorskip("timm")
    namespace = {"dptrain": dptrain}
    models = 0
    for statement in ast.parse(readme_block("timm.create_model")).body:  # each model the block builds
        exec(compile(ast.Module([statement], []), "README.md", "exec"), namespace)
        if isinstance(statement, ast.Assign) and statement.targets[0].id == "model":
            assert dptrain.find_problems(namespace["model"]) == [], ast.unparse(statement)
            models += 1
    assert models == 3

"""Private LoRA fine-tuning of a transformer classifier with PEFT, in a plain PyTorch loop.

Only the LoRA adapters of the attention projections and the classification head are
trained; the engine clips the per-sample gradients of exactly those parameters (the frozen
weights still carry the gradients back, but nothing is computed for them). Model: a small
RoBERTa built from its config (random weights, nothing downloaded). Task, generated: does
the sequence contain the token 7?

    python examples/lora_finetune.py
    python examples/lora_finetune.py --bitfit          # bias-only fine-tuning (BiTFiT) instead of LoRA
    python examples/lora_finetune.py --tiny --epochs 1  # a smoke run (too small to learn)
    python examples/lora_finetune.py --noise-seed 0     # reproducible (seeded noise: for tests, not for privacy)

Measured at the defaults (epsilon 8, 4000 sequences, 3 epochs = 93 steps of expected batch 128,
AdamW at lr 5e-2), seed 0, on a 2-core CPU shared with other jobs (load average ~3,
OMP_NUM_THREADS=1): LoRA reaches test accuracy 1.000 (always answering the commoner class:
0.615) in 17 s. BiTFiT stays at 0.615 with these settings (15 s): biases alone cannot make a
random-weight model find the marker (it is meant for pretrained weights). The test runs LoRA
on 2000 sequences (0.99).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from tqdm import tqdm
from transformers import RobertaConfig, RobertaForSequenceClassification

import dptrain
from dptrain.data import poisson_loader

VOCAB, PAD, MARK = 50, 1, 7


def marked_sequences(n: int, length: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, VOCAB, (n, length), generator=g)  # ids 0-7 are special / the marker
    y = torch.randint(0, 2, (n,), generator=g)
    where = torch.randint(0, length, (n,), generator=g)
    ids[y == 1, where[y == 1]] = MARK
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, PAD))
    y = (ids == MARK).any(1).long()  # the marker may have landed in the padding
    return torch.utils.data.TensorDataset(ids, mask, y)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a very small model and dataset (CI)")
    parser.add_argument("--bitfit", action="store_true", help="train only the biases instead of LoRA adapters")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--batch-size", type=int, default=None, help="expected batch size (default 128; --tiny 32)")
    parser.add_argument("--lr", type=float, default=5e-2, help="AdamW learning rate")
    parser.add_argument("--samples", type=int, default=None, help="training sequences (default 4000; --tiny 256)")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--clipping-mode", default="bk-mixopt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-seed", type=int, default=None,
                        help="seed the privacy noise too, for a reproducible run (default: fresh noise from the "
                             "operating system, as a private run needs)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    length = 12
    train = marked_sequences(args.samples or (256 if args.tiny else 4000), length, args.seed)
    test = marked_sequences(256 if args.tiny else 1000, length, args.seed + 1)
    width, layers = (16, 1) if args.tiny else (64, 2)
    config = RobertaConfig(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=layers, num_attention_heads=2,
                           intermediate_size=2 * width, max_position_embeddings=length + 2, pad_token_id=PAD,
                           num_labels=2)
    model = RobertaForSequenceClassification(config)
    if args.bitfit:
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("bias"))
    else:  # adapters on the attention projections; SEQ_CLS keeps the classifier head trainable
        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.1,
                                                 target_modules=["query", "value"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    batch_size = args.batch_size or (32 if args.tiny else 128)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine = dptrain.PrivacyEngine(
        model, batch_size=batch_size, sample_size=len(train), max_grad_norm=1.0,
        target_epsilon=args.epsilon, epochs=args.epochs, clipping_mode=args.clipping_mode, seed=args.noise_seed,
    )
    engine.attach(optimizer)
    loader = poisson_loader(train, batch_size=batch_size, generator=torch.Generator().manual_seed(args.seed))

    steps = 0
    model.train()  # LoRA dropout on: its randomness is per sample, which per-sample clipping allows
    bar = tqdm(total=engine.planned_steps, unit="step", desc="BiTFiT" if args.bitfit else "LoRA", disable=args.quiet)
    while steps < engine.planned_steps:
        for ids, mask, y in loader:
            if steps == engine.planned_steps:
                break
            if len(y):
                logits = model(input_ids=ids, attention_mask=mask).logits
                losses = F.cross_entropy(logits, y, reduction="none")
                engine.backward(losses)
                bar.set_postfix(loss=f"{losses.mean().item():.3f}", refresh=False)
            optimizer.step()  # an empty Poisson batch still takes a (noise-only) step
            optimizer.zero_grad()
            steps += 1
            bar.update(1)
    bar.close()

    model.eval()
    with torch.no_grad():
        ids, mask, y = test.tensors
        accuracy = (model(input_ids=ids, attention_mask=mask).logits.argmax(1) == y).float().mean().item()
    majority = max(y.float().mean().item(), 1 - y.float().mean().item())  # always answering the commoner class
    epsilon = engine.get_epsilon()
    engine.detach()
    what = "BiTFiT" if args.bitfit else "LoRA"
    print(f"{what}: {trainable} of {total} parameters trained, {steps} private steps, test accuracy "
          f"{accuracy:.3f} (majority class {majority:.3f}), epsilon {epsilon:.2f} (delta {engine.target_delta:.1e})")
    return {"accuracy": accuracy, "majority": majority, "epsilon": epsilon, "steps": steps, "trainable": trainable}


if __name__ == "__main__":
    main()

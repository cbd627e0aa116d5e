"""Train a tiny Llama on flashledger's own documentation, with flashledger's attention and with SDPA.

A character-level language model (a random-initialised Llama from
transformers. configuration: 2 layers, hidden 64, 4 query / 2 key-value
heads) learns the repository's README and docs/*.md. Two copies start from
the same weights and see the same batches; one runs flashledger's attention
(``register()``), the other PyTorch's SDPA. Both loss curves go into one PNG;
with dropout off they should lie on top of each other (float32 roundoff
apart: float32 training amplifies the last-bit differences of two correct
attention kernels step by step, which the lower panel shows), with dropout
on each backend draws its own masks and the curves follow each other without
coinciding.

    .venv/bin/python examples/train_tiny_lm.py                   # 300 steps, about a minute
    .venv/bin/python examples/train_tiny_lm.py --steps 600 --dropout 0.1 --out loss.png

It ends with a short greedy sample from each model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import flashledger as fl
from flashledger.integrations.transformers import random_model, register

ROOT = Path(__file__).resolve().parents[1]


def corpus() -> str:
    """The README and every docs/*.md, joined."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq", type=int, default=96, help="characters per sequence (default 96)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout (default 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "docs/img/train_loss.png"), help="the plot (PNG)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "hidden", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    text = corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)  # (N,)
    if data.numel() <= args.seq + 1:
        raise SystemExit(f"the corpus has {data.numel()} characters; --seq must be smaller")
    build = dict(
        layers=args.layers,
        hidden=args.hidden,
        heads=4,
        kv_heads=2,
        vocab=len(chars),
        max_positions=args.seq,
        dropout=args.dropout,
        seed=args.seed,
    )
    models = {
        "flashledger": random_model("llama", attn_implementation=register(), **build),
        "SDPA": random_model("llama", attn_implementation="sdpa", **build),
    }
    opts = {n: torch.optim.AdamW(m.parameters(), lr=args.lr) for n, m in models.items()}
    losses: dict[str, list[float]] = {n: [] for n in models}
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"{len(text):,} characters of README.md and docs/*.md, {len(chars)} symbols; "
        f"{args.steps} steps of {args.batch} x {args.seq}"
    )
    for m in models.values():
        m.train()
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=gen)
        ids = torch.stack([data[s : s + args.seq] for s in starts.tolist()])  # (B, L)
        order = list(models) if step % 2 == 0 else list(models)[::-1]  # neither always first
        for name in order:
            model = models[name]
            opts[name].zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opts[name].step()
            losses[name].append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            cells = "  ".join(f"{n} {v[-1]:.4f}" for n, v in losses.items())
            print(f"step {step:4d}  loss  {cells}")
    diff = max(abs(a - b) for a, b in zip(losses["flashledger"], losses["SDPA"]))
    print(f"largest loss difference over {args.steps} steps: {diff:.3g}")
    plot(losses, args)
    prompt = torch.tensor([[index[c] for c in "flashledger "]])
    for name, model in models.items():
        model.eval()
        with fl.ledger_of(model) if name == "flashledger" else contextlib.nullcontext():
            out = model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=60,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        sample = "".join(chars[i] for i in out[0].tolist()).replace("\n", " ")
        print(f"{name:>11} sample: {sample!r}")
    return 0


def plot(losses: dict[str, list[float]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(
        2, 1, figsize=(7, 5), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    styles = {"SDPA": dict(lw=3.0, alpha=0.45), "flashledger": dict(lw=1.2, ls="--")}
    steps = range(1, len(losses["SDPA"]) + 1)
    for name, values in losses.items():
        ax.plot(steps, values, label=name, **styles[name])
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(
        f"Tiny Llama ({args.layers} layers, hidden {args.hidden}) on flashledger's docs, "
        f"dropout {args.dropout:g}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    gap = [abs(a - b) for a, b in zip(losses["flashledger"], losses["SDPA"])]
    dx.semilogy(steps, [max(g, 1e-12) for g in gap], color="0.3", lw=0.8)
    dx.set_ylabel("|difference|\n(0 drawn at 1e-12)", fontsize=8)
    dx.set_xlabel("step")
    dx.grid(alpha=0.3)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"plot saved to {args.out}")


if __name__ == "__main__":
    sys.exit(main())

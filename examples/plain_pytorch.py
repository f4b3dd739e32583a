"""K-FAC without Lightning: ``KFACPreconditioner`` in a hand-written PyTorch training loop.

    python examples/plain_pytorch.py             # 8 epochs on the 8x8 digits, a few seconds
    python examples/plain_pytorch.py --epochs 2  # quicker

The only K-FAC lines are building the preconditioner and calling ``pre.step(opt)`` between
``loss.backward()`` and ``opt.step()``: it rewrites the ``.grad`` of every Linear/Conv2d layer.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.demo.digits import load_digits_tensors, stratified_split


def main(epochs: int = 8, seed: int = 0) -> float:
    torch.manual_seed(seed)
    x, y = load_digits_tensors()  # (1797, 1, 8, 8) in [0, 1], labels 0..9; bundled with scikit-learn
    train_idx, val_idx = stratified_split(y, val_fraction=0.2, seed=seed)
    x_train, y_train, x_val, y_val = x[train_idx], y[train_idx], x[val_idx], y[val_idx]

    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )
    batch_size = 64
    steps = epochs * -(-len(x_train) // batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.15, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    pre = KFACPreconditioner(
        model,
        damping=0.03,
        kl_clip=1e-3,
        factor_decay=0.95,
        inv_update_steps=5,
    )

    gen = torch.Generator().manual_seed(seed)
    acc = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        total_loss = 0.0
        for batch in torch.randperm(len(x_train), generator=gen).split(batch_size):
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            pre.step(opt)  # precondition in place; the KL clip follows opt's (scheduled) lr
            opt.step()
            sched.step()
            total_loss += loss.item() * len(batch)
        model.eval()
        with torch.no_grad():
            acc = (model(x_val).argmax(1) == y_val).float().mean().item()
        print(f"epoch {epoch}: train loss {total_loss / len(x_train):.3f}, val acc {acc:.2%}")
    pre.remove_hooks()
    return acc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.epochs, args.seed)

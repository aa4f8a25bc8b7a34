"""Training-time measures on small problems, side by side:
1. local complexity of mlp-small during digits training (train / val / random points, radius 0.5,
   16 frame vertices) -- the grokking progress measure;
2. a catapult: full-batch GD on a width-1024 two-layer ReLU net (NTK parameterisation, n=16) at
   0.5x and 1.5x the critical step 2/lambda_0: peak loss, final loss, final lambda vs 2/eta;
3. AGOP alignment with the true AGOP of a rank-1 target y = relu(w.x), for SGD at two batch sizes.

    python bench/measures.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def local_complexity_run(epochs: int = 30) -> None:
    from efficient.data.vision import digits
    from efficient.metrics import local_complexity
    from efficient.zoo import create

    torch.manual_seed(0)
    data = digits(image_size=16)
    xt, yt = data.train.x, data.train.y
    xv, yv = data.val.x, data.val.y
    norm = lambda t: (t - 0.3) / 0.38  # noqa: E731
    xt, xv = norm(xt), norm(xv)
    xr = torch.randn(64, 1, 16, 16)
    model = create("mlp-small")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    print("| epoch | train acc | val acc | LC train | LC val | LC random |")
    print("|---|---|---|---|---|---|")
    for ep in range(epochs + 1):
        if ep in (0, 1, 2, 5, 10, 20, 30):
            with torch.no_grad():
                acc_t = (model(xt).argmax(1) == yt).float().mean().item()
                acc_v = (model(xv).argmax(1) == yv).float().mean().item()
            lc = [local_complexity(model, (x[:64],), radius=0.5, n_frame=16)["lc"] for x in (xt, xv, xr)]
            print(f"| {ep} | {acc_t:.3f} | {acc_v:.3f} | {lc[0]:.1f} | {lc[1]:.1f} | {lc[2]:.1f} |")
        perm = torch.randperm(len(xt))
        for i in range(0, len(xt) - 63, 64):
            idx = perm[i : i + 64]
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def catapult_run() -> None:
    from efficient.metrics import ntk_top_eigenvalue
    from efficient.models.mlp import NTKTwoLayer

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)
    print("| step / (2/lambda_0) | initial loss | peak loss | final loss | lambda_0 | lambda_final | 2/eta |")
    print("|---|---|---|---|---|---|---|")
    for factor in (0.5, 1.5):
        net = NTKTwoLayer(5, 1024, 0)
        lam0 = ntk_top_eigenvalue(net, (x,))["ntk_top_eig"]
        lr = factor * 2 / lam0
        losses = []
        for _ in range(200):
            loss = 0.5 * ((net(x) - y) ** 2).mean()
            losses.append(loss.item())
            net.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= lr * p.grad
        lam_t = ntk_top_eigenvalue(net, (x,))["ntk_top_eig"]
        print(f"| {factor} | {losses[0]:.3f} | {max(losses):.3f} | {losses[-1]:.4f} | {lam0:.3f} | {lam_t:.3f} | {2 / lr:.3f} |")


def agop_run(steps: int = 400) -> None:
    from efficient.metrics import agop_alignment

    g = torch.Generator().manual_seed(0)
    d = 10
    w = torch.randn(d, generator=g)
    w /= w.norm()
    x = torch.randn(512, d, generator=g)
    yv = torch.relu(x @ w)[:, None]
    # true AGOP of f*(x) = relu(w.x): E[1{w.x > 0}] w w^T = 0.5 w w^T (up to scale, w w^T)
    target = torch.outer(w, w)
    print("| batch size | AGOP alignment with w w^T after SGD | train MSE |")
    print("|---|---|---|")
    for bs in (8, 256):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        for s in range(steps):
            idx = torch.randint(0, 512, (bs,))
            loss = F.mse_loss(net(x[idx]), yv[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        al = agop_alignment(net, (x[:128],), target=target)["agop_align"]
        print(f"| {bs} | {al:.3f} | {F.mse_loss(net(x), yv).item():.4f} |")


def main() -> None:
    torch.set_num_threads(1)
    local_complexity_run()
    print()
    catapult_run()
    print()
    agop_run()


if __name__ == "__main__":
    main()

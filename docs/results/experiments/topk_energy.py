"""Issue 16 experiment: how much of the gradient's energy (squared norm) a 1 % top-k keeps, per
tensor, on the byte-level LSTM and on the Transformer LM, during dense SGD training (lr 0.5,
momentum 0.9, clip 1.0, batch 128 = the 4 workers' 4 x 32). One process, about a minute:
``python docs/results/experiments/topk_energy.py``. Output in docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from gradsync.apps.data.embedded import load_text_bundle
from gradsync.apps.models import build_model_for


def batches(data: torch.utils.data.Dataset, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = len(data)  # type: ignore[arg-type]
    while True:
        items = [data[int(i)] for i in torch.randint(n, (128,), generator=g)]
        x = torch.stack([torch.as_tensor(a) for a, _ in items])
        y = torch.stack([torch.as_tensor(b) for _, b in items])
        yield x, y


def main() -> None:
    torch.set_num_threads(1)
    bundle = load_text_bundle(64)
    for name in ("lstm", "transformer"):
        torch.manual_seed(0)
        model = build_model_for(name, "lm", bundle.input_shape, bundle.num_classes)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        data = batches(bundle.train, 1)
        for step in range(301):
            x, y = next(data)
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1).long())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step % 100 == 0:
                rows = []
                for pname, p in model.named_parameters():
                    assert p.grad is not None
                    g = p.grad.flatten().double()
                    energy = float((g * g).sum())
                    kept = float((g.abs().topk(max(1, int(g.numel() * 0.01))).values ** 2).sum())
                    rows.append((pname, g.numel(), energy, kept))
                total, kept = sum(r[2] for r in rows), sum(r[3] for r in rows)
                print(f"{name} step {step} loss {loss.item():.3f} top-1% energy {kept / total:.3f}")
                if step == 300:
                    for pname, numel, energy, k in sorted(rows, key=lambda r: -r[2])[:8]:
                        share = f"share {energy / total:.3f} top-1% {k / energy if energy else 0:.3f}"
                        print(f"   {pname:40s} {numel:7d} {share}")
            opt.step()


if __name__ == "__main__":
    main()

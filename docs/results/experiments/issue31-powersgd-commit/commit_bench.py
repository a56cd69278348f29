"""PowerSGD's finisher in the engine, before and after: error feedback's commit of P Q^T and the
reconstruction of the summed matrix, for VGG's largest layer (4096 x 4096, rank 4), one thread.

before: the product P Q^T built as a new 64 MiB tensor, then subtracted from the residual;
after:  the residual updated in place by ``addmm_(P, Q^T, alpha=-1)`` (``ErrorFeedback.commit(factors=)``).
Both then reconstruct ``P Q_sum^T`` into the gradient. The two are timed alternately, and the
residuals they leave are compared bit for bit.

Run: python docs/results/experiments/issue31-powersgd-commit/commit_bench.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch


def main() -> None:
    torch.set_num_threads(1)
    n = m = 4096
    r = 4
    gen = torch.Generator().manual_seed(0)
    p, q, q_sum = (torch.randn(k, r, generator=gen) for k in (n, m, m))
    start = torch.randn(n * m, generator=gen)
    v_before, v_after, x = start.clone(), start.clone(), torch.empty(n, m)

    def before() -> None:
        v_before.sub_((p @ q.T).reshape(-1))
        torch.mm(p, q_sum.T, out=x)

    def after() -> None:
        v_after.view(n, m).addmm_(p, q.T, alpha=-1)
        torch.mm(p, q_sum.T, out=x)

    a, b = [], []
    for i in range(22):
        for fn, out in ((before, a), (after, b)) if i % 2 else ((after, b), (before, a)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    a, b = a[2:], b[2:]  # the first calls allocate
    result = {
        "before_ms": statistics.median(a) * 1e3,
        "after_ms": statistics.median(b) * 1e3,
        "ratio_per_pair": statistics.median(x / y for x, y in zip(a, b, strict=True)),
        "same_residual_bits": bool(torch.equal(v_before, v_after)),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

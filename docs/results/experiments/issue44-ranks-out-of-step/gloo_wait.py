"""Does a rank waiting in a gloo collective use a core? Rank 1 sleeps 2 s before each all-reduce;
rank 0 reports the wall and CPU time it spent waiting, on the main thread, on a side thread (as
the engine's communication thread waits) and on an async work.

    torchrun --standalone --nproc-per-node 2 gloo_wait.py
"""

import threading
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    r = dist.get_rank()
    x = torch.zeros(1 << 20)
    dist.all_reduce(x)  # warm

    def run() -> tuple[float, float]:
        if r == 1:
            time.sleep(2.0)
        c0, w0 = time.process_time(), time.perf_counter()
        dist.all_reduce(x)
        return time.process_time() - c0, time.perf_counter() - w0

    cpu, wall = run()
    print(f"rank {r} main thread: waited {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
    out: dict[str, tuple[float, float]] = {}
    t = threading.Thread(target=lambda: out.update(v=run()))
    t.start()
    t.join()
    print(f"rank {r} side thread: waited {out['v'][1]:.2f} s wall, {out['v'][0]:.2f} s CPU", flush=True)
    if r == 1:
        time.sleep(2.0)
    c0, w0 = time.process_time(), time.perf_counter()
    h = dist.all_reduce(x, async_op=True)
    assert h is not None
    h.wait()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    print(f"rank {r} async: waited {wall:.2f} s wall, {cpu:.2f} s CPU")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

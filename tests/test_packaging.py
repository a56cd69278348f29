"""The library installs and runs with torch alone; the command line's own dependencies are the
``apps`` extra, and without them ``gradsync`` says which extra to install instead of failing
with a traceback.

The subprocesses make the apps' packages unimportable before gradsync is imported, as if only
torch were installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradsync.apps.commands import APP_MODULES, INSTALL_APPS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

# numpy too: torch does not depend on it, so the library must not either. A None entry in
# sys.modules is what Python treats as a package that is not there: `import` raises
# ModuleNotFoundError and importlib.util.find_spec answers None (torch asks it that way).
BLOCKER = textwrap.dedent(
    f"""
    import sys

    BLOCKED = {sorted(APP_MODULES)!r}
    for name in BLOCKED:
        sys.modules[name] = None
    """
)

# torch itself warns once at import when numpy is missing; that line is torch's, not ours
QUIET_TORCH = ["-W", "ignore:Failed to initialize NumPy:UserWarning"]

LIBRARY_RANK = textwrap.dedent(
    """
    import datetime
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync

    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)

    # the codecs, without a process group
    for spec in ("mstopk:density=0.05+ef", "topk:density=0.05", "fp16", "onebit+ef", "terngrad",
                 "powersgd:rank=2"):
        codec = gradsync.build_codec(spec)
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
        payload = codec.encode(x, gradsync.EncodeContext(key="w"))
        assert payload.nbytes < 4 * x.numel() and codec.decode(payload).shape == x.shape, spec

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    topo = gradsync.Topology(nodes=world, per_node=1)  # every rank its own node: compressed

    # Tensors handed to a gloo collective stay referenced here until the process ends: gloo's
    # worker thread lets go of its own references after the caller's wait returns, and if the
    # Python objects are gone by then it needs the GIL to free them; a worker that gets there
    # only once the interpreter is shutting down aborts the process ("terminate called without
    # an active exception"; PyTorch's own behaviour: this script without gradsync in it aborted
    # so in 3 of 29 runs). gradsync's exit hook also leaves gloo's workers a moment to finish.
    KEEP = []

    def same_on_every_rank(grads, what):
        flat = torch.cat([g.reshape(-1) for g in grads])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        KEEP.append((flat, everyone))
        assert all(torch.equal(flat, other) for other in everyone), what

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    # gradsync.wrap: compressed synchronization on the engine
    model = gradsync.wrap(mlp(), "hitopk:density=0.1", topo, plan="compress", min_compress_bytes=0,
                          calibrate=False, log_plan=False)
    for step in range(3):
        model.zero_grad()
        torch.manual_seed(10 * step + rank)
        model(torch.randn(8, 32)).square().mean().backward()
    assert model.last_stats is not None and not model.last_stats.dense
    same_on_every_rank([p.grad for p in model.module.parameters()], "wrap")
    model.close()

    # the DDP comm hook
    ddp = DDP(mlp())
    gradsync.register_comm_hook(ddp, "powersgd:rank=2", topo, plan="compress", min_compress_bytes=0,
                                calibrate=False, log_plan=False)
    for step in range(3):
        ddp.zero_grad()
        torch.manual_seed(10 * step + rank)
        ddp(torch.randn(8, 32)).square().mean().backward()
    same_on_every_rank([p.grad for p in ddp.module.parameters()], "DDP hook")

    dist.barrier()
    dist.destroy_process_group()
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED and sys.modules[m] is not None)
    assert not loaded, loaded
    print("library ok")
    """
)


def _requirement_names(requirements: list[str]) -> list[str]:
    return [re.match(r"[A-Za-z0-9._-]+(\[[^\]]*\])?", r.strip()).group(0).lower() for r in requirements]


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with PYPROJECT.open("rb") as fh:
        return tomllib.load(fh)


def test_core_dependencies_are_torch_only():
    project = _pyproject()["project"]
    assert _requirement_names(project["dependencies"]) == ["torch"]
    extras = project["optional-dependencies"]
    # the CLI's list of what it needs (its install hint) and the apps extra are the same packages
    assert sorted(_requirement_names(extras["apps"])) == sorted(APP_MODULES.values())
    # the tests run the command line: the test extra brings the apps extra along
    assert "gradsync[apps]" in _requirement_names(extras["test"])


def test_library_runs_without_the_apps_dependencies(tmp_path):
    """Codecs, ``gradsync.wrap`` and the DDP hook in a real 2-rank gloo world (FileStore in a
    temporary folder), with rich, numpy, scikit-learn, pillow and matplotlib unimportable."""
    script = tmp_path / "rank.py"
    script.write_text(BLOCKER + LIBRARY_RANK)
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, *QUIET_TORCH, str(script), str(rank), "2", store],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for (out, err), p in zip(outs, procs, strict=True):
        assert p.returncode == 0, err
        assert "library ok" in out


def test_import_gradsync_leaves_the_heavy_optional_parts_of_torch_alone():
    """Every process of a world imports gradsync: DTensor's module (and with it sympy), triton
    and torchft load only when used (FSDP2, the fused kernels, --fault-tolerant)."""
    code = (
        "import sys, gradsync\n"
        "heavy = ('torch.distributed.tensor', 'sympy', 'triton', 'torchft')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _cli_without_apps(*argv: str) -> subprocess.CompletedProcess[str]:
    code = BLOCKER + f"from gradsync.apps.commands import main\nsys.exit(main({list(argv)!r}))\n"
    return subprocess.run(
        [sys.executable, *QUIET_TORCH, "-c", code], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("argv", [["train", "--nodes", "2", "--per-node", "2"], ["codecs"]])
def test_cli_without_the_apps_extra_names_it(argv):
    done = _cli_without_apps(*argv)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one line, no traceback
    assert INSTALL_APPS in lines[0] and 'pip install "gradsync[apps]"' in lines[0]
    assert "rich" in lines[0] and "scikit-learn" in lines[0]
    assert done.stdout == ""

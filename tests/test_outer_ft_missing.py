"""Without torchft (the optional extra gradsync[ft]) gradsync imports and runs, and asking for
fault tolerance says how to install it, in the library and on the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys
sys.modules["torchft"] = None  # as if it were not installed: importing it raises ImportError
import gradsync, gradsync.outer
from gradsync.outer.ft import FaultTolerance, FaultTolerantOuterLoop, start_lighthouse
assert "torchft" not in {m for m in sys.modules if sys.modules[m] is not None}
import torch
try:
    FaultTolerantOuterLoop(torch.nn.Linear(2, 2), fault_tolerance=FaultTolerance("http://127.0.0.1:1", "n0"))
except ImportError as e:
    print("library:", e)
try:
    start_lighthouse()
except ImportError as e:
    print("lighthouse:", e)
from gradsync.apps.commands import main
argv = ["train", "--epochs", "1", "--outer", "4", "--nodes", "2", "--per-node", "1", "--fault-tolerant"]
sys.exit(main(argv))
"""


@pytest.mark.timeout(120)
def test_fault_tolerance_without_torchft_names_the_extra():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=110)
    assert done.returncode == 2, done.stderr[-2000:]
    wanted = "library: fault tolerance needs torchft, which is not installed: pip install 'gradsync[ft]'"
    assert wanted in done.stdout
    assert "lighthouse: fault tolerance needs torchft" in done.stdout
    assert "--fault-tolerant: fault tolerance needs torchft" in done.stderr

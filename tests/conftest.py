import pytest
import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.backend import backend as operator_backend

BACKENDS = ["torch", "native"] if native.AVAILABLE else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run a test once per operator backend (torch always, native where built)."""
    with operator_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)

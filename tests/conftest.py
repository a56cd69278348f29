import pytest
import torch

from gradsync.codecs.ops import native

BACKENDS = ["torch", "native"] if native.AVAILABLE else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run a test once per operator backend (torch always, native where built)."""
    with native.backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)

import importlib.util
import os

import pytest
import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.backend import backend as operator_backend


def _load_triton_for_the_interpreter() -> None:
    """Without CUDA, triton can only interpret, and it fixes that mode for its own library
    (tl.max, tl.sum ...) when triton.language is first imported: by torch.compile, by a codec
    asking whether kernels run, by anyone. Import it here under TRITON_INTERPRET=1 so that
    tests/test_kernels.py can interpret its kernels whichever test file ran first; the variable
    itself is restored, so no other test runs the kernels."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except Exception:  # broken against this torch: test_kernels says so itself
        pass
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


_load_triton_for_the_interpreter()

BACKENDS = ["torch", "native"] if native.AVAILABLE else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run a test once per operator backend (torch always, native where built)."""
    with operator_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)

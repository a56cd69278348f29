"""The ``@triton.jit`` kernels of :mod:`gradsync.codecs.kernels`, one module per public module
(``common`` holds the inlined helpers). Imported only when a kernel is launched
(:func:`gradsync.codecs.kernels.launch.module`), since importing defines the kernels and
triton fixes compile-or-interpret then. Kernel parameters carry no annotations other than
``tl.constexpr``: triton reads annotations to specialize arguments."""

"""Build hook for the optional native kernels (gradsync._native).

Everything else is configured in pyproject.toml. The extension is plain C against the Python
C-API (no torch headers, so the build environment never needs torch). It is built on x86-64 only
and is optional: if the compiler is missing the install still succeeds and gradsync runs on its
pure-torch operators.
"""

import platform

from setuptools import Extension, setup

ext_modules = []
if platform.machine().lower() in {"x86_64", "amd64"} and platform.system() != "Windows":
    ext_modules.append(
        Extension(
            "gradsync._native",
            sources=["src/gradsync/_native.c"],
            # -falign-loops=64: every kernel loop starts on a cache line, so a short hot loop never
            # straddles two (measured: the 2-bit lut_unpack loop ran 25% slower when an unrelated
            # edit of the file moved it across a 64-byte boundary)
            extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing", "-falign-loops=64"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)

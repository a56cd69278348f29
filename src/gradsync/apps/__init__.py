"""gradsync's applications, on top of the library: every ``gradsync`` command
(:mod:`gradsync.apps.commands`, benchmarks included), the training job (``train``), its datasets
and data cache (``data``), its models (``models``) and the emulated cluster (``cluster``).

They need the ``apps`` extra (``pip install "gradsync[apps]"``); the library does not import them.
"""

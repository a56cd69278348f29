"""PyTorch Lightning integration: ``Trainer(strategy=gradsync.lightning.Strategy("hitopk:density=0.01"))``.

See :mod:`gradsync.integrate.lightning`. Needs ``pip install 'gradsync[lightning]'``."""

from gradsync.integrate.lightning import Strategy

__all__ = ["Strategy"]

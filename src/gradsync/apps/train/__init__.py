"""The ``gradsync train`` job: options, the training loop, checkpoints, metrics. Its command is
:mod:`gradsync.apps.commands.train`."""

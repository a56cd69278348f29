"""``gradsync train``: real multi-process training on embedded data with any gradsync scheme."""

from gradsync.train.launch import add_arguments, check, main

__all__ = ["add_arguments", "check", "main"]

"""The command line a result records: the emulating parent's (with --emulate) in its nodes'
processes, else the process's own."""

import argparse
import os

from gradsync.apps.command_line import COMMAND_LINE_ENV, command_line, passed_down


def test_a_node_process_records_the_parents_command(monkeypatch):
    monkeypatch.delenv(COMMAND_LINE_ENV, raising=False)
    child = argparse.Namespace(argv=["bench", "whatif", "--model", "vgg"])
    assert command_line(child) == "gradsync bench whatif --model vgg"
    typed = ["bench", "whatif", "--emulate", "2x2", "--link", "100mbit", "--contenders", "a,b c"]
    with passed_down(typed):
        # what a node's process (started inside the block) reads from its environment
        assert os.environ[COMMAND_LINE_ENV] == (
            "gradsync bench whatif --emulate 2x2 --link 100mbit --contenders 'a,b c'"
        )
        assert command_line(child) == os.environ[COMMAND_LINE_ENV]
    assert COMMAND_LINE_ENV not in os.environ  # restored: later commands record their own
    assert command_line(child) == "gradsync bench whatif --model vgg"

"""The outer loop of the DiLoCo family (:mod:`gradsync.outer.loop`): workers that meet every H
inner steps, their pseudo-gradients averaged through gradsync's codecs and hierarchical
collectives, optionally streamed in fragments that overlap the inner steps; with live recovery
through torchft in :mod:`gradsync.outer.ft` (which imports torchft only when used)."""

from gradsync.outer.ft import FaultTolerance, FaultTolerantOuterLoop, start_lighthouse
from gradsync.outer.loop import OuterLoop
from gradsync.outer.schedule import split_fragments  # the fragments' cut, shared with whatif

__all__ = ["FaultTolerance", "FaultTolerantOuterLoop", "OuterLoop", "split_fragments", "start_lighthouse"]

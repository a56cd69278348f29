"""The outer loop of the DiLoCo family (:mod:`gradsync.outer.loop`): workers that meet every H
inner steps, their pseudo-gradients averaged through gradsync's codecs and hierarchical
collectives, optionally streamed in fragments that overlap the inner steps."""

from gradsync.outer.loop import OuterLoop
from gradsync.sync.buckets import split_fragments  # the fragments' cut, shared with whatif

__all__ = ["OuterLoop", "split_fragments"]

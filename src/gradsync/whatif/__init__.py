"""The what-if simulator (network-bottleneck paper): step time, exposed synchronization and scaling
factor of any contender on any cluster and network, predicted from a profile by a discrete-event
simulation over the cost model of :mod:`gradsync.collectives.cost`. See docs/whatif.md.

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

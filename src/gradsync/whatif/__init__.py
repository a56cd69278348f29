"""The what-if simulator (paper 02): step time, exposed synchronization and scaling factor of
any contender on any cluster and network, predicted from a profile by a discrete-event
simulation over the cost model of :mod:`gradsync.collectives.cost`. See docs/whatif.md."""

"""The planner: decides how each bucket is synchronized, from a cost model and measurements.

- :mod:`~gradsync.planner.plan`: the plan itself (per bucket: its parameters, codec, strategy,
  parts and predicted times), as the tensor rank 0 broadcasts and as checkpoint state.
- :mod:`~gradsync.planner.decide`: the first plan (calibrate the links, time the codecs on this
  machine, decide on rank 0 from the α–β cost model of :mod:`gradsync.collectives.cost`,
  broadcast), per bucket the cheapest of dense and compressed.
- :mod:`~gradsync.planner.recut`: merging compressed buckets whose launches would queue.
- :mod:`~gradsync.planner.closed_loop` and :mod:`~gradsync.planner.replan`: re-planning while
  training, from what the buckets cost in the running engine (the refit of the links).
- :mod:`~gradsync.planner.trials`: the closed loop's trials, plans of one codec alone measured
  in the running engine (the fastest measured plan stays).
- :mod:`~gradsync.planner.explain`: why each parameter went where it went.
- :mod:`~gradsync.planner.engine_costs`: the refit saved for ``gradsync whatif --costs``.

It decides and never touches gradients: the engine (:mod:`gradsync.integrate.engine`) installs a
plan and the sync core (:mod:`gradsync.sync`) runs it.
"""

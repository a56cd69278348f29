"""Observability: what the engine and the model did, measured, never decided here.

- :mod:`gradsync.observe.profiler`: per-parameter gradient-ready times of a model's step
  (``gradsync profile``), written as a versioned JSON profile (:mod:`~gradsync.observe.profile_format`,
  its fields read by :mod:`~gradsync.observe.profile_fields`);
- :mod:`gradsync.observe.trace`: a Chrome trace-event timeline of every synchronization
  (``--trace``), one process per rank, clock-aligned, with flows bucket -> encode -> collective
  (events: :mod:`~gradsync.observe.trace_events`; clocks: :mod:`~gradsync.observe.trace_clock`;
  reading, merging and checking traces: :mod:`~gradsync.observe.trace_read`);
- :mod:`gradsync.observe.telemetry`: per-step, per-bucket figures (bytes, ratio, exposed time);
- :mod:`gradsync.observe.nic`: NIC counter sampling, achieved throughput against the link rate.

This package reads the sync engine's events; it imports nothing from the apps.
"""

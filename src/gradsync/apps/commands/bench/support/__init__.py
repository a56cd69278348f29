"""What the benchmarks share and none of them is: results written out (``output``), timing in
interleaved rounds (``timing``), joining the world and reading the testbed (``world``), the
FSDP2 layouts (``sharding``), the outer loop's own work (``own_work``) and the NIC's counters
(``nic``). Every module beside this package in ``bench/`` is one ``gradsync bench`` command."""

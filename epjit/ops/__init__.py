"""One home per kernel family, between the user API (``epjit.Buffer``) and the kernels.

Each family module owns its protocol constants and status bits (public names, the same way in every family), the
decoding of its host records, its outputs and its launches (arguments by name):

- :mod:`epjit.ops.layout`: get_dispatch_layout (normal mode's counts per rank and expert);
- :mod:`epjit.ops.intranode`: normal mode inside one NVLink node (notify, dispatch, combine);
- :mod:`epjit.ops.low_latency`: low-latency mode (fixed slots on the NVSHMEM symmetric heap);
- :mod:`epjit.ops.internode`: normal mode across NVLink nodes (the NVLink and RDMA legs).

What both normal-mode families share: :mod:`epjit.ops.normal` (the inputs records, plans, handle and results that
cross the boundary) and :mod:`epjit.ops.notify` (notify's host records and the output estimate). The checks and plan
caches above each family are its front's (epjit.front).

Shared by all: :mod:`epjit.ops.streams` (the stream and event policy), :mod:`epjit.ops.profile` (EPJIT_PROFILE)
and :mod:`epjit.ops.loader` (kernel modules).
"""

"""An emulated drive: one file served over FUSE from memory through a device model.

So that the regime where queue depth matters (an NVMe drive) can be measured on any machine, and
a SATA drive's too: the kernel's page cache, faults, readahead and memory-cgroup reclaim stay
real, only the device is modelled (a latency per request, a bus bandwidth shared by the requests in
flight, at most N requests in service).

- ``onebit-emudrive.c``: the FUSE file system (libfuse3's low-level API, multithreaded), in C;
- ``emudrive``: builds it into the cache on first use, ``mounted(model, profile, read_ahead_kb)``;
- ``profiles``: the ``nvme`` and ``sata`` profiles, their numbers from public drive specs;
- ``fiocheck``: fio against the mount for each profile, the table of docs/drive.md.
"""

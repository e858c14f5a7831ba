"""Sandboxes: the backend-neutral interface (`interface`), the backend that opens one
(`backend`), bubblewrap's parts (`bwrap`, `layout`, `exec_protocol`, `spawner`, `host_state`,
`overlay`, `python`, `ctty`, `sched_slice`), a pool of warm sandboxes (`pool`) and the parity
probe of a sandbox against the host (`parity`)."""

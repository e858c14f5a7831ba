"""A task's world: its OS image (`image`, unpacked from `layers`), its starting repository at a
commit (`repo`), the two opened as a sandbox (`task_world`), and its patches read against that
repository (`patches`: hidden tests, gold changes, reference edits)."""

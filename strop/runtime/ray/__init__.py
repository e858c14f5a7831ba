"""Placing a run on Ray: its actors (engines, rollout workers, the trainer and its ranks) placed by
node label (`actors`, `trainer`, `placement`), one relay per inference cluster (`relay`), and a
labelled multi-node cluster started on one machine (`local_cluster`)."""

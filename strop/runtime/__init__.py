"""Where components run: `inline` (one process, threads) or `ray` (actors placed on trainer and
inference nodes by label; `ray_relay.py` each cluster's relay, `local_cluster.py` a labelled
multi-node cluster on one machine); `weights.py` keeps any runtime's engines current through the
weight transport (`strop.sync`)."""

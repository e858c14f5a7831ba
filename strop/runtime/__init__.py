"""Where components run: `inline` (one process, threads) or `ray` (actors)."""

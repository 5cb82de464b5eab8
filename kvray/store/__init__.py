"""One rank's store: the BackendClient's core (its tiers, its node channel) and the
publisher of its stores and removals to the pool's index."""

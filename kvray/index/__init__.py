"""What the pool holds: the block index that schedulers read, the stream that keeps it
current, the pool's ledger, lookups, prefix matching and KV events for routers."""

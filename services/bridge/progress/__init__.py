"""Where the bridge stands: the progress record, the replication origin, what may be confirmed."""

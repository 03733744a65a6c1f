"""What the bridge and the failover service share: LSNs, connections, settings, HTTP, logs."""

"""The replication connection: the streaming protocol over libpq, and the feedback it sends."""

"""Messages -> whole committed transactions in commit order, spilled to disk when large."""

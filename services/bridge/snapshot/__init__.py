"""Chunked snapshots of tables, reconciled with the stream."""

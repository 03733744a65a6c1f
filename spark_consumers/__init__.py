"""Spark Structured Streaming jobs: Kafka change topics to typed Delta tables."""

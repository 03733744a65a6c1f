"""The CDC daemon: one logical slot streamed into Kafka, exactly once."""

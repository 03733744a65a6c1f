"""Sealed transactions -> Kafka records, in the default or the Debezium format."""

"""The embedded local stack: PostgreSQL primary/standby/subscriber and a KRaft Kafka broker."""

"""The publisher thread: records into Kafka transactions, then the progress they make."""

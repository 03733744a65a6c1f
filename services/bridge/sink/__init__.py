"""Kafka: the transactional producer, the topics it writes and their ids."""

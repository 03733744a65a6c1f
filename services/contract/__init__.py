"""The record contract: what the bridge writes to Kafka, stated once.

The bridge builds its records to it, the Spark consumers derive their parse schema from it,
``schemas/`` is generated from it and the tests hold every producer to it. It depends on
pydantic alone (no bridge, Spark or Kafka code), so each side imports it without the other.

- ``records``: the record values as pydantic models, and the constants they are built on;
- ``debezium``: the change and transaction records of the opt-in Debezium format;
- ``topics``: the topic names;
- ``schemas``: their JSON Schemas, as ``schemas/`` holds them.
"""

"""Kafka refusing the bridge's principal (issue #32 item 5): SASL/PLAIN and ACLs enforced by
the StandardAuthorizer on a dedicated broker. A right taken away stops the bridge with one
line naming the Kafka code and the grant to make, with the password nowhere in its log;
nothing is confirmed to PostgreSQL that Kafka does not hold, and once the right is back a
restart publishes the rest exactly once (broker-log audit).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Their public home (the package's private modules define them; its stubs do not declare
# the re-export, hence the ignore).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from slotbridge_dev.stack.kafka import Kafka
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    CounterWorkload,
    Pipeline,
    one_line_error,
    sql,
    wait_for,
)

_PRINCIPAL = "User:bridge"


def _acl(
    kind: ResourceType,
    name: str,
    operation: AclOperation,
    pattern: ResourcePatternType = ResourcePatternType.LITERAL,
    permission: AclPermissionType = AclPermissionType.ALLOW,
) -> AclBinding:
    return AclBinding(kind, name, pattern, _PRINCIPAL, "*", operation, permission)


def _grant(admin: AdminClient, acls: list[AclBinding]) -> None:
    for future in admin.create_acls(acls).values():
        future.result(30)


def _revoke(admin: AdminClient, acl: AclBinding) -> None:
    target = AclBindingFilter(
        acl.restype,
        acl.name,
        acl.resource_pattern_type,
        acl.principal,
        acl.host,
        acl.operation,
        acl.permission_type,
    )
    for future in admin.delete_acls([target]).values():
        assert future.result(30), acl  # it existed


@pytest.mark.parametrize("right", ["topic WRITE", "transactional id WRITE"])
def test_a_right_taken_away_stops_in_one_line_then_resumes_once(
    stack: Stack, sasl_kafka: Kafka, tmp_path: Path, right: str
) -> None:
    schema = "acl_topic" if right.startswith("topic") else "acl_txn"
    workload = CounterWorkload(stack.primary_dsn, schema)
    pipe = Pipeline(stack, workload.create(), tmp_path, broker=sasl_kafka)
    password = sasl_kafka.sasl_users["bridge"]  # looked for in the bridge's log
    pipe.extra |= {
        "SLOTBRIDGE_KAFKA_BOOTSTRAP": f"127.0.0.1:{sasl_kafka.sasl_port}",
        "SLOTBRIDGE_KAFKA_CONFIG": json.dumps(
            {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN"}
            | {"sasl.username": "bridge"}
        ),
        "SLOTBRIDGE_KAFKA_SASL_PASSWORD": password,
        "SLOTBRIDGE_KAFKA_TRANSACTION_TIMEOUT_MS": "10000",
    }
    admin = AdminClient({"bootstrap.servers": sasl_kafka.bootstrap})
    prefix, txn_id = pipe.prefix, f"slotbridge-{pipe.name}"
    topic_write = _acl(ResourceType.TOPIC, prefix, AclOperation.WRITE, ResourcePatternType.PREFIXED)
    txn_write = _acl(ResourceType.TRANSACTIONAL_ID, txn_id, AclOperation.WRITE)
    topic_ops = [AclOperation.CREATE, AclOperation.DESCRIBE, AclOperation.READ]
    topic_ops += [AclOperation.DESCRIBE_CONFIGS, AclOperation.ALTER_CONFIGS]
    _grant(
        admin,
        [
            topic_write,
            txn_write,
            *[
                _acl(ResourceType.TOPIC, prefix, op, ResourcePatternType.PREFIXED)
                for op in topic_ops
            ],
            _acl(ResourceType.TRANSACTIONAL_ID, txn_id, AclOperation.DESCRIBE),
            _acl(ResourceType.GROUP, "*", AclOperation.READ),
            # librdkafka's BROKER is Kafka's CLUSTER resource in ACLs.
            _acl(ResourceType.BROKER, "kafka-cluster", AclOperation.DESCRIBE_CONFIGS),
        ],
    )
    taken = topic_write if right.startswith("topic") else txn_write
    code = "TOPIC_AUTHORIZATION_FAILED" if taken is topic_write else "TRANSACTIONAL_ID"
    try:
        workload.start_under(pipe)
        _revoke(admin, taken)
        assert pipe.proc is not None
        assert pipe.proc.wait(120) == 1
        # librdkafka's own lines about the refused requests (TXNERR, ...) may precede it.
        line = one_line_error(
            "\n".join(ln for ln in pipe.output().splitlines() if "[rdkafka#" not in ln)
        )
        assert code in line and "grant" in line, line
        # Nothing confirmed to PostgreSQL beyond the progress Kafka holds.
        ((lsn,),) = sql(
            stack.primary_dsn,
            "SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name = %s",
            (pipe.name,),
        )
        confirmed = int(lsn)
        # An open transaction the bridge could not abort (its transactional id refused)
        # holds read_committed readers back until the broker aborts it at its timeout.
        wait_for(lambda: pipe.published_end_lsn() >= confirmed, 60, "Kafka's progress")
        _grant(admin, [taken])
        pipe.start()
        workload.finish()
        pipe.wait_caught_up()
        assert pipe.stop() == 0
        assert password not in pipe.output()
        checked = workload.verify(pipe)
        report = pipe.audit()
    finally:
        workload.stop_flag.set()  # a failed wait must not leave it writing for the session
        pipe.cleanup()
    print(f"{right}: {line}\n{workload.committed} transactions, {checked} records; {report}")

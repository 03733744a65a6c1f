"""The failover service's settings: one file describes the whole topology.

``check``, ``watch`` and ``promote`` read the same file, so what the daemon judges ready is
exactly what the runbook will act on. Secrets stay out of the file when the operator wants:
every node has an optional ``password`` (a SecretStr, never printed) and libpq's own
``PGPASSWORD``/``PGPASSFILE`` work as usual.
"""

from __future__ import annotations

import re
from typing import Literal

from psycopg import conninfo
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from services.common.pg import check_dsn, with_password
from services.common.settings import HTTP_HOST, LOG_FORMAT, LOG_LEVEL, ServiceSettings

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class Node(BaseModel):
    """A PostgreSQL server the service connects to with its own (admin) credentials."""

    model_config = ConfigDict(extra="forbid")

    dsn: str = Field(description="libpq connection string the failover service uses")
    password: SecretStr | None = Field(
        default=None, description="password added to dsn; never logged or printed"
    )

    @field_validator("dsn")
    @classmethod
    def _check_dsn(cls, value: str) -> str:
        return check_dsn(value)

    def conninfo(self) -> str:
        """The DSN with the password added: only ever handed to libpq, never logged."""
        secret = self.password.get_secret_value() if self.password else None
        return with_password(self.dsn, secret)


class Standby(Node):
    """A physical standby that may be promoted."""

    subscriber_conninfo: str | None = Field(
        default=None,
        description="connection parameters subscribers use to reach this server once it is "
        "promoted (merged over each subscription's own conninfo); default: host, "
        "hostaddr and port of dsn",
    )

    @field_validator("subscriber_conninfo")
    @classmethod
    def _check_sub_dsn(cls, value: str | None) -> str | None:
        return None if value is None else check_dsn(value)

    def publisher_params(self) -> dict[str, str]:
        """What replaces the old primary's address in a subscription's conninfo."""
        if self.subscriber_conninfo is not None:
            return {
                k: str(v) for k, v in conninfo.conninfo_to_dict(self.subscriber_conninfo).items()
            }
        params = conninfo.conninfo_to_dict(self.dsn)
        return {k: str(params[k]) for k in ("host", "hostaddr", "port") if k in params}


class Subscriber(Node):
    """A PostgreSQL subscriber cluster; its subscriptions follow the primary."""

    subscriptions: list[str] | None = Field(
        default=None,
        description="subscription names to manage; default: every subscription whose slot "
        "lives on the primary (or on the standby being promoted)",
    )


class FailoverSettings(ServiceSettings):
    """Primary, standbys, subscribers and the bridge's slots, plus the daemon's knobs."""

    primary: Node = Field(description="the current primary")
    standbys: dict[str, Standby] = Field(
        min_length=1, description="physical standbys that may be promoted, by name"
    )
    subscribers: dict[str, Subscriber] = Field(
        default_factory=dict,
        description="subscriber clusters whose subscriptions follow a promotion, by name",
    )
    bridge_slots: list[str] = Field(
        default_factory=list,
        description="logical slots of slotbridge bridges on the primary",
    )

    check_interval_s: float = Field(default=10.0, gt=0, description="watch: seconds between checks")
    max_slot_lag_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description="a synced slot further behind the primary's slot than this is not ready",
    )
    max_replay_lag_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description="a standby whose replay is further behind the primary than this is not ready",
    )
    auto_repoint: bool = Field(
        default=False,
        description="watch: repoint subscribers itself when it sees a promotion",
    )
    remedy: bool = Field(
        default=True,
        description="watch: run safe remedies such as pg_log_standby_snapshot()",
    )
    fence_command: list[str] | None = Field(
        default=None,
        description="argv run after the soft fence to stop the old primary for good "
        "(e.g. pg_ctl stop, a cloud API call); the node name is in "
        "SLOTBRIDGE_FENCE_NODE",
    )
    promote_timeout_s: float = Field(
        default=60.0, gt=0, description="promote: how long pg_promote may take"
    )
    catchup_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="promote: how long the standby may take to replay what the primary sent",
    )
    stream_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="promote: how long repointed subscriptions may take to stream again",
    )

    http_host: str = HTTP_HOST
    http_port: int = Field(default=9188, ge=0, le=65535, description="0 disables the server")
    log_format: Literal["json", "text"] = LOG_FORMAT
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = LOG_LEVEL

    @field_validator("bridge_slots")
    @classmethod
    def _slot_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _IDENT.match(name):
                raise ValueError(f"{name!r} is not a replication slot name")
        return value

    @model_validator(mode="after")
    def _names(self) -> FailoverSettings:
        for name in [*self.standbys, *self.subscribers]:
            if not _IDENT.match(name):
                raise ValueError(f"node name {name!r}: use letters, digits and _")
        return self

    def promoted(self, name: str) -> FailoverSettings:
        """The same topology after ``name`` became the primary (the others stay standbys).

        The watch daemon keeps working from this view after a promotion until the operator
        rewrites the file; the old primary simply drops out of it.
        """
        new = self.standbys[name]
        rest = {k: v for k, v in self.standbys.items() if k != name}
        return self.model_copy(
            update={
                "primary": Node(dsn=new.dsn, password=new.password),
                "standbys": rest,
            }
        )

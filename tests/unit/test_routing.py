"""Routes and key choices: where records go, what keys them, and what is refused."""

from __future__ import annotations

import orjson
import pytest

from services.bridge.decode import messages as m
from services.bridge.records.catalog import ColumnFacts, RelationCatalog, TableFacts, known_versions
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.records.events import EventBuilder
from services.bridge.records.routing import KeyChoice, Route, Routing, RoutingRefused, TableShape

ORDERS = (
    m.Column("id", 20, -1, True),
    m.Column("region", 25, -1, False),
    m.Column("ref", 25, -1, False),
)
FACTS = TableFacts(
    {
        "id": ColumnFacts("bigint", False),
        "region": ColumnFacts("text", False),
        "ref": ColumnFacts("text", False),
    },
    ("id",),
    (("id",), ("region", "ref")),
)


def routing(routes: list[Route] | None = None, keys: list[KeyChoice] | None = None) -> Routing:
    return Routing(routes or [], keys or [])


def route(*tables: str, topic: str = "app.public.orders") -> Route:
    return Route(tables=list(tables), topic=topic)


def key(*columns: str, tables: tuple[str, ...] = ("public.orders_*",)) -> KeyChoice:
    return KeyChoice(tables=list(tables), columns=list(columns))


def shape(table: str, identity: str = "d", key: tuple[str, ...] = ("id",)) -> TableShape:
    return TableShape("public", table, ("id", "region", "ref"), identity, key, FACTS.unique_keys)


def builder(rules: Routing) -> EventBuilder:
    catalog = RelationCatalog("app", lambda oid: FACTS, routing=rules)
    return DefaultEventBuilder(catalog, "app", "shop", 1 << 20)


def change_records(
    b: EventBuilder, rel: m.Relation, row: list[m.TupleValue]
) -> list[tuple[str, bytes | None, bytes | None]]:
    made = b.transaction(9, 0x200, 0, iter([(0x100, rel), (0x101, m.Insert(None, rel.oid, row))]))
    return [(t, k, v) for t, k, v, _ in made if t.startswith("app.public.orders")]


def test_routed_tables_share_a_topic_and_the_source_names_each() -> None:
    b = builder(routing([route("public.orders_2025_*")]))
    first = m.Relation(None, 1, "public", "orders_2025_01", "d", ORDERS)
    second = m.Relation(None, 2, "public", "orders_2025_02", "d", ORDERS)
    made = change_records(b, first, ["1", "eu", "a"]) + change_records(b, second, ["2", "us", "b"])
    assert [t for t, _, _ in made] == ["app.public.orders", "app.public.orders"]
    sources = [orjson.loads(v or b"")["source"]["table"] for _, _, v in made]
    assert sources == ["orders_2025_01", "orders_2025_02"]
    record = b.catalog.by_oid[1].schema_record
    assert record["routing"] == {"topic": "app.public.orders", "key_columns": None}


def test_a_topic_of_one_part_names_the_data_collection_of_the_end_record() -> None:
    b = builder(routing([route("public.orders_*", topic="orders")]))
    rel = m.Relation(None, 1, "public", "orders_eu", "d", ORDERS)
    made = list(
        b.transaction(
            9, 0x200, 0, iter([(0x100, rel), (0x101, m.Insert(None, 1, ["1", "eu", "a"]))])
        )
    )
    assert [t for t, _, _, _ in made].count("orders") == 1
    end = orjson.loads(made[-1][2] or b"")
    assert end["status"] == "END"
    assert end["data_collections"] == [{"data_collection": "orders", "event_count": 1}]


def test_a_chosen_key_under_replica_identity_full_keys_the_records() -> None:
    b = builder(routing(keys=[key("region", "ref")]))
    rel = m.Relation(
        None,
        1,
        "public",
        "orders_eu",
        "f",
        tuple(m.Column(c.name, c.type_oid, -1, True) for c in ORDERS),
    )
    ((_, record_key, _),) = change_records(b, rel, ["1", "eu", "a"])
    assert orjson.loads(record_key or b"") == {"region": "eu", "ref": "a"}
    schema = b.catalog.by_oid[1].schema_record
    assert schema["key_columns"] == ["region", "ref"]
    assert [c["name"] for c in schema["columns"] if c["key"]] == ["region", "ref"]
    # A restart that reads the record back reuses the version; another key is another one.
    again = RelationCatalog(
        "app", lambda oid: FACTS, known_versions([schema]), routing=b.catalog.routing
    )
    assert again.apply(rel).version == 1
    rekeyed = RelationCatalog(
        "app", lambda oid: FACTS, known_versions([schema]), routing=routing(keys=[key("id")])
    )
    assert rekeyed.apply(rel).version == 2


@pytest.mark.parametrize(
    ("rules", "table", "refusal"),
    [
        (routing(keys=[key("region", "ref")]), shape("orders_eu"), "needs REPLICA IDENTITY FULL"),
        (
            routing(keys=[key("region")]),
            shape("orders_eu", "f"),
            "is not unique: choose the columns",
        ),
        (routing(keys=[key("nope")]), shape("orders_eu", "f"), "no published column nope"),
        (
            routing([route("public.orders_*"), route("public.*")]),
            shape("orders_eu"),
            "matched by routes 1 and 2",
        ),
    ],
)
def test_choices_that_could_lose_rows_are_refused_in_one_line(
    rules: Routing, table: TableShape, refusal: str
) -> None:
    found = rules.refusal(table)
    assert found is not None and refusal in found and "\n" not in found


def test_any_columns_key_a_table_without_unique_index_under_full() -> None:
    keyless = TableShape("public", "orders_log", ("at", "what"), "f", (), ())
    assert routing(keys=[key("at", tables=("public.orders_log",))]).refusal(keyless) is None
    # The replica identity itself is no choice at all: fine under any identity.
    assert routing(keys=[key("id")]).refusal(shape("orders_eu")) is None


def test_tables_with_different_keys_on_one_topic_are_refused() -> None:
    rules = routing([route("public.orders_*")])
    assert rules.collision([shape("orders_eu"), shape("orders_us")]) is None
    other = shape("orders_us", "i", ("region", "ref"))
    collision = rules.collision([shape("orders_eu"), other])
    assert (
        collision is not None
        and "routed to topic app.public.orders with different keys" in collision
    )
    assert rules.check([shape("x")]) == (
        "route 1 (public.orders_*) matches no table of the publication; fix its tables"
    )
    named = routing([route("public.x", "public.orders_us")])
    assert named.check([shape("x")]) == (
        "route 1 names public.orders_us, which the publication does not publish"
    )


def test_a_table_altered_mid_stream_into_a_collision_stops_before_its_records() -> None:
    b = builder(routing([route("public.orders_*")]))
    change_records(b, m.Relation(None, 1, "public", "orders_eu", "d", ORDERS), ["1", "eu", "a"])
    rekeyed = tuple(m.Column(c.name, c.type_oid, -1, c.name != "id") for c in ORDERS)
    with pytest.raises(RoutingRefused, match="different keys"):
        change_records(
            b, m.Relation(None, 2, "public", "orders_us", "i", rekeyed), ["2", "us", "b"]
        )

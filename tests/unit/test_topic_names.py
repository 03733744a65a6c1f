"""Topic names for any table name PostgreSQL allows (services/contract/topics.py)."""

from __future__ import annotations

import re

import pytest

from services.contract.topics import MAX_PREFIX, MAX_TOPIC, segment, table_key, table_topic

_VALID = re.compile(r"[A-Za-z0-9._-]{1,249}")


@pytest.mark.parametrize("name", ["orders", "order_lines", "Orders-2024", "x" * 63])
def test_names_kafka_accepts_are_kept(name: str) -> None:
    assert segment(name) == name


@pytest.mark.parametrize("name", ["bad name", "a.b", "ümlaut", "x/y", "", "x" * 64, "日本語"])
def test_other_names_are_mapped_to_valid_marked_segments(name: str) -> None:
    mapped = segment(name)
    assert re.fullmatch(r"[A-Za-z0-9_-]{0,63}--[0-9a-f]{8}", mapped), mapped


def test_mapping_is_stable_and_readable() -> None:
    assert segment("bad name") == segment("bad name")
    assert segment("bad name").startswith("bad_name--")
    assert table_topic("app", "public", "bad name") == f"app.public.{segment('bad name')}"


def test_names_that_read_alike_once_mapped_get_different_topics() -> None:
    names = ["bad name", "bad_name", "bad.name", "bad/name", "bad-name"]
    assert len({segment(n) for n in names}) == len(names)


def test_a_name_that_looks_mapped_is_mapped_again() -> None:
    """Otherwise the table literally named like another's mapped segment would share its
    topic."""
    looks_mapped = segment("bad name")
    assert segment(looks_mapped) != looks_mapped


def test_a_dot_in_a_name_keeps_topics_three_segments_and_apart() -> None:
    assert table_key("a.b", "c") != table_key("a", "b.c")
    assert table_key("a.b", "c").count(".") == 1


def test_the_longest_topic_fits_kafka() -> None:
    topic = table_topic("p" * MAX_PREFIX, "ü" * 63, "名" * 63)
    assert len(topic) <= MAX_TOPIC and _VALID.fullmatch(topic)

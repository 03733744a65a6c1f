"""The bootstrap reads the JDK's version to refuse, at once, one the broker or Spark cannot
run on (pure: ``java -version`` outputs as JDKs print them)."""

from __future__ import annotations

import pytest

from slotbridge_dev.bootstrap import JAVA_MAJORS, java_major


@pytest.mark.parametrize(
    ("printed", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('openjdk version "25" 2025-09-16 LTS', 25),
        ('java version "1.8.0_402"\nJava(TM) SE Runtime Environment', 8),
        ('openjdk version "23-ea" 2024-09-17', 23),
        ('Picked up JAVA_TOOL_OPTIONS: -Xmx1g\nopenjdk version "17.0.2"', 17),
        ("no version here", None),
    ],
)
def test_the_major_version_is_read_from_java_version(printed: str, major: int | None) -> None:
    assert java_major(printed) == major


def test_only_the_jdks_the_broker_and_spark_run_on_are_taken() -> None:
    assert 17 in JAVA_MAJORS and 21 in JAVA_MAJORS
    assert 8 not in JAVA_MAJORS and 25 not in JAVA_MAJORS

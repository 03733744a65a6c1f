"""``sink.TopicIds``: a topic is known by its Kafka topic id; another id under the same
name is a topic deleted behind the bridge (issue #32 item 5)."""

from __future__ import annotations

import pytest

from services.bridge.sink.errors import TopicReplaced
from services.bridge.sink.topics import TopicIds


def test_an_id_learned_or_published_must_stay_the_same() -> None:
    ids = TopicIds()
    ids.expected = {"p.a": "A1", "p.gone": "G1"}
    ids.check({"p.a": "A1", "p.b": "B1"})
    assert ids.published() == {"p.a": "A1", "p.b": "B1", "p.gone": "G1"}
    with pytest.raises(
        TopicReplaced,
        match=r"topic p\.b \(topic id B1\) was deleted and created again behind the "
        r"bridge \(topic id now B2\).*run `slotbridge resync`",
    ):
        ids.check({"p.b": "B2"})
    with pytest.raises(TopicReplaced, match=r"p\.a \(topic id A1\) was deleted: "):
        ids.check({"p.a": None})
    with pytest.raises(TopicReplaced, match=r"p\.gone .* the bridge created it again, empty"):
        ids.check({"p.gone": "G2"}, created={"p.gone"})

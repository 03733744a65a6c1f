"""The bridge's liveness verdict (/healthz), which the chart's liveness probe acts on."""

from __future__ import annotations

import time

from services.bridge.daemon import Bridge
from services.bridge.settings import BridgeSettings


def test_a_wait_the_source_imposes_is_live_past_the_stale_loop_limit() -> None:
    bridge = Bridge(BridgeSettings(source_dsn="host=a", kafka_bootstrap="k:9092"))
    bridge._health.last_loop = time.monotonic() - 600
    live, why = bridge._live()
    assert not live and "main loop last ran 600s ago" in why
    with bridge._known_wait("creating slot s: waits until the source's transactions end"):
        live, why = bridge._live()
        assert live and why.startswith("creating slot s:"), why
    assert not bridge._live()[0]

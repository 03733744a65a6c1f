"""Long chaos runs against the real stack, every verdict audited in the broker's log.

    python bench/chaos.py [--kills 100] [--cuts 20] [--broker-kills 5] [--drills 20]
                          [--stack-dir /tmp/slotbridge-chaos] [--json]

Phase 1, kills (one stack): the bridge writes through the Kafka fault proxy, which fails
the first produce request to every new partition (KAFKA-15591, made certain) and cuts
every connection ``--cuts`` times; a counter workload runs throughout, a fresh table is
added to the publication every few kills (new topics mid-stream, three partitions each),
the bridge is SIGKILLed ``--kills`` times at random moments or at the commit-sequence
failpoints, and the broker itself is SIGKILLed and restarted ``--broker-kills`` times.

Phase 2, failover drills (a fresh stack each): the bridge streams from a multi-host DSN
while the runbook promotes the standby, alternately after a fenced shutdown of the primary
and after its crash; Kafka must then hold exactly the new primary's rows.

Each phase ends with the records checked against PostgreSQL (counters 0, 1, 2 ... per key;
every row once) and the broker-log audit (sequences contiguous per producer and epoch,
every committed END's events present, nothing twice). Printed: counts of faults injected,
source transactions, records checked, and what the audit found (lost, duplicated,
sequence gaps). Exits non-zero if anything was lost, duplicated or out of order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slotbridge_dev.drill import (  # noqa: E402
    Workload,
    drill,
    fence_by_stopping,
    follow_primary,
    settings_for,
    subscribe,
)
from slotbridge_dev.stack.kafka_audit import AuditReport, audit  # noqa: E402
from slotbridge_dev.stack.kafka_proxy import KafkaFaultProxy  # noqa: E402
from slotbridge_dev.stack.stack import Stack  # noqa: E402
from tests.integration.bridge_harness import CounterWorkload, Pipeline, wait_for  # noqa: E402

FAILPOINTS = [
    "after_produce",
    "before_kafka_commit",
    "after_kafka_commit",
    "after_origin_advance",
    "after_slot_confirm",
]


def _say(msg: str) -> None:
    print(f"[chaos] {msg}", flush=True)


def _audit_counts(report: AuditReport) -> dict[str, int]:
    return {
        "lost": report.kinds["lost"],
        "duplicated": report.kinds["duplicated"],
        "sequence_gaps": report.kinds["sequence_gap"],
        "open": report.kinds["open"],
        "problems": len(report.problems),
    }


def kill_phase(
    stack: Stack, work: Path, kills: int, cuts: int, broker_kills: int, rng: random.Random
) -> dict[str, Any]:
    proxy = KafkaFaultProxy(stack.kafka_bootstrap, fail_first_produce=True, hold_s=0.3).start()
    workload = CounterWorkload(stack.primary_dsn, "chaosbench", seed=rng.randrange(1 << 30))
    pipe = Pipeline(
        stack,
        workload.create(),
        work,
        extra={"SLOTBRIDGE_KAFKA_BOOTSTRAP": proxy.bootstrap, "SLOTBRIDGE_TOPIC_PARTITIONS": "3"},
    )
    done = {"kills": 0, "failpoint_kills": 0, "cuts": 0, "broker_kills": 0}
    cut_at = set(rng.sample(range(kills), min(cuts, kills)))
    broker_at = set(rng.sample(range(kills), min(broker_kills, kills)))
    started = time.monotonic()
    try:
        pipe.start()
        pipe.wait_caught_up(120)
        workload.seed_counters()
        workload.start()
        for n in range(kills):
            if n % 10 == 0:
                workload.add_fresh_table(f"fresh{n}", 500, pipe.name)
            # A failpoint run ends by itself: cuts and broker kills need a random-kill round.
            if n not in cut_at and n not in broker_at and rng.random() < 0.3:
                pipe.kill()
                point = rng.choice(FAILPOINTS)
                code, output = pipe.run_to_exit(
                    180, SLOTBRIDGE_FAILPOINTS=f"{point}={rng.randint(1, 3)}*kill"
                )
                if code != -9:
                    raise SystemExit(
                        f"failpoint {point} did not fire (exit {code}):\n{output[-2000:]}"
                    )
                done["failpoint_kills"] += 1
            else:
                if pipe.proc is None or pipe.proc.poll() is not None:
                    pipe.start()
                time.sleep(rng.uniform(0.5, 3.0))
                if n in cut_at:
                    proxy.cut()
                    done["cuts"] += 1
                    time.sleep(rng.uniform(0.2, 1.0))
                if n in broker_at:
                    pid = stack.kafka.pid()
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        wait_for(lambda: not stack.kafka.is_running(), 30, "broker to die")
                    time.sleep(rng.uniform(1, 4))
                    stack.kafka.start()
                    stack.kafka.wait_ready()
                    done["broker_kills"] += 1
                if pipe.proc is not None and pipe.proc.poll() is not None:
                    raise SystemExit(f"bridge died by itself:\n{pipe.output()[-3000:]}")
                pipe.kill()
            done["kills"] += 1
            if n % 10 == 9:
                _say(f"kills {n + 1}/{kills}, source transactions {workload.committed}")
        workload.finish()
        pipe.start()
        pipe.wait_caught_up(600)
        if pipe.stop() != 0:
            raise SystemExit(f"bridge did not stop cleanly:\n{pipe.output()[-3000:]}")
        checked = workload.verify(pipe)
        report = audit(stack.kafka, pipe.prefix, [pipe.progress_topic])
        for problem in report.problems[:20]:
            _say(f"AUDIT: {problem}")
        return {
            **done,
            "fresh_tables": len(workload.fresh),
            "source_transactions": workload.committed,
            "records_checked": checked,
            "first_requests_failed": len(proxy.stats.sabotaged),
            "audit": {
                "committed": report.committed,
                "aborted": report.aborted,
                "batches": report.batches,
                **_audit_counts(report),
            },
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        workload.stop_flag.set()
        proxy.stop()
        pipe.cleanup()


def one_drill(work: Path, planned: bool, n: int) -> dict[str, Any]:
    stack = Stack(Path(tempfile.mkdtemp(prefix=f"slotbridge-drill{n}-", dir=work)))
    os.chmod(stack.state_dir, 0o755)
    table = "drill"
    try:
        stack.up()
        subscribe(stack, table)
        pipe = Pipeline(stack, [f"public.{table}"], stack.state_dir)
        pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = follow_primary(stack.primary_dsn, stack.standby_dsn)
        fence = {"fence_command": fence_by_stopping(stack)} if planned else {}
        config = settings_for(
            stack, stack.state_dir / "failover.yaml", bridge_slots=[pipe.name], **fence
        )
        pipe.start()
        pipe.wait_caught_up(90)
        stack.wait_slot_synced(pipe.name, timeout=120)

        def crash_primary() -> None:
            stack.node("primary").stop("immediate")

        result = drill(
            config,
            "standby",
            Workload(follow_primary(stack.primary_dsn, stack.standby_dsn), table),
            extra=() if planned else ("--force",),
            before=None if planned else crash_primary,
        )
        if result.promote_exit != 0:
            raise SystemExit(f"drill {n}: promote failed:\n{result.output[-3000:]}")
        source = sorted(r[0] for r in stack.node("standby").query(f"SELECT id FROM {table}"))

        def published() -> list[int]:
            return sorted(r.value["after"]["id"] for r in pipe.changes(f"public.{table}"))

        wait_for(lambda: len(published()) >= len(source), 180, f"drill {n}: Kafka to catch up")
        ids = published()
        if pipe.stop() != 0:
            raise SystemExit(f"drill {n}: bridge did not stop cleanly:\n{pipe.output()[-3000:]}")
        report = audit(stack.kafka, pipe.prefix, [pipe.progress_topic])
        return {
            "planned": planned,
            "rows": len(source),
            "lost": len(set(source) - set(ids)),
            "duplicated": len(ids) - len(set(ids)),
            "extra": len(set(ids) - set(source)),
            **_audit_counts(report),
        }
    finally:
        stack.down(purge=True)
        shutil.rmtree(stack.state_dir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--cuts", type=int, default=20)
    parser.add_argument("--broker-kills", type=int, default=5)
    parser.add_argument("--drills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stack-dir", type=Path, default=Path("/tmp/slotbridge-chaos"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.stack_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(args.stack_dir, 0o755)
    results: dict[str, Any] = {}
    if args.kills:
        stack = Stack(args.stack_dir / "kills")
        stack.up()
        try:
            _say(
                f"kill phase: {args.kills} kills, {args.cuts} cuts, "
                f"{args.broker_kills} broker kills"
            )
            results["kills"] = kill_phase(
                stack, args.stack_dir, args.kills, args.cuts, args.broker_kills, rng
            )
        finally:
            stack.down(purge=True)
    drills = []
    for n in range(args.drills):
        drills.append(one_drill(args.stack_dir, planned=n % 2 == 0, n=n))
        _say(f"drill {n + 1}/{args.drills}: {drills[-1]}")
    if drills:
        results["drills"] = {
            "count": len(drills),
            "planned": sum(d["planned"] for d in drills),
            "rows": sum(d["rows"] for d in drills),
            **{
                k: sum(d[k] for d in drills)
                for k in ("lost", "duplicated", "extra", "sequence_gaps", "problems")
            },
        }
    # Records checks raise; what remains to judge is the audits' and the drills' counts.
    bad = sum(
        r.get("audit", r)["problems"]
        + r.get("lost", 0)
        + r.get("duplicated", 0)
        + r.get("extra", 0)
        for r in results.values()
    )
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for phase, figures in results.items():
            print(f"{phase}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

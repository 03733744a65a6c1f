"""Failover readiness checks, the watch daemon and the promote runbook."""

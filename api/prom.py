"""Prometheus exposition: job states and per-job progress read from the store at scrape time, and the
API's request latency measured by a middleware."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from service.store import ACTIVE, JobStore

STATES = ("queued", "running", "pausing", "paused", "cancelling", "succeeded", "failed", "cancelled")
PER_JOB = {
    "tandem_job_step": ("step", "current step of an active job"),
    "tandem_job_step_seconds": ("timing_s/step", "seconds of the job's latest step"),
    "tandem_job_reward": ("critic/score/mean", "mean training reward of the job's latest step"),
    "tandem_job_weight_sync_seconds": ("weight_sync/seconds", "seconds of the job's latest weight sync"),
}


class StoreCollector(Collector):
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self.store.counts_by_status()
        jobs = GaugeMetricFamily("tandem_jobs", "jobs by state", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        active = self.store.jobs_in(ACTIVE)
        for name, (key, doc) in PER_JOB.items():
            family = GaugeMetricFamily(name, doc, labels=["job"])
            for job in active:
                value = job.step if key == "step" else job.latest_metrics.get(key)
                if value is not None:
                    family.add_metric([job.id], float(value))
            yield family


def make_registry(store: JobStore) -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    latency = Histogram(
        "tandem_request_seconds", "API request latency", ["method", "route", "status"], registry=registry
    )
    return registry, latency

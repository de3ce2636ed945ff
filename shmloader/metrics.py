"""A loader's stats() as Prometheus metrics, for those who scrape them.

    from prometheus_client import start_http_server
    from shmloader.metrics import register
    register(loader)            # its stats() are read at every scrape
    start_http_server(9100)     # (bind it where your scraper can reach it)

Counters and gauges are named shmloader_*, labelled with the loader's ring name (and the
reader index for the per-reader ones). The collector holds the loader weakly: a closed or
collected loader is reported no more. prometheus_client is an optional extra
(pip install "shmloader[metrics]"); only this module imports it.
"""

from __future__ import annotations

import weakref

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

# (stats key, metric name, kind, help)
_LOADER_METRICS = (
    ("batches", "shmloader_batches", "counter", "Batches delivered to the trainer."),
    ("rows", "shmloader_rows", "counter", "Rows delivered to the trainer."),
    ("wait_s", "shmloader_trainer_wait_seconds", "counter", "Time the trainer waited in next()."),
    ("reader_restarts", "shmloader_reader_restarts", "counter", "Readers restarted after dying."),
    ("rows_per_s", "shmloader_rows_per_second", "gauge", "Rows delivered per second since the first batch."),
    ("wait_fraction", "shmloader_trainer_wait_fraction", "gauge", "Share of the time the trainer waited."),
    ("shared_memory_bytes", "shmloader_shared_memory_bytes", "gauge", "Bytes of the ring in /dev/shm."),
)
_READER_METRICS = (
    ("batches", "shmloader_reader_batches", "counter", "Batches a reader filled (its replacements included)."),
    ("busy_s", "shmloader_reader_busy_seconds", "counter", "Time a reader spent filling batches."),
    ("starved_s", "shmloader_reader_starved_seconds", "counter",
     "Time a reader slept while a slot was already waiting for it."),
)


class LoaderCollector:
    """A prometheus_client collector over one loader's stats()."""

    def __init__(self, loader) -> None:
        self._loader = weakref.ref(loader)
        self.ring = loader.ring_name.lstrip("/")

    def collect(self):
        loader = self._loader()
        if loader is None or loader.closed:
            return
        stats = loader.stats()
        for key, name, kind, text in _LOADER_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=["ring"])
            family.add_metric([self.ring], float(stats[key]))
            yield family
        skipped = CounterMetricFamily("shmloader_skipped_records", "Records replaced under on_error='skip'.",
                                      labels=["ring"])
        skipped.add_metric([self.ring], float(stats["skipped"]["count"]))
        yield skipped
        for key, name, kind, text in _READER_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text,
                                                                                      labels=["ring", "reader"])
            for reader in stats["readers"]:
                family.add_metric([self.ring, str(reader["index"])], float(reader[key]))
            yield family


def register(loader, registry=REGISTRY) -> LoaderCollector:
    """Adds a collector of `loader`'s stats() to `registry` (prometheus_client's default);
    returns it, for registry.unregister."""
    collector = LoaderCollector(loader)
    registry.register(collector)
    return collector

"""A loader's stats() as Prometheus metrics, for those who scrape them.

    from prometheus_client import start_http_server
    from shmloader.metrics import register
    register(loader)            # its stats() are read at every scrape
    start_http_server(9100)     # (bind it where your scraper can reach it)

Counters and gauges are named shmloader_*, labelled with the loader's ring name (and the
reader index for the per-reader ones): one collector per registry serves every loader
registered with it, holding them weakly, so a closed or collected loader is reported no
more (a new loader per evaluation pass registers beside the others). prometheus_client is an optional extra
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


class LoadersCollector:
    """A prometheus_client collector over the stats() of every loader registered with it:
    each family once, a sample per loader (label `ring`) and per reader."""

    def __init__(self) -> None:
        self._loaders = weakref.WeakSet()

    def add(self, loader) -> None:
        self._loaders.add(loader)

    def collect(self):
        loaders = [loader for loader in list(self._loaders) if not loader.closed]
        readings = [(loader.diagnostics.ring_name.lstrip("/"), loader.stats()) for loader in loaders]
        if not readings:
            return
        for key, name, kind, text in _LOADER_METRICS:
            family = _family(kind, name, text, ["ring"])
            for ring, stats in readings:
                family.add_metric([ring], float(stats[key]))
            yield family
        skipped = CounterMetricFamily("shmloader_skipped_records", "Records replaced under on_error='skip'.",
                                      labels=["ring"])
        for ring, stats in readings:
            skipped.add_metric([ring], float(stats["skipped"]["count"]))
        yield skipped
        for key, name, kind, text in _READER_METRICS:
            family = _family(kind, name, text, ["ring", "reader"])
            for ring, stats in readings:
                for reader in stats["readers"]:
                    family.add_metric([ring, str(reader["index"])], float(reader[key]))
            yield family


def _family(kind: str, name: str, text: str, labels: list[str]):
    return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=labels)


# One collector per registry: a registry refuses two collectors of the same families.
_collectors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register(loader, registry=REGISTRY) -> LoadersCollector:
    """Adds `loader` to `registry`'s (prometheus_client's default) shmloader collector,
    made and registered on first use; a closed or collected loader is reported no more.
    Returns the collector."""
    collector = _collectors.get(registry)
    if collector is None:
        collector = _collectors[registry] = LoadersCollector()
        registry.register(collector)
    collector.add(loader)
    return collector

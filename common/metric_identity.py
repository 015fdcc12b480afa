"""What every exported series says about where it comes from: the served model's name on each sample,
and the `splitserve_build_info` gauge.

`model_name` has vLLM's meaning (the name the OpenAI API answers to: the checkpoint folder's name), so
dashboards and autoscalers written for vLLM can select a model the same way. It is added when a
registry is exposed (`ModelRegistry.collect`), not at each metric update: the metric classes keep their
own label sets, and their `snapshot()`s read the metrics directly, without it.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import Metric

MODEL_LABEL = "model_name"


def served_model_name(model_dir: str | Path, configured: list[str] | None = None) -> str:
    """The `model_name` label: the first configured served name, else the checkpoint folder's name (the name
    the OpenAI API answers with)."""
    return configured[0] if configured else Path(model_dir).name


def splitserve_version() -> str:
    try:
        return version("splitserve")
    except PackageNotFoundError:  # a source tree run without installing the distribution
        return "unknown"


class ModelRegistry(CollectorRegistry):
    """A registry whose exposition labels every sample `model_name=<model_name>`."""

    def __init__(self, model_name: str):
        if not model_name:
            raise ValueError("model_name must be a non-empty string")
        super().__init__()
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                sample._replace(labels={MODEL_LABEL: self.model_name, **sample.labels}) for sample in family.samples
            ]
            yield labelled


def add_build_info(registry: CollectorRegistry, component: str) -> Gauge:
    """`splitserve_build_info{version, python_version, component} 1`: which release runs where."""
    gauge = Gauge(
        "splitserve_build_info",
        "Always 1; the labels say which splitserve release and Python run this component.",
        ("version", "python_version", "component"),
        registry=registry,
    )
    gauge.labels(splitserve_version(), platform.python_version(), component).set(1)
    return gauge

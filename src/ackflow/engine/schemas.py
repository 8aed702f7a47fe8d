"""Where a run keeps its flow's columns (the schema store, :mod:`ackflow.core.schema`).

``state_dir`` given: ``STATE_DIR/schemas.db``. Otherwise beside the flow's other durable
state: the first sink that keeps local state (a Parquet dataset, a Delta or Iceberg
table: their ``_ackflow`` folder), else a Files source's ``_ackflow`` folder, else the
embedded queue's file (``QUEUE.schemas.db``). A flow with none of these (RabbitMQ to
PostgreSQL, say) keeps its columns in memory and says so once: give it ``state_dir``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ackflow.core.schema import STORE_FILE, SchemaStore
from ackflow.flow import Flow

log = logging.getLogger("ackflow.engine")


def default_location(flow: Flow) -> str | None:
    """The schema store's file for a flow given no ``state_dir`` (None: in memory)."""
    for sink in flow.sinks:
        for s in [sink, *getattr(sink, "branches", ())]:
            where = _sink_home(s)
            if where is not None:
                return os.path.join(where, STORE_FILE)
    sources = getattr(flow.source, "sources", None) or [flow.source]
    for src in sources:
        kind = type(src).__name__
        state = getattr(src, "state_path", None)
        if kind == "FilesSource" and isinstance(state, str):
            return os.path.join(os.path.dirname(state), STORE_FILE)
        path = getattr(src, "path", None)
        if kind == "EmbeddedQueueSource" and isinstance(path, str):
            return os.path.abspath(path) + ".schemas.db"
    return None


def _sink_home(sink: Any) -> str | None:
    kind = type(sink).__name__
    manifest = None
    try:
        manifest = getattr(sink, "manifest_path", None)
    except Exception:  # noqa: BLE001 - a table whose location is not known yet
        manifest = None
    if kind in ("DeltaSink", "IcebergSink") and isinstance(manifest, str):
        return os.path.dirname(manifest)
    path = getattr(sink, "path", None)
    if kind == "ParquetSink" and isinstance(path, str):
        return os.path.join(path, "_ackflow")
    return None


def open_store(flow: Flow, state_dir: str | None) -> SchemaStore:
    if state_dir is not None:
        return SchemaStore(os.path.join(state_dir, STORE_FILE))
    location = default_location(flow)
    if location is None:
        log.warning(
            "the flow's columns are kept in memory only (no sink or source keeps "
            "local state): a restart infers them again; give state_dir= "
            "(--state-dir) to keep them"
        )
    return SchemaStore(location)


def state_file(flow: Flow, state_dir: str | None, name: str) -> str | None:
    """Where a run keeps another durable file ``name`` (a window's state): beside the
    schema store, or None if the flow has no place for local state."""
    if state_dir is not None:
        return os.path.join(state_dir, name)
    location = default_location(flow)
    if location is None:
        return None
    if location.endswith(".schemas.db"):  # the embedded queue's QUEUE.schemas.db
        return location[: -len("schemas.db")] + name
    return os.path.join(os.path.dirname(location), name)

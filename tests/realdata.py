"""Real JSON records from packages the project installs (not generated):

- ISO 639-3 language codes (Debian's ``iso-codes``): 7,910 flat records whose optional
  fields are sparse (``common_name`` is in one record, ``bibliographic`` in 20);
- the API operations of botocore's service models (PyPI ``botocore``, pinned): nested
  records (``http``, ``input``, ``output``, ``errors`` as a list of objects) with sparse
  optional fields at several depths (``http.responseCode`` in about half,
  ``output.resultWrapper``, ``staticContextParams`` in a few, ``deprecated`` in one).
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

from ackflow.core.schema import empty

ISO_639_3 = "/usr/share/iso-codes/json/iso_639-3.json"


def iso_639_3() -> list[dict[str, Any]]:
    with open(ISO_639_3) as f:
        return list(json.load(f)["639-3"])


def botocore_operations(services: int = 40) -> list[dict[str, Any]]:
    """The operations of the first ``services`` service models (by name, newest API
    version each), each with the service's name added as ``service``."""
    import botocore

    root = os.path.join(os.path.dirname(botocore.__file__), "data")
    out = []
    for svc in sorted(os.listdir(root)):
        if not os.path.isdir(os.path.join(root, svc)):
            continue
        versions = sorted(
            v for v in os.listdir(os.path.join(root, svc)) if os.path.isdir(os.path.join(root, svc, v))
        )
        for v in reversed(versions):
            base = os.path.join(root, svc, v, "service-2.json")
            path = base if os.path.exists(base) else base + ".gz"
            if not os.path.exists(path):
                continue
            raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
            model = json.loads(raw)
            for op in model.get("operations", {}).values():
                out.append({"service": svc, **op})
            break
        if len({r["service"] for r in out}) >= services:
            break
    return out


def same(given: Any, back: Any) -> bool:
    """Whether ``back`` (as a sink holds it) keeps all of ``given``: every value equal
    (numbers as numbers), the fields it lacks null, at every depth."""
    if empty(given):
        return empty(back)
    if isinstance(given, dict):
        return isinstance(back, dict) and all(same(given.get(k), back.get(k)) for k in set(given) | set(back))
    if isinstance(given, list):
        return (
            isinstance(back, list)
            and len(given) == len(back)
            and all(same(a, b) for a, b in zip(given, back, strict=True))
        )
    if isinstance(given, bool) or isinstance(back, bool):
        return given is back
    if isinstance(given, int | float):
        return isinstance(back, int | float) and float(given) == float(back)
    return bool(given == back)

"""The flow's columns as a durable, evolving contract.

The columns of a run of Python steps are inferred from data (unless the step was given
``schema=``). They are kept in a :class:`SchemaStore`, one versioned history per
segment of the flow, so that a restart reuses them rather than inferring again from
whatever its first batch holds. A row that does not fit the current columns is handled
by the segment's *mode*:

- ``evolve`` (the default): a new field, at any depth, becomes a new nullable column
  (or struct field), and a type widens along safe promotions (:func:`merge_types`).
  The engine records the new version, then runs the rows that needed it again. A value
  that cannot widen fails its own message, naming the field and both types.
- ``rescue``: the columns never change after the first version; what does not fit (a
  new field, a value of another type) goes into one JSON column, ``_rescued``.
- ``freeze``: the columns never change; a row with a field outside them, at any depth,
  fails its own message.

No mode drops a field silently. A field whose every value so far is null (or an empty
list or object) makes no column until a value arrives: its rows lose nothing.

>>> import pyarrow as pa
>>> old = pa.schema([("n", pa.int64()), ("c", pa.struct([("name", pa.string())]))])
>>> new = pa.schema([("n", pa.float64()), ("c", pa.struct([("vip", pa.bool_())]))])
>>> merged, changes, conflicts = merge_schemas(old, new)
>>> merged.field("c").type, changes, conflicts
(StructType(struct<name: string, vip: bool>), ['n: int64 -> double', '+c.vip: bool'], [])
>>> merge_schemas(old, pa.schema([("n", pa.string())]))[2]
["field 'n': a string value cannot widen the column's type int64"]
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import json
import os
import sqlite3
import threading
import time
from decimal import Decimal
from typing import Any

import pyarrow as pa

from ackflow.core.durable import WriteTx, apply_schema
from ackflow.core.errors import ConfigError, FlowError

EVOLVE, RESCUE, FREEZE = "evolve", "rescue", "freeze"
MODES = (EVOLVE, RESCUE, FREEZE)
RESCUED = "_rescued"  # the column of what did not fit, in mode "rescue"
#: the error text of a row that needs a newer version of its segment's columns: the
#: engine evolves and runs its message again (never a dead letter)
SCHEMA_MISS = "\x00ackflow-schema-miss:"


def check_mode(mode: object, what: str = "schema_mode") -> str:
    if mode not in MODES:
        raise ConfigError(f"{what} must be one of {', '.join(MODES)}, got {mode!r}")
    return str(mode)


# -- types ---------------------------------------------------------------------------------


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def show(t: pa.DataType) -> str:
    """A type as a short text (``int64``, ``struct<a: string>``)."""
    return str(t)


def merge_types(
    old: pa.DataType, new: pa.DataType, path: str, changes: list[str], conflicts: list[str]
) -> pa.DataType:
    """The type that holds values of both ``old`` (the column's) and ``new`` (a row's):
    ``old`` itself, or ``old`` widened along a safe promotion, appending a line to
    ``changes`` for each widening or new struct field. A type that cannot widen appends
    to ``conflicts`` and keeps ``old``.

    Safe promotions: a narrower signed integer to a wider one, any integer or float32 to
    float64, null to anything, a struct to the union of its fields (new ones appended),
    a list to a list of its element's widening.
    """
    if old.equals(new) or pa.types.is_null(new):
        return old
    if pa.types.is_null(old):
        changes.append(f"{path}: {show(new)}")
        return new
    if pa.types.is_signed_integer(old) and pa.types.is_signed_integer(new):
        if new.bit_width > old.bit_width:
            changes.append(f"{path}: {show(old)} -> {show(new)}")
            return new
        return old
    numeric = (pa.types.is_signed_integer(old) or pa.types.is_floating(old)) and (
        pa.types.is_signed_integer(new) or pa.types.is_floating(new)
    )
    if numeric:
        if pa.types.is_float64(old):
            return old
        changes.append(f"{path}: {show(old)} -> double")
        return pa.float64()
    if (pa.types.is_string(old) and pa.types.is_large_string(new)) or (
        pa.types.is_large_string(old) and pa.types.is_string(new)
    ):
        return old
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        fields = [old.field(i) for i in range(old.num_fields)]
        index = {f.name: i for i, f in enumerate(fields)}
        for j in range(new.num_fields):
            nf = new.field(j)
            sub = f"{path}.{nf.name}"
            if nf.name in index:
                i = index[nf.name]
                fields[i] = fields[i].with_type(merge_types(fields[i].type, nf.type, sub, changes, conflicts))
            elif not pa.types.is_null(nf.type):
                changes.append(f"+{sub}: {show(nf.type)}")
                index[nf.name] = len(fields)
                fields.append(pa.field(nf.name, nf.type))
        return pa.struct(fields)
    if _is_list(old) and _is_list(new):
        value = merge_types(old.value_type, new.value_type, f"{path}[]", changes, conflicts)
        return pa.list_(value) if pa.types.is_list(old) else pa.large_list(value)
    conflicts.append(f"field {path!r}: a {show(new)} value cannot widen the column's type {show(old)}")
    return old


def merge_schemas(old: pa.Schema, new: pa.Schema) -> tuple[pa.Schema, list[str], list[str]]:
    """``old`` evolved to hold ``new`` too: (schema, changes, conflicts); new columns are
    appended in ``new``'s order."""
    changes: list[str] = []
    conflicts: list[str] = []
    fields = list(old)
    index = {f.name: i for i, f in enumerate(fields)}
    for nf in new:
        if nf.name in index:
            i = index[nf.name]
            fields[i] = fields[i].with_type(merge_types(fields[i].type, nf.type, nf.name, changes, conflicts))
        elif not pa.types.is_null(nf.type):
            changes.append(f"+{nf.name}: {show(nf.type)}")
            index[nf.name] = len(fields)
            fields.append(pa.field(nf.name, nf.type))
    return pa.schema(fields), changes, conflicts


def duplicate_names(t: pa.Schema | pa.DataType, path: str = "") -> str | None:
    """The path of the first struct (or the schema) holding two fields of one name (Arrow
    allows it; reading such rows as Python fails for every row), or None."""
    if isinstance(t, pa.Schema):
        names = t.names
        types = [f.type for f in t]
    elif pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        types = [t.field(i).type for i in range(t.num_fields)]
    elif _is_list(t):
        return duplicate_names(t.value_type, f"{path}[]")
    else:
        return None
    if len(set(names)) != len(names):
        return path or "(top level)"
    for n, sub in zip(names, types, strict=True):
        found = duplicate_names(sub, f"{path}.{n}" if path else n)
        if found is not None:
            return found
    return None


def prune_nulls(t: pa.DataType) -> pa.DataType | None:
    """``t`` without what only nulls made: a null type, a struct field of one, a list of
    nulls, a struct left with no field (None: nothing is left)."""
    if pa.types.is_null(t):
        return None
    if pa.types.is_struct(t):
        fields = []
        for i in range(t.num_fields):
            f = t.field(i)
            sub = prune_nulls(f.type)
            if sub is not None:
                fields.append(f.with_type(sub))
        return pa.struct(fields) if fields else None
    if _is_list(t):
        value = prune_nulls(t.value_type)
        if value is None:
            return None
        return pa.list_(value) if pa.types.is_list(t) else pa.large_list(value)
    return t


def empty(value: Any) -> bool:
    """A value that holds nothing (None, an empty list or object, or only such)."""
    if value is None:
        return True
    if isinstance(value, dict):
        return all(empty(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(empty(v) for v in value)
    return False


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest float32 above 0


@functools.lru_cache(maxsize=1024)
def _holds_map(t: pa.DataType) -> bool:
    """Whether type ``t`` has a map type in it, at any depth."""
    if pa.types.is_map(t):
        return True
    if pa.types.is_struct(t):
        return any(_holds_map(t.field(i).type) for i in range(t.num_fields))
    return _is_list(t) and _holds_map(t.value_type)


def null_map_entry(value: Any, t: pa.DataType, path: str) -> str | None:
    """The path in ``value`` of a list with a null entry where ``t`` holds a map, or None.
    Arrow (pyarrow 26) aborts the process when it converts one (a failed C++ check, not
    an exception), so such a value must never reach it."""
    if value is None or not _holds_map(t):
        return None
    if pa.types.is_map(t):
        if isinstance(value, dict):
            entries: list[Any] = list(value.items())
        elif isinstance(value, list | tuple):
            if any(e is None for e in value):
                return path
            entries = [e for e in value if isinstance(e, list | tuple) and len(e) == 2]
        else:
            return None
        for k, v in entries:
            sub = null_map_entry(v, t.item_type, f"{path}[{k!r}]")
            if sub is not None:
                return sub
        return None
    if pa.types.is_struct(t) and isinstance(value, dict):
        for k, v in value.items():
            i = t.get_field_index(k) if isinstance(k, str) else -1
            sub = null_map_entry(v, t.field(i).type, f"{path}.{k}" if path else str(k)) if i >= 0 else None
            if sub is not None:
                return sub
    if _is_list(t) and isinstance(value, list | tuple):
        for v in value:
            sub = null_map_entry(v, t.value_type, f"{path}[]")
            if sub is not None:
                return sub
    return None


def _leaf_misfit(value: Any, t: pa.DataType) -> str | None:
    """Why Arrow would change ``value`` silently on its way into type ``t`` (None: it
    would not): a fraction cut by an integer type, anything but an object read as a
    struct (an empty string becomes one of nulls), a string or bytes split into a list,
    a boolean made a number, a number made a date or a time, a float32 overflow. (A null
    entry in a list read as a map is :func:`outside`'s.)"""
    if empty(value):
        return None
    if (
        isinstance(value, float | Decimal)
        and pa.types.is_integer(t)
        and (value != value.to_integral_value() if isinstance(value, Decimal) else not value.is_integer())
    ):
        return f"a number with a fraction ({value!r}) would be cut by the integer type {t}"
    if isinstance(value, dt.datetime) and pa.types.is_date(t) and value.time() != dt.time():
        return f"a date with a time of day ({value.isoformat()}) would lose it in the type {t}"
    if isinstance(value, float) and pa.types.is_float32(t) and value != 0.0 and (abs(value) < FLOAT32_TINY):
        return f"{value!r} is too small for the type {t} (it would become 0)"
    if pa.types.is_struct(t) and not isinstance(value, dict):
        return f"a {type(value).__name__} value would be read as the struct type {t}"
    if isinstance(value, str | bytes | dict) and _is_list(t):
        return f"a {type(value).__name__} value would be split into the list type {t}"
    if isinstance(value, bool) and pa.types.is_floating(t):
        return f"a boolean would be made a number by the type {t}"
    if isinstance(value, int | float) and not isinstance(value, bool) and (pa.types.is_temporal(t)):
        return f"a number would be read as a date or time by the type {t}"
    if isinstance(value, float) and pa.types.is_float32(t) and abs(value) > FLOAT32_MAX:
        return f"{value!r} is out of the range of the type {t}"
    return None


def outside(value: Any, t: pa.DataType, path: str) -> tuple[str, str | None] | None:
    """The first place where ``value`` does not fit type ``t`` without a loss, or None:
    (its path, None) for a field that ``t`` has no place for (at any depth), (its path,
    why) for a value Arrow would change silently (:func:`_leaf_misfit`). Empty values
    fit anywhere (they hold nothing to lose). A list with a null entry where ``t`` holds a
    map fails, at any depth, however empty it is: Arrow aborts the process on it
    (:func:`null_map_entry`; walked once, here, not at every depth)."""
    at = null_map_entry(value, t, path)
    if at is not None:
        return at, "a list with a null entry cannot be a map (an entry is a pair)"
    return _outside(value, t, path)


def _outside(value: Any, t: pa.DataType, path: str) -> tuple[str, str | None] | None:
    why = _leaf_misfit(value, t)
    if why is not None:
        return path, why
    if pa.types.is_null(t):  # a column that has held no value yet: this is its first
        return None if empty(value) else (path, None)
    if isinstance(value, dict) and pa.types.is_struct(t):
        for k, v in value.items():
            i = t.get_field_index(k) if isinstance(k, str) else -1
            if i < 0:
                if not empty(v):
                    return f"{path}.{k}", None
                continue
            sub = _outside(v, t.field(i).type, f"{path}.{k}")
            if sub is not None:
                return sub
        return None
    if isinstance(value, list | tuple) and _is_list(t):
        vt = t.value_type
        if _checked(vt):
            for v in value:
                sub = _outside(v, vt, f"{path}[]")
                if sub is not None:
                    return sub
    if isinstance(value, dict) and pa.types.is_map(t) and _checked(t.item_type):
        for k, v in value.items():
            sub = _outside(v, t.item_type, f"{path}[{k!r}]")
            if sub is not None:
                return sub
    return None


def _checked(t: pa.DataType) -> bool:
    """Whether values of type ``t`` need :func:`outside` before Arrow converts them."""
    return bool(
        pa.types.is_null(t)
        or pa.types.is_struct(t)
        or pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_temporal(t)
        or _is_list(t)
        or pa.types.is_map(t)
    )


def plain_types(t: pa.DataType) -> frozenset[type]:
    """The exact Python types whose values :func:`outside` always passes for ``t`` (so a
    caller may skip it for them): None anywhere, ``int`` in an integer column, ``int``
    and ``float`` in a float64 one. Per value, a look-up instead of a dozen type
    questions (measured: ``outside`` was a third of the Python workers' time on rows of
    plain numbers). ``bool`` is never plain (it is not ``int`` by exact type)."""
    if pa.types.is_integer(t):
        return frozenset({type(None), int})
    if pa.types.is_float64(t):
        return frozenset({type(None), int, float})
    return frozenset({type(None)})


def checked_columns(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    """The columns whose values need a look before Arrow converts them (a struct field
    may be new; a list, number or time may be changed silently: :func:`_leaf_misfit`)."""
    return [(f.name, f.type) for f in schema if _checked(f.type)]


def blank_empties(row: dict[str, Any], schema: pa.Schema) -> dict[str, Any] | None:
    """``row`` with each empty value (``[]``, ``{}``, or only such) that sits where its
    column holds another kind replaced by null; None if there is none (nothing is lost:
    an empty value holds nothing)."""
    changed = False

    def fix(value: Any, t: pa.DataType) -> Any:
        nonlocal changed
        if isinstance(value, dict):
            if not pa.types.is_struct(t):
                if empty(value):
                    changed = True
                    return None
                return value
            out = {}
            for k, v in value.items():
                i = t.get_field_index(k) if isinstance(k, str) else -1
                out[k] = fix(v, t.field(i).type) if i >= 0 else v
            return out
        if isinstance(value, list):
            if not _is_list(t):
                if empty(value):
                    changed = True
                    return None
                return value
            return [fix(v, t.value_type) for v in value]
        return value

    out = {}
    for k, v in row.items():
        i = schema.get_field_index(k) if isinstance(k, str) else -1
        out[k] = fix(v, schema.field(i).type) if i >= 0 else v
    return out if changed else None


def split_rescued(value: Any, t: pa.DataType) -> tuple[Any, Any]:
    """(the part of ``value`` that type ``t`` holds, the rest or None): the rest keeps
    the shape of the value (an object of the fields that did not fit, at their depth)."""
    if value is None:
        return None, None
    if pa.types.is_struct(t):
        if not isinstance(value, dict):
            return (None, value) if not _fits_scalar(value, t) else (value, None)
        kept: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        for k, v in value.items():
            i = t.get_field_index(k) if isinstance(k, str) else -1
            if i < 0:
                if not empty(v):
                    rest[str(k)] = v
                continue
            a, b = split_rescued(v, t.field(i).type)
            kept[k] = a
            if b is not None:
                rest[str(k)] = b
        return kept, (rest or None)
    if _is_list(t) and isinstance(value, list | tuple):
        if not _fits_scalar(value, t):
            return None, value
        return value, None
    return (value, None) if _fits_scalar(value, t) else (None, value)


def _fits_scalar(value: Any, t: pa.DataType) -> bool:
    if outside(value, t, "") is not None:
        return False
    try:
        pa.array([value], t)
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        return False


def to_text(schema: pa.Schema) -> str:
    """A schema as text that :func:`from_text` reads back exactly (Arrow IPC, base64)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def miss_error(segment: str, row_schema: pa.Schema) -> str:
    """The error text of a row that needs ``row_schema`` merged into ``segment``."""
    return SCHEMA_MISS + json.dumps({"segment": segment, "schema": to_text(row_schema)})


def parse_miss(error: str) -> tuple[str, pa.Schema] | None:
    if not error.startswith(SCHEMA_MISS):
        return None
    data = json.loads(error[len(SCHEMA_MISS) :])
    return str(data["segment"]), from_text(str(data["schema"]))


#: ``brought_by`` of a version a probe found (no one message brought it)
PROBED = "(a probe of a batch)"


def brought(who: str | None) -> str:
    """How a log line or the CLI says what brought a version."""
    if not who:
        return ""
    return "found by a probe of a batch" if who == PROBED else f"brought by message {who}"


def describe_schema(schema: pa.Schema) -> list[str]:
    return [f"{f.name}: {show(f.type)}" for f in schema]


# -- the store -----------------------------------------------------------------------------

_TABLES = """
CREATE TABLE IF NOT EXISTS schema_versions (
    segment    TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    schema     TEXT    NOT NULL,
    changes    TEXT    NOT NULL,
    brought_by TEXT,
    at         REAL    NOT NULL,
    PRIMARY KEY (segment, version)
)
"""


class StoreError(FlowError):
    """The schema store cannot be read or written (a locked or damaged file): the run
    stops with one line naming it; no message is failed for it."""

    def __init__(self, cause: str) -> None:
        super().__init__("schema store", cause)


#: the file name of the store inside a state directory
STORE_FILE = "schemas.db"


class SchemaStore:
    """Versioned columns per segment, in SQLite (``path``) or in memory (None).

    Thread-safe. Every version is fsynced before :meth:`record` returns (the engine
    evolves the sinks and writes rows only after that)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else os.fspath(path)
        self._lock = threading.Lock()
        try:
            if self.path is None:
                self._db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            else:
                parent = os.path.dirname(os.path.abspath(self.path))
                os.makedirs(parent, exist_ok=True)
                if not os.path.exists(self.path):
                    os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
                self._db = sqlite3.connect(
                    self.path, isolation_level=None, timeout=60, check_same_thread=False
                )
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
            apply_schema(self._db, _TABLES)
            segment = None
            for row in self._db.execute("SELECT segment, schema FROM schema_versions"):
                segment = row[0]
                from_text(row[1])  # every version readable, or the store is refused at start
        except (sqlite3.DatabaseError, OSError) as e:
            raise ConfigError(f"schema store {self.path!r} cannot be used: {e}") from None
        except (pa.ArrowException, ValueError) as e:
            raise ConfigError(
                f"schema store {self.path!r} holds a version of {segment!r} "
                f"that cannot be read ({e}): restore the file, or move it "
                "away to infer the columns again"
            ) from None

    @property
    def durable(self) -> bool:
        return self.path is not None

    def current(self, segment: str) -> tuple[int, pa.Schema] | None:
        try:
            with self._lock:
                row = self._db.execute(
                    "SELECT version, schema FROM schema_versions WHERE segment = ? "
                    "ORDER BY version DESC LIMIT 1",
                    (segment,),
                ).fetchone()
            return None if row is None else (int(row[0]), from_text(row[1]))
        except (sqlite3.Error, pa.ArrowException, ValueError) as e:
            raise StoreError(f"schema store {self.path!r}: {e}") from None

    def record(self, segment: str, schema: pa.Schema, changes: list[str], brought_by: str | None) -> int:
        """Store ``schema`` as the segment's next version (unless it is the current one
        already); return its version. Another process (or flow) that recorded a version
        in between is merged, never lost: what is stored is the latest version merged
        with ``schema``, and ``schema`` is expected to hold the latest one already when
        this process is the only writer."""
        try:
            with self._lock, WriteTx(self._db):
                row = self._db.execute(
                    "SELECT version, schema FROM schema_versions WHERE segment = ? "
                    "ORDER BY version DESC LIMIT 1",
                    (segment,),
                ).fetchone()
                if row is not None:
                    latest = from_text(row[1])
                    schema = merge_schemas(latest, schema)[0]
                    if latest.equals(schema):
                        return int(row[0])
                version = 1 if row is None else int(row[0]) + 1
                self._db.execute(
                    "INSERT INTO schema_versions VALUES (?, ?, ?, ?, ?, ?)",
                    (segment, version, to_text(schema), json.dumps(changes), brought_by, time.time()),
                )
                return version
        except (sqlite3.Error, pa.ArrowException, ValueError) as e:
            raise StoreError(f"schema store {self.path!r}: {e}") from None

    def history(self, segment: str | None = None) -> list[dict[str, Any]]:
        """Every version, oldest first: segment, version, columns, changes, brought_by, at."""
        with self._lock:
            rows = self._db.execute(
                "SELECT segment, version, schema, changes, brought_by, at FROM "
                "schema_versions WHERE ? IS NULL OR segment = ? ORDER BY segment, version",
                (segment, segment),
            ).fetchall()
        return [
            {
                "segment": s,
                "version": v,
                "columns": describe_schema(from_text(t)),
                "changes": json.loads(c),
                "brought_by": b,
                "at": a,
            }
            for s, v, t, c, b, a in rows
        ]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_readonly(path: str) -> SchemaStore:
    """The store at ``path`` (a file, or a state directory holding one) for reading."""
    if os.path.isdir(path):
        path = os.path.join(path, STORE_FILE)
    if not os.path.isfile(path):
        raise ConfigError(
            f"no schema store at {path!r} (ackflow keeps one as {STORE_FILE} in the flow's state directory)"
        )
    try:
        db = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True)
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        db.close()
    except sqlite3.DatabaseError as e:
        raise ConfigError(f"{path!r} is not an ackflow schema store ({e})") from None
    if "schema_versions" not in tables:
        raise ConfigError(f"{path!r} is not an ackflow schema store (no table schema_versions)")
    return SchemaStore(path)

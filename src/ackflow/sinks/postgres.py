"""PostgreSQL: keyed writes from Spark tasks, one transaction per partition.

Each partition is written by its Spark task in one transaction: the rows are
``COPY``-ed into a temporary table, then moved into the target with
``INSERT ... SELECT ... ON CONFLICT (key)``. A row is written when that
transaction committed. Because every row has a key that is the same when its
message is delivered again (ackflow's row key, or the user's ``key=`` columns),
a redelivery after a crash writes the same rows in place: the table ends up
exactly as if every message had been processed once (effectively-once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ackflow import faults
from ackflow.core.errors import ColumnsRefused, ConfigError, FlowError
from ackflow.core.secrets import hide
from ackflow.sinks.base import ROW_KEY as KEY
from ackflow.sinks.base import PartitionResult, Sink, null_key_failures

log = logging.getLogger("ackflow.sinks.postgres")

MODES = ("upsert", "insert")


PG_NAME_BYTES = 63  # longer identifiers are cut by the server (NAMEDATALEN - 1)

#: SQLSTATE classes a row's own values can cause (data exception, integrity constraint,
#: check option, program limit such as an index row too large, a trigger's RAISE): such
#: an error is bisected down to the rows that cause it. Any other class (42: no
#: privilege or a missing object, 53: disk full, 40: a deadlock, XX: internal) fails
#: the partition's write as a whole.
ROW_SQLSTATE_CLASSES = frozenset({"22", "23", "44", "54", "P0"})


def pg_type(t: Any) -> str:
    """The PostgreSQL column type for an Arrow type (``create=True``)."""
    import pyarrow as pa

    checks = [
        (pa.types.is_boolean, "boolean"),
        (pa.types.is_int8, "smallint"),
        (pa.types.is_int16, "smallint"),
        (pa.types.is_int32, "integer"),
        (pa.types.is_int64, "bigint"),
        (pa.types.is_uint8, "smallint"),
        (pa.types.is_uint16, "integer"),
        (pa.types.is_uint32, "bigint"),
        (pa.types.is_uint64, "numeric(20)"),
        (pa.types.is_float16, "real"),
        (pa.types.is_float32, "real"),
        (pa.types.is_float64, "double precision"),
        (pa.types.is_string, "text"),
        (pa.types.is_large_string, "text"),
        (pa.types.is_binary, "bytea"),
        (pa.types.is_large_binary, "bytea"),
        (pa.types.is_date, "date"),
    ]
    for check, name in checks:
        if check(t):
            return name
    if pa.types.is_timestamp(t):
        return "timestamptz" if t.tz else "timestamp"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision},{t.scale})"
    if pa.types.is_nested(t):
        return "jsonb"
    return "text"


#: column type -> the wider types ``evolve=True`` may change it to (no value changes)
WIDER = {
    "smallint": ("integer", "bigint", "double precision"),
    "integer": ("bigint", "double precision"),
    "bigint": ("double precision",),
    "real": ("double precision",),
}


class PostgresSink(Sink):
    """Write rows to ``table`` with keyed upserts (or inserts that keep the first write).

    ``key``: the columns that identify a row. By default (None) ackflow's row key is
    written to the column ``key_column`` ("ackflow_key"): the source message's stable
    identity plus the row's position among the message's rows. Either way the table
    needs a primary key or unique index on the key (``create=True`` makes it).

    A row whose ``key=`` column is null fails alone (its message fails, naming the
    column): PostgreSQL's ``ON CONFLICT`` never matches NULL, so it could not be
    written once.

    ``mode="upsert"`` updates an existing row with the same key (last write wins);
    ``"insert"`` leaves it as it was (first write wins). Both write a redelivered
    message's rows in place, never twice.

    Bad rows (a constraint violated, a value the column refuses) fail only
    themselves: a transaction that fails is retried in halves until the bad rows are
    isolated, and only their messages fail. A lost connection fails the whole
    partition (its messages are retried), never acks it.

    ``create=True`` creates the table from the flow's columns if it does not exist;
    otherwise the table must exist.

    As an error sink (``flow.on_error(PostgresSink(...))``) its table is one a person
    can query: ``body`` is ``text`` where the body is UTF-8 (without NUL characters,
    which ``text`` cannot hold), else null with the bytes in ``body_bytes`` (``bytea``)
    beside it; ``failed_at`` is a ``timestamptz``; ``headers`` is JSON text
    (``headers::jsonb`` reads it). A dead-letter table made by an older ackflow (``body``
    ``bytea``, ``failed_at`` an epoch ``double precision``) is upgraded in place at
    start, in one transaction holding the table's lock (see docs/tools.md).

    ``evolve=True`` (the default): before a batch with new columns is written, the table
    is changed to take them, in one transaction that holds the table's lock and re-reads
    its columns first (so a repeated prepare, or another process that evolved it first,
    changes nothing): ``ADD COLUMN IF NOT EXISTS`` (nullable, typed like ``create=True``;
    nested values are ``jsonb``, so new struct fields need no change) and safe widening,
    ``ALTER COLUMN ... TYPE`` smallint -> integer -> bigint -> double precision and
    real -> double precision (never narrower; a key column never becomes a double).
    If the change is refused (no privilege on a table someone else owns), or with
    ``evolve=False``, the table is left as it is: a column it lacks is refused (the rows
    holding a value in it fail alone) and a wider value fails its row only if the
    column cannot hold it.
    """

    wants_keys = True

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        key: Sequence[str] | None = None,
        mode: str = "upsert",
        create: bool = False,
        key_column: str = "ackflow_key",
        connect_timeout: float = 10,
        evolve: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__(name or f"postgres:{table}")
        if mode not in MODES:
            raise ConfigError(f"sink {self.name!r}: mode must be one of {MODES}, got {mode!r}")
        if not table or not isinstance(table, str):
            raise ConfigError(f"sink {self.name!r}: table must be a name like 'orders' or 'schema.orders'")
        if isinstance(key, str):
            key = [key]
        if key is not None and not key:
            raise ConfigError(
                f"sink {self.name!r}: key= needs at least one column (or None for ackflow's row key)"
            )
        self.dsn = dsn
        self.table = table
        self.key = list(key) if key is not None else None
        self.mode = mode
        # the row key, or the first write kept: a row written again is the same row (an
        # upsert on other columns could overwrite a later message's row with an older one)
        self.replays_in_place = self.key is None or mode == "insert"
        self.create = create
        self.evolve = evolve
        self.key_column = key_column
        self.connect_timeout = connect_timeout
        self._prepared: set[tuple[str, ...]] = set()
        self._dead_letters = False  # set when the engine hands it dead letters

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_prepared"] = set()
        return state

    # -- driver side ---------------------------------------------------------------

    def dead_letter_rows(self, table: Any) -> Any:
        """Dead letters as a person queries them: ``body`` text (or null, with the bytes
        in ``body_bytes``), ``failed_at`` a UTC timestamp (see the class docstring)."""
        import datetime as dt

        import pyarrow as pa

        bodies = table.column("body").to_pylist()
        texts = [_utf8_text(b) for b in bodies]
        raw = [b if t is None else None for b, t in zip(bodies, texts, strict=True)]
        at_type = pa.timestamp("us", tz="UTC")
        at = [
            None if x is None else dt.datetime.fromtimestamp(x, dt.UTC)
            for x in table.column("failed_at").to_pylist()
        ]
        i = table.schema.get_field_index("body")
        table = table.set_column(i, pa.field("body", pa.string()), pa.array(texts, pa.string()))
        table = table.add_column(i + 1, pa.field("body_bytes", pa.binary()), pa.array(raw, pa.binary()))
        j = table.schema.get_field_index("failed_at")
        table = table.set_column(j, pa.field("failed_at", at_type), pa.array(at, at_type))
        self._dead_letters = True
        return table

    def _upgrade_dead_letters(self, conn: Any) -> None:
        """Upgrade a dead-letter table of an older ackflow (body bytea, failed_at an epoch
        double) in one transaction under the table's lock: ``body_bytes`` added and
        filled where the body is not UTF-8 text, ``body`` made text (null there),
        ``failed_at`` made timestamptz. A table that cannot be changed stops the run with
        the SQL that upgrades it."""
        import psycopg
        from psycopg import sql

        def types() -> dict[str, str]:
            return dict(
                conn.execute(
                    "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                    "attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
                    [self._ident().as_string(conn)],
                ).fetchall()
            )

        old = _old_dead_letters(types())
        conn.commit()
        if not old:
            return
        t = self._ident()
        steps: list[sql.Composable] = [sql.SQL(UTF8_FUNCTION)]
        if "body" in old:
            steps += [
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS body_bytes bytea").format(t),
                sql.SQL("UPDATE {} SET body_bytes = body WHERE pg_temp.ackflow_utf8(body) IS NULL").format(t),
                sql.SQL("ALTER TABLE {} ALTER COLUMN body TYPE text USING pg_temp.ackflow_utf8(body)").format(
                    t
                ),
            ]
        if "failed_at" in old:
            steps.append(
                sql.SQL(
                    "ALTER TABLE {} ALTER COLUMN failed_at TYPE timestamptz USING to_timestamp(failed_at)"
                ).format(t)
            )
        try:
            with conn.transaction():
                conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(t))
                if _old_dead_letters(types()) == old:  # not upgraded by another process
                    for step in steps:
                        conn.execute(step)
        except psycopg.OperationalError:
            raise
        except psycopg.Error as e:
            script = "BEGIN; " + "; ".join(x.as_string(conn) for x in steps) + "; COMMIT;"
            raise FlowError(
                self.name,
                self._hide(
                    f"the dead-letter table {self.table!r} has an older ackflow's columns (body "
                    f"bytea, failed_at an epoch double) and cannot be upgraded: "
                    f"{_describe_pg(e)}; upgrade it as its owner with: {script}"
                ),
            ) from None
        log.warning(
            "sink %r: upgraded dead-letter table %r: %s",
            self.name,
            self.table,
            "; ".join(f"{c} was {old[c]}" for c in old),
        )

    @property
    def conflict_key(self) -> list[str]:
        return self.key if self.key is not None else [self.key_column]

    def _ident(self) -> Any:
        from psycopg import sql

        return sql.Identifier(*self.table.split(".", 1))

    def _connect(self) -> Any:
        import psycopg

        try:
            return psycopg.connect(self.dsn, connect_timeout=max(1, int(self.connect_timeout)))
        except psycopg.Error as e:
            raise ConnectionError(self._hide(f"cannot connect to PostgreSQL: {e}")) from None

    def _hide(self, text: str) -> str:
        from psycopg.conninfo import conninfo_to_dict

        try:
            password = conninfo_to_dict(self.dsn).get("password")
        except Exception:  # noqa: BLE001 - an unparsable DSN: redact what looks like one
            password = None
        return hide(text, str(password) if password else None)

    def open(self) -> None:
        try:
            conn = self._connect()
        except ConnectionError as e:
            raise ConfigError(f"sink {self.name!r}: {e}") from None
        with conn:
            exists = conn.execute("SELECT to_regclass(%s)", [self._ident().as_string(conn)]).fetchone()
            if (exists is None or exists[0] is None) and not self.create:
                raise ConfigError(
                    f"sink {self.name!r}: table {self.table!r} does not exist; "
                    "create it, or pass create=True to create it from the "
                    "flow's columns"
                )

    def prepare(self, schema: Any) -> None:
        """Create the table (``create=True``) or check that it has the flow's columns."""
        from psycopg import sql

        signature = tuple(f"{f.name}:{f.type}" for f in schema)
        if signature in self._prepared:
            return
        long = [n for n in schema.names if len(n.encode()) > PG_NAME_BYTES]
        if long:  # PostgreSQL would cut them, and two could become one
            raise ColumnsRefused(
                self.name,
                f"column name(s) {', '.join(map(repr, long))} are longer than "
                f"PostgreSQL's {PG_NAME_BYTES} bytes; rename them in the flow",
                {n: f"the name is longer than PostgreSQL's {PG_NAME_BYTES} bytes" for n in long},
            )
        if self.key is None and self.key_column in schema.names:
            raise ColumnsRefused(
                self.name,
                f"the flow writes a column {self.key_column!r}, the sink's own key "
                "column: rename the flow's column, or give the sink another key_column=",
                {self.key_column: "the sink's own key column (key_column=) has this name"},
            )
        columns = self.columns(schema.names)
        missing_key = [k for k in self.conflict_key if k not in columns]
        if missing_key:
            raise FlowError(
                self.name,
                f"the key column(s) {missing_key} are not among the flow's columns {list(schema.names)}",
            )
        try:
            conn = self._connect()
        except ConnectionError as e:
            if self._prepared:  # checked before, the server is away for now: the write
                log.warning("sink %r: %s", self.name, e)  # fails and its messages retry
                return
            raise FlowError(self.name, str(e)) from None
        with conn:
            ident = self._ident()
            if self._dead_letters:
                self._upgrade_dead_letters(conn)
            if self.create:
                types = {f.name: pg_type(f.type) for f in schema}
                types.setdefault(self.key_column, "text")
                defs = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(types[c])) for c in columns]
                defs.append(
                    sql.SQL("PRIMARY KEY ({})").format(
                        sql.SQL(", ").join(map(sql.Identifier, self.conflict_key))
                    )
                )
                # two processes creating one table at once collide on PostgreSQL's
                # catalog ("IF NOT EXISTS" is checked before the insert): one at a time
                space, _, bare = self.table.rpartition(".")  # "t" and "public.t": one lock
                conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtext('ackflow-ddl:' || coalesce(%s, current_schema()) "
                    "|| '.' || %s))",
                    (space or None, bare),
                )
                conn.execute(
                    sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(ident, sql.SQL(", ").join(defs))
                )
            attrs = conn.execute(
                "SELECT attname, attnotnull AND NOT atthasdef AND attidentity = '' "
                "AND attgenerated = '' FROM pg_attribute WHERE attrelid = to_regclass(%s) "
                "AND attnum > 0 AND NOT attisdropped",
                [ident.as_string(conn)],
            ).fetchall()
            have = {r[0] for r in attrs}
            if not have:
                raise FlowError(
                    self.name, f"table {self.table!r} does not exist; create it, or pass create=True"
                )
            if self.evolve and self._evolve(conn, schema, columns):
                faults.point("postgres.evolved")
                have = {
                    r[0]
                    for r in conn.execute(
                        "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) "
                        "AND attnum > 0 AND NOT attisdropped",
                        [ident.as_string(conn)],
                    )
                }
            unfilled = sorted(r[0] for r in attrs if r[1] and r[0] not in columns)
            if unfilled:  # every insert would fail: the table's problem, not a row's
                raise FlowError(
                    self.name,
                    f"table {self.table!r} has NOT NULL column(s) "
                    f"{', '.join(unfilled)} without a default that the flow does "
                    "not write: give them a default, or write them",
                )
            missing = [c for c in columns if c not in have]
            if missing:
                raise ColumnsRefused(
                    self.name,
                    f"table {self.table!r} has no column(s) {', '.join(missing)} "
                    f"(the flow writes {', '.join(columns)}); add them with ALTER TABLE, or "
                    "write to a new table with create=True",
                    {c: f"table {self.table!r} has no such column" for c in missing},
                )
            try:  # checks the key has a unique index, without writing anything
                conn.execute(sql.SQL("EXPLAIN ") + self._insert_sql(columns, source=ident, where_false=True))
            except Exception as e:  # noqa: BLE001 - reported as what to fix
                raise FlowError(
                    self.name,
                    self._hide(
                        f"cannot write to {self.table!r} keyed on {self.conflict_key}: "
                        f"{str(e).strip().splitlines()[0]} (the key needs a PRIMARY KEY or a "
                        "UNIQUE index on exactly those columns)"
                    ),
                ) from None
        self._prepared.add(signature)

    def _alterations(self, conn: Any, schema: Any, columns: list[str]) -> list[Any]:
        """The ALTER TABLE clauses that make the live table take ``schema``: new columns,
        and widenings along :data:`WIDER` (nothing for a table that takes it already)."""
        from psycopg import sql

        current = dict(
            conn.execute(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                "attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
                [self._ident().as_string(conn)],
            ).fetchall()
        )
        types = {f.name: pg_type(f.type) for f in schema}
        types.setdefault(self.key_column, "text")
        clauses = []
        for c in columns:
            if c not in current and c not in self.conflict_key:  # a key needs its index
                clauses.append(
                    sql.SQL("ADD COLUMN IF NOT EXISTS {} {}").format(sql.Identifier(c), sql.SQL(types[c]))
                )
            elif types[c] in WIDER.get(current[c], ()) and not (
                c in self.conflict_key and types[c] == "double precision"
            ):
                clauses.append(
                    sql.SQL("ALTER COLUMN {} TYPE {}").format(sql.Identifier(c), sql.SQL(types[c]))
                )
        return clauses

    def _evolve(self, conn: Any, schema: Any, columns: list[str]) -> bool:
        """Change the table to take ``schema`` (see the class docstring); True if it did.
        A change the server refuses is logged and left out (the columns are refused)."""
        import psycopg
        from psycopg import sql

        conn.commit()  # end the reading transaction: the change holds its own lock
        needed = bool(self._alterations(conn, schema, columns))
        conn.commit()
        if not needed:
            return False
        try:
            with conn.transaction():
                conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(self._ident()))
                clauses = self._alterations(conn, schema, columns)  # under the lock: live
                if clauses:
                    conn.execute(
                        sql.SQL("ALTER TABLE {} {}").format(self._ident(), sql.SQL(", ").join(clauses))
                    )
        except psycopg.OperationalError:
            raise
        except psycopg.Error as e:
            log.warning(
                "sink %r: cannot evolve table %r (%s); it is left as it is",
                self.name,
                self.table,
                self._hide(_describe_pg(e)),
            )
            return False
        if clauses:
            log.info(
                "sink %r: evolved table %r: %s",
                self.name,
                self.table,
                "; ".join(c.as_string(conn) for c in clauses),
            )
        return True

    def columns(self, data_cols: Sequence[str]) -> list[str]:
        """The table columns written: the flow's, plus ackflow's key column by default."""
        cols = [c for c in data_cols if c != KEY]
        if self.key is None and self.key_column not in cols:
            cols.append(self.key_column)
        return cols

    def _insert_sql(
        self, columns: list[str], *, source: Any, where_false: bool = False, dedupe: bool = False
    ) -> Any:
        from psycopg import sql

        cols = sql.SQL(", ").join(map(sql.Identifier, columns))
        key = sql.SQL(", ").join(map(sql.Identifier, self.conflict_key))
        select = sql.SQL("SELECT {} FROM {}").format(cols, source)
        if dedupe:  # two rows with one key in a piece: the later one wins
            select = sql.SQL("SELECT DISTINCT ON ({key}) {cols} FROM {src} ORDER BY {key}, af_n DESC").format(
                key=key, cols=cols, src=source
            )
        if where_false:
            select = select + sql.SQL(" WHERE false")
        rest = [c for c in columns if c not in self.conflict_key]
        action: sql.Composable
        if self.mode == "upsert" and rest:
            action = sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in rest)
            )
        else:
            action = sql.SQL("DO NOTHING")
        return sql.SQL("INSERT INTO {} ({}) {} ON CONFLICT ({}) {}").format(
            self._ident(), cols, select, key, action
        )

    # -- task side -----------------------------------------------------------------

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        import psycopg

        if rows.num_rows == 0:
            return PartitionResult()
        data_cols = [c for c in rows.column_names if c != KEY]
        columns = self.columns(data_cols)
        values = _column_values(rows, data_cols)
        if self.key is None:
            values.append(rows.column(KEY).to_pylist())
        records = list(zip(*values, strict=True))
        failed = null_key_failures(rows, self.key)  # each fails alone, never written
        todo = [i for i in range(len(records)) if i not in failed]
        if not todo:
            return PartitionResult(failed=failed)
        from psycopg import sql

        conn = self._connect()
        try:
            with conn.cursor() as cur:  # the target's columns and types, no constraints
                cur.execute(
                    sql.SQL("CREATE TEMP TABLE af_stage AS SELECT * FROM {} WITH NO DATA").format(
                        self._ident()
                    )
                )
                cur.execute("ALTER TABLE af_stage ADD COLUMN af_n bigint")
            conn.commit()
            self._write(conn, records, todo, columns, failed)
            refused = [failed[i] for i in todo if i in failed]
            if len(todo) >= 3 and len(refused) == len(todo):
                primary = {str(why).split(" (", 1)[0] for why in refused}
                if len(primary) == 1:  # every row refused alike: the write's, not the rows'
                    raise RuntimeError(f"every row refused: {primary.pop()}")
        except psycopg.OperationalError as e:
            raise ConnectionError(self._hide(f"lost the connection to PostgreSQL: {e}")) from None
        finally:
            conn.close()
        return PartitionResult(failed=failed)

    def _write(
        self,
        conn: Any,
        records: list[tuple[Any, ...]],
        idx: list[int],
        columns: list[str],
        failed: dict[int, str],
    ) -> None:
        """Write ``records[idx]`` in one transaction; on a data error, bisect."""
        import psycopg
        from psycopg import sql

        try:
            with conn.cursor() as cur:
                cur.execute("TRUNCATE af_stage")
                copy_cols = sql.SQL(", ").join(map(sql.Identifier, [*columns, "af_n"]))
                with cur.copy(sql.SQL("COPY af_stage ({}) FROM STDIN").format(copy_cols)) as cp:
                    for i in idx:
                        cp.write_row((*records[i], i))
                cur.execute(
                    self._insert_sql(columns, source=sql.Identifier("af_stage"), dedupe=self.key is not None)
                )
            faults.point("postgres.before_commit")
            conn.commit()
            faults.point("postgres.after_commit")
        except psycopg.Error as e:
            state = getattr(e, "sqlstate", None) or ""
            if isinstance(e, psycopg.OperationalError) and state[:2] not in ROW_SQLSTATE_CLASSES:
                raise  # (the connection; but a row's 54xxx, too large, is an OperationalError)
            conn.rollback()
            if state[:2] not in ROW_SQLSTATE_CLASSES:
                # not the data's fault (no privilege, disk full, a lock, a server error):
                # the whole write fails, and every message alike (a systemic failure)
                raise RuntimeError(self._hide(_describe_pg(e))) from None
            if len(idx) == 1:
                failed[idx[0]] = self._hide(_describe_pg(e))
                return
            half = len(idx) // 2
            self._write(conn, records, idx[:half], columns, failed)
            self._write(conn, records, idx[half:], columns, failed)


#: the columns every dead-letter table has (``write_dead_letters``)
DEAD_LETTER_COLUMNS = frozenset({"message", "body", "headers", "step", "error", "deliveries", "failed_at"})
#: body text where the bytes are UTF-8 (PostgreSQL's convert_from refuses invalid UTF-8
#: and NUL), else null; a temporary function, gone with the session
UTF8_FUNCTION = (
    "CREATE OR REPLACE FUNCTION pg_temp.ackflow_utf8(b bytea) RETURNS text "
    "LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RETURN convert_from(b, 'UTF8'); "
    "EXCEPTION WHEN others THEN RETURN NULL; END $$"
)


def _utf8_text(body: bytes | None) -> str | None:
    """``body`` as text if it is UTF-8 that PostgreSQL's ``text`` can hold (no NUL)."""
    if body is None:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


def _old_dead_letters(types: dict[str, str]) -> dict[str, str]:
    """The columns of an older ackflow's dead-letter table still to upgrade (name ->
    its old type), or {} (not a dead-letter table, or upgraded)."""
    if not DEAD_LETTER_COLUMNS <= set(types):
        return {}
    old = {"body": "bytea", "failed_at": "double precision"}
    return {c: t for c, t in old.items() if types[c] == t}


def _column_values(rows: Any, names: list[str]) -> list[list[Any]]:
    """Python values per column; nested values become ``jsonb``."""
    import pyarrow as pa
    from psycopg.types.json import Jsonb

    from ackflow.sinks.jsonrows import json_ready

    out = []
    for name in names:
        col = rows.column(name)
        vals = col.to_pylist()
        if pa.types.is_nested(col.type):  # in the JSON form every JSON sink writes
            vals = [None if v is None else Jsonb(json_ready(v, col.type)) for v in vals]
        out.append(vals)
    return out


def _describe_pg(e: BaseException) -> str:
    diag = getattr(e, "diag", None)
    primary = getattr(diag, "message_primary", None) or str(e).strip().splitlines()[0]
    detail = getattr(diag, "message_detail", None)
    text = f"{type(e).__name__}: {primary}"
    return f"{text} ({detail})" if detail else text

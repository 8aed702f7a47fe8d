"""The ``ackflow`` command: demo, run, queue, dlq, schema, state, servers, docs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from typing import Any

from ackflow.cli_args import parser
from ackflow.core.errors import AckflowError, ConfigError
from ackflow.core.secrets import redact

log = logging.getLogger("ackflow")


def cmd_schema(args: argparse.Namespace) -> int:
    import datetime as dt

    from ackflow.core.schema import brought, open_readonly

    store = open_readonly(args.store)
    try:
        versions = store.history()
    finally:
        store.close()
    if args.step is not None:
        versions = [
            v for v in versions if v["segment"] == args.step or v["segment"].endswith(f":{args.step}")
        ]
    if args.action == "show":
        latest: dict[str, dict[str, Any]] = {}
        for v in versions:
            latest[v["segment"]] = v
        versions = list(latest.values())
    if args.json:
        print(json.dumps(versions))
        return 0
    if not versions:
        print("(no columns stored)")
    for v in versions:
        when = dt.datetime.fromtimestamp(v["at"], dt.UTC).isoformat(timespec="seconds")
        who = f", {brought(v['brought_by'])}" if v["brought_by"] else ""
        print(f"{v['segment']}  version {v['version']}  ({when}{who})")
        lines = v["columns"] if args.action == "show" else v["changes"]
        for line in lines:
            print(f"    {line}")
    return 0


def cmd_state(args: argparse.Namespace) -> int:
    from ackflow.state.show import describe

    ops = describe(args.store, args.window, args.limit)
    if args.json:
        print(json.dumps(ops))
        return 0
    if not ops:
        print("(no window state yet)")
    for op in ops:
        if "dedupe" in op:
            print(
                f"{op['dedupe']} (dedupe): {op['claims']} claims, {op['uncommitted_claims']} not committed, "
                f"newest {op['newest_claim']}"
            )
            continue
        print(
            f"{op['window']}: watermark {op['watermark']}, {op['open_windows']} open "
            f"({op['refused_windows']} refused by the output), "
            f"{op['windows_written']} written, {op['rows_applied']} rows applied, {op['late_rows']} late, "
            f"{op['applied_keys_remembered']} row keys remembered"
        )
        for w in op["open"]:
            span = f"{w['start']} .. {w['end']}" if w["end"] is not None else f"#{w['start']}"
            refused = f"  REFUSED: {w['refused']}" if "refused" in w else ""
            print(f"    {w['keys']}  {span}  {w['rows']} rows{refused}")
    return 0


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.metrics_port is not None:
        print(f"metrics: http://{args.metrics_host}:{args.metrics_port}/metrics", file=sys.stderr)
    if args.ui_port is not None:
        host = "127.0.0.1" if args.ui_host in ("", "0.0.0.0", "::") else args.ui_host
        host = f"[{host}]" if ":" in host else host
        print(
            f"status page: http://{host}:{args.ui_port}/"
            + (" (port 0: the chosen port is logged with -v)" if args.ui_port == 0 else ""),
            file=sys.stderr,
        )
    return {
        "batch_size": args.batch_size,
        "max_inflight": args.max_inflight,
        "max_concurrent_batches": args.max_concurrent_batches,
        "drain_timeout_s": args.drain_timeout,
        "systemic_stop_after_s": args.systemic_stop_after,
        "schema_mode": args.schema_mode,
        "state_dir": args.state_dir,
        "until_idle": args.until_idle,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "ui_port": args.ui_port,
        "ui_host": args.ui_host,
        "ui_allow_replay": args.ui_allow_replay,
    }


def cmd_demo(args: argparse.Namespace) -> int:
    from ackflow import demo
    from ackflow.engine import Engine
    from ackflow.observe import ProgressBar
    from ackflow.spark.session import session

    workdir = os.path.abspath(args.workdir)
    if args.windows:
        return _demo_windows(args, workdir)
    sink = args.sink or "parquet"
    if args.resume and not args.sink and os.path.exists(demo.DemoPaths(workdir).manifest):
        with open(demo.DemoPaths(workdir).manifest) as f:
            sink = json.load(f).get("sink", "parquet")
    paths = demo.DemoPaths(workdir, sink)
    rabbit = None
    if args.source == "rabbitmq":
        if not args.amqp_url:
            raise ConfigError("--source rabbitmq needs --amqp-url amqp://user:pass@host:5672/%2F")
        rabbit = demo.RabbitDemo(args.amqp_url)
    published = 0
    if args.resume:
        if not os.path.exists(paths.manifest):
            raise ConfigError(f"--resume: no demo in {paths.workdir!r}; run 'ackflow demo' first")
    else:
        if not args.json:
            print(f"publishing {args.messages:,} order events to {paths.db} ...", file=sys.stderr)
        published = demo.publish(paths, args.messages, args.poison_rate, args.seed, rabbit)["messages"]
    with open(paths.manifest) as f:
        total = json.load(f)["messages"]
    spark = session(args.master)
    bar = ProgressBar(total=None if args.resume else total)
    report = Engine(demo.build_flow(paths, rabbit), spark=spark, progress=bar, **_engine_kwargs(args)).run()
    bar.close()
    check = demo.verify(paths, rabbit)
    summary = {
        "published": published,
        "acked": report.acked,
        "nacked": report.nacked,
        "dead_lettered": report.dead_lettered,
        "released": report.released,
        "recovered": report.recovered,
        "rows_written": sum(report.rows_written.values()),
        "batches": report.batches,
        "bisections": report.bisections,
        "elapsed_s": round(report.elapsed_s, 3),
        "messages_per_s": round(report.messages_per_s, 1),
        "dead_lettered_by_step": report.dead_lettered_by_step,
        "check": check,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(_demo_text(summary, paths))
    return 0 if check["ok"] else 1


def _demo_windows(args: argparse.Namespace, workdir: str) -> int:
    from ackflow import demo_windows as dw
    from ackflow.engine import Engine
    from ackflow.observe import ProgressBar
    from ackflow.spark.session import session

    if args.sink or args.source != "embedded":
        raise ConfigError("--windows runs on the embedded queue into Parquet: drop --sink and --source")
    p = dw.paths(workdir)
    if args.resume:
        if not os.path.exists(p["manifest"]):
            raise ConfigError(
                f"--resume: no windowed demo in {workdir!r}; run 'ackflow demo --windows' first"
            )
    else:
        if not args.json:
            print(f"publishing {args.messages:,} timed orders to {p['db']} ...", file=sys.stderr)
        dw.publish(workdir, args.messages, args.poison_rate, seed=args.seed)
    bar = ProgressBar(total=None if args.resume else args.messages)
    kwargs = {**_engine_kwargs(args), "state_dir": args.state_dir or p["state"]}
    report = Engine(dw.build_flow(workdir), spark=session(args.master), progress=bar, **kwargs).run()
    bar.close()
    check = dw.verify(workdir)
    summary = {
        "published": 0 if args.resume else args.messages,
        "acked": report.acked,
        "dead_lettered": report.dead_lettered,
        "nacked": report.nacked,
        "elapsed_s": round(report.elapsed_s, 3),
        "messages_per_s": round(report.messages_per_s, 1),
        "dead_lettered_by_step": report.dead_lettered_by_step,
        "check": check,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(dw.text(summary, p, kwargs["state_dir"]))
    return 0 if check["ok"] else 1


def _demo_text(s: dict[str, Any], paths: Any) -> str:
    c = s["check"]
    where = {"parquet": "Parquet", "delta": "Delta", "iceberg": "Iceberg"}[c["sink"]]
    lines = [
        "",
        f"ackflow demo — {s['elapsed_s']:.1f} s, {s['messages_per_s']:,.0f} messages/s",
        f"  published        {s['published']:>10,}",
        f"  acked            {s['acked']:>10,}   (every row written to {where})",
        f"  dead-lettered    {s['dead_lettered']:>10,}   by step: {s['dead_lettered_by_step']}",
        f"  nacked (retried) {s['nacked']:>10,}",
        f"  rows written     {s['rows_written']:>10,}   in {s['batches']} batches",
    ]
    if s["recovered"]:
        lines.append(
            f"  recovered        {s['recovered']:>10,}   in flight at a crash: "
            "processed again (their rows may appear twice)"
        )
    lines += [
        "check against what was published:",
        f"  valid orders in {where:<9} {c['valid_orders_in_parquet']:,} of {c['valid_orders_expected']:,}",
        f"  line items in {where:<11} {c['line_items_in_parquet']:,} of "
        f"{c['line_items_expected']:,} ({c['duplicate_rows']:,} duplicate rows)",
        f"  poison dead-lettered      {c['poison_dead_lettered']:,} of {c['poison_expected']:,}"
        f" (wrongly: {c['dead_lettered_wrongly']})",
        f"  left in the queue         {c['queue']['ready'] + c['queue']['leased'] + c['queue']['delayed']:,}",
        f"  {'OK' if c['ok'] else 'MISMATCH'}: output in {paths.output}",
        f"  dead letters: ackflow queue dead-letters --db {paths.db} --queue orders",
    ]
    return "\n".join(lines)


def check_flow_file(target: str) -> None:
    """Fail with one line on a target that cannot name a flow file that compiles."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ConfigError(f"expected path/to/file.py:name, got {target!r}")
    if not os.path.isfile(path):
        raise ConfigError(f"flow file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            compile(f.read(), path, "exec")
    except SyntaxError as e:
        raise ConfigError(f"flow file {path!r} has a syntax error at line {e.lineno}: {e.msg}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"flow file {path!r} cannot be read: {e}") from None


def load_flow(target: str) -> Any:
    """Import ``path/to/file.py:name`` and return the Flow it names."""
    from ackflow.flow import Flow

    check_flow_file(target)
    path, _, name = target.rpartition(":")
    mod_name = "ackflow_user_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)  # (syntax errors: check_flow_file, before Spark)
    except Exception as e:  # noqa: BLE001 - the user's module failed to load: say so, once
        raise ConfigError(
            f"flow file {path!r} failed to load: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(module)  # executors need not import the file
    obj = getattr(module, name, None)
    if obj is None:
        raise ConfigError(f"{path!r} has no attribute {name!r}")
    if callable(obj) and not isinstance(obj, Flow):
        obj = obj()
    if not isinstance(obj, Flow):
        raise ConfigError(f"{target!r} is a {type(obj).__name__}, not an ackflow Flow")
    return obj


def cmd_run(args: argparse.Namespace) -> int:
    from ackflow.engine import Engine
    from ackflow.observe import ProgressBar
    from ackflow.spark.session import session

    check_flow_file(args.target)  # a missing file or a syntax error: before Spark starts
    spark = session(args.master)  # before the user's module builds Columns
    flow = load_flow(args.target)
    bar = ProgressBar()
    report = Engine(flow, spark=spark, progress=bar, **_engine_kwargs(args)).run()
    bar.close()
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(report.summary())
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    from ackflow.embedded import EmbeddedQueue

    if "://" in args.db or ("=" in args.db and not os.path.exists(args.db)):  # URL or DSN
        raise ConfigError(
            f"--db {redact(args.db)!r} is a URL, not a queue file: `ackflow queue` works on "
            "the embedded queue's SQLite file (a path). RabbitMQ keeps dead letters in the "
            "queue its dead-letter exchange routes to: read them with `ackflow dlq peek QUEUE "
            "--url URL` and replay them with `ackflow dlq replay`"
        )
    if not os.path.exists(args.db):
        raise ConfigError(f"queue file {redact(args.db)!r} does not exist")
    EmbeddedQueue(args.db, readonly=True).close()  # a foreign file is refused, unchanged
    q = EmbeddedQueue(args.db, readonly=args.action != "replay")
    try:
        if args.action == "stats":
            out: Any = q.stats(args.queue)
            text = "\n".join(f"{k:16} {v:,}" for k, v in out.items())
        elif args.action == "peek":
            out = q.peek(args.queue, args.limit)
            text = (
                "\n".join(
                    f"#{m['id']} {m['msg_id'] or ''} deliveries={m['deliveries']}"
                    f"{' leased' if m['leased'] else ''} {m['body'][:120]}"
                    + (f"\n    last error: {m['last_error']}" if m["last_error"] else "")
                    for m in out
                )
                or "(empty)"
            )
        elif args.action == "dead-letters":
            out = [d.as_json() for d in q.dead_letters(args.queue, args.limit)]
            text = (
                "\n".join(
                    f"#{d['id']} {d['msg_id'] or ''} after {d['deliveries']} deliveries, "
                    f"step {d['step']!r}: {d['error']}\n    body: {d['body'][:120]}"
                    for d in out
                )
                or "(no dead letters)"
            )
        else:
            done = q.replay_each(args.queue, args.ids)
            out = {
                "replayed": len(done.moved),
                "kept": [{"id": i, "reason": why} for i, why in done.kept.items()],
            }
            text = "\n".join(
                [f"moved {len(done.moved)} dead letters back to queue {args.queue!r}"]
                + [f"#{i} {why}" for i, why in done.kept.items()]
            )
    finally:
        q.close()
    print(json.dumps(out) if args.json else text)
    return 0


DOCS_PACKAGES = {
    "mkdocs": "mkdocs",
    "material": "mkdocs-material",
    "mkdocstrings_handlers.python": "mkdocstrings[python]",
}


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a parent package is missing
        return None


def docs_config() -> str:
    """The checkout's ``mkdocs.yml``: beside ``src/`` of this ackflow, else in the current
    directory or one above it. The site is built from a checkout; a wheel has no docs."""
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.join(here, "..", ".."), os.getcwd(), os.path.join(os.getcwd(), "..")):
        path = os.path.normpath(os.path.join(folder, "mkdocs.yml"))
        if os.path.isfile(path):
            return path
    raise ConfigError(
        "no mkdocs.yml here: run 'ackflow docs' in a checkout of ackflow "
        "(the documentation is built from its docs/ folder)"
    )


def cmd_docs(args: argparse.Namespace) -> int:
    """Build the site and serve it on 127.0.0.1 (``mkdocs serve``: it rebuilds on every
    change) until Ctrl-C."""
    import subprocess

    missing = [pkg for mod, pkg in DOCS_PACKAGES.items() if _find_spec(mod) is None]
    if missing:
        raise ConfigError(
            f"the docs need {', '.join(missing)}, which are not installed: "
            "pip install -e '.[dev]' in the checkout (or pip install "
            "mkdocs mkdocs-material 'mkdocstrings[python]')"
        )
    config = docs_config()
    root = os.path.dirname(config)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(root, "src"), env.get("PYTHONPATH")) if p)
    print(
        f"ackflow: serving the docs of {root} on http://127.0.0.1:{args.port}/ (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    cmd = [
        sys.executable,
        "-m",
        "mkdocs",
        "serve",
        "--config-file",
        config,
        "--dev-addr",
        f"127.0.0.1:{args.port}",
    ]
    try:
        return subprocess.call(cmd, cwd=root, env=env)
    except KeyboardInterrupt:
        return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    from ackflow import dlq

    if not args.url:
        raise ConfigError(
            "give the broker's URL: --url amqp://user:pass@host:5672/%2F, or set ACKFLOW_AMQP_URL"
        )
    if args.action == "peek":
        shown = dlq.peek(
            args.url,
            args.queue,
            args.count,
            window=args.window,
            progress=None if args.json else dlq.print_progress("read"),
        )
        if args.json:
            print(json.dumps([d.as_json() for d in shown]))
            return 0
        for d in shown:
            how = (
                f"step {d.step!r} after {d.deliveries} deliveries: {d.error}"
                if d.step
                else f"dead-lettered by the broker ({d.reason or 'no reason'})"
            )
            origin = f" from {d.source_queue!r}" if d.source_queue else ""
            print(f"{d.message_id or '(no message_id)'}{origin}: {how}\n    body: {d.preview()}")
        if not shown:
            print(f"(queue {args.queue!r} is empty)")
        return 0
    done = dlq.replay(
        args.url,
        args.queue,
        args.to,
        count=args.count,
        routing_key=args.routing_key,
        window=args.window,
        progress=None if args.json else dlq.print_progress("replayed"),
    )
    if args.json:
        print(json.dumps(done.as_json()))
    else:
        print(
            f"replayed {done.replayed:,} messages from {args.queue!r} to {done.target}; "
            f"{done.left:,} left in {args.queue!r}"
        )
    return 0


def cmd_servers(args: argparse.Namespace) -> int:
    from ackflow import servers

    return servers.main(args.which)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _setup_logging(getattr(args, "verbose", False))
    try:
        if getattr(args, "ui_allow_replay", False) and args.ui_port is None:
            raise ConfigError("--ui-allow-replay needs --ui-port")
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "schema":
            return cmd_schema(args)
        if args.command == "state":
            return cmd_state(args)
        if args.command == "docs":
            return cmd_docs(args)
        if args.command == "dlq":
            return cmd_dlq(args)
        if args.command == "servers":
            return cmd_servers(args)
        return cmd_queue(args)
    except AckflowError as e:
        print(f"ackflow: error: {redact(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

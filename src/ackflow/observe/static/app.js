// ackflow status page. Hand-written, no dependencies, no build step.
// Everything that comes from the run (names, errors, message bodies) is put on the page
// with textContent or as SVG text nodes: never parsed as HTML.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = { pulled: "#2f6fbd", acked: "#1a7f4b", nacked: "#b26b00", dead_lettered: "#c0392b",
  in_flight: "#2f6fbd", max_inflight: "#8a96a3", batch_p50_s: "#6c5ce7", batch_p99_s: "#a29bfe",
  ack_p50_s: "#1a7f4b", ack_p99_s: "#7bc49b" };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

function num(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }

function secs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  return `${s.toFixed(2)} s`;
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function setText(id, text) {
  const node = $(id);
  if (node.textContent !== String(text)) node.textContent = String(text);
}

function fillDl(dl, pairs) {
  clear(dl);
  for (const [k, v] of pairs) {
    dl.appendChild(el("dt", {}, k));
    dl.appendChild(el("dd", {}, v));
  }
}

// -- the flow graph ----------------------------------------------------------------------

const NODE_W = 170, NODE_H = 70, GAP_X = 40, GAP_Y = 22;

function nodeStats(node, s) {
  const failed = s.failed_by_step[node.name];
  const fails = failed ? failed.nacked + failed.dead_lettered : 0;
  const lines = [];
  if (node.role === "source") {
    lines.push([`pulled ${num(s.totals.pulled)}`, ""], [`acked ${num(s.totals.acked)}`, ""]);
  } else if (node.role === "error_sink") {
    lines.push([`dead-lettered ${num(s.totals.dead_lettered)}`, s.totals.dead_lettered ? "bad" : ""]);
    const written = s.rows_written[node.name];
    if (written !== undefined) lines.push([`rows written ${num(written)}`, ""]);
  } else {
    const rows = (s.rows_by_step || {})[node.name];
    if (node.role === "sink") lines.push([`rows written ${num(s.rows_written[node.name] || 0)}`, ""]);
    else if (rows) lines.push([`rows in ${num(rows.in)} · out ${num(rows.out)}`, ""]);
    lines.push([`failed: ${num(fails)}`, fails ? "bad" : ""]);
    if (fails && node.role !== "sink") {
      lines.push([`nacked ${num(failed.nacked)} · dead ${num(failed.dead_lettered)}`, "bad"]);
    }
  }
  return { lines: lines.slice(0, 3), failing: fails > 0 };
}

let graphKey = null;
function drawGraph(s) {
  const g = $("graph");
  const flow = s.flow;
  const key = JSON.stringify([flow, s.totals, s.rows_written, s.failed_by_step, s.rows_by_step]);
  if (key === graphKey) return;
  graphKey = key;
  clear(g);
  const cols = Math.max(...flow.nodes.map((n) => n.col)) + 1;
  const rows = Math.max(...flow.nodes.map((n) => n.row)) + 1;
  const W = cols * (NODE_W + GAP_X) + 10, H = rows * (NODE_H + GAP_Y) + 10;
  g.setAttribute("viewBox", `0 0 ${W} ${H}`);
  g.setAttribute("width", W);
  g.setAttribute("height", H);
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
  marker.appendChild(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#8a96a3" }));
  defs.appendChild(marker);
  g.appendChild(defs);
  const pos = {};
  for (const n of flow.nodes) {
    pos[n.id] = { x: 5 + n.col * (NODE_W + GAP_X), y: 5 + n.row * (NODE_H + GAP_Y), n };
  }
  for (const [a, b] of flow.edges) {
    const p = pos[a], q = pos[b];
    if (!p || !q) continue;
    const dead = q.n.role === "error_sink";
    let d;
    if (dead) {  // from the source, down to the dead letters
      d = `M ${p.x + NODE_W / 2} ${p.y + NODE_H} L ${p.x + NODE_W / 2} ${q.y + NODE_H / 2} L ${q.x} ${q.y + NODE_H / 2}`;
    } else {
      const x1 = p.x + NODE_W, y1 = p.y + NODE_H / 2, x2 = q.x, y2 = q.y + NODE_H / 2;
      const mx = (x1 + x2) / 2;
      d = `M ${x1} ${y1} C ${mx} ${y1}, ${mx} ${y2}, ${x2} ${y2}`;
    }
    g.appendChild(svg("path", { d, class: dead ? "edge dead" : "edge", "marker-end": "url(#arrow)" }));
  }
  for (const n of flow.nodes) {
    const p = pos[n.id];
    const stats = nodeStats(n, s);
    const grp = svg("g", { class: `node ${n.role}${stats.failing ? " failing" : ""}`,
      transform: `translate(${p.x},${p.y})`, "data-name": n.name, "data-role": n.role });
    grp.appendChild(svg("rect", { width: NODE_W, height: NODE_H, rx: 6 }));
    const name = n.name.length > 22 ? n.name.slice(0, 21) + "…" : n.name;
    grp.appendChild(svg("text", { x: 8, y: 16, class: "name" }, name));
    grp.appendChild(svg("title", {}, `${n.name} (${n.kind})`));
    grp.appendChild(svg("text", { x: 8, y: 29, class: "kind" }, n.kind));
    stats.lines.forEach(([text, cls], i) => {
      grp.appendChild(svg("text", { x: 8, y: 42 + i * 12, class: `stat ${cls}` }, text));
    });
    g.appendChild(grp);
  }
}

// -- charts ------------------------------------------------------------------------------

const CW = 600, CH = 180, PAD = { l: 48, r: 8, t: 8, b: 20 };

function niceMax(v) {  // four equal ticks of 1, 2, 2.5 or 5 times a power of ten
  if (!(v > 0)) return 1;
  const step = v / 4, p = Math.pow(10, Math.floor(Math.log10(step)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= step) return 4 * m * p;
  return 40 * p;
}

function fmtAxis(v) {
  if (v >= 1e6) return `${(v / 1e6).toFixed(1)}M`;
  if (v >= 1e4) return `${Math.round(v / 1e3)}k`;
  if (v >= 10) return String(Math.round(v));
  return String(Math.round(v * 100) / 100);
}

function legend(id, names) {
  const box = $(id);
  if (box.childElementCount) return;
  for (const n of names) {
    const span = el("span", {}, n.replace(/_/g, " "));
    span.style.color = COLORS[n];  // CSSOM: allowed by the page's CSP, unlike style=""
    box.appendChild(span);
  }
}

function chart(id, h, names, opts) {
  const g = $(id);
  clear(g);
  const t = h.t;
  const x0 = PAD.l, x1 = CW - PAD.r, y0 = CH - PAD.b, y1 = PAD.t;
  g.appendChild(svg("line", { x1: x0, y1: y0, x2: x1, y2: y0, class: "axis" }));
  if (t.length < 2) {
    g.appendChild(svg("text", { x: x0 + 8, y: y1 + 20 }, "collecting samples (one a second)…"));
    return;
  }
  const tEnd = t[t.length - 1], tStart = Math.min(t[0], tEnd - 60);
  const X = (v) => x0 + (x1 - x0) * (v - tStart) / (tEnd - tStart);
  let vmax = 0;
  for (const n of names) for (const v of h[n]) if (v !== null && v > vmax) vmax = v;
  vmax = niceMax(vmax);
  const Y = (v) => y0 - (y0 - y1) * v / vmax;
  if (opts && opts.shade) {  // throttled samples: shaded bands
    const w = Math.max(1.5, (x1 - x0) / Math.max(1, (tEnd - tStart)));
    h.throttled.forEach((on, i) => {
      if (on) g.appendChild(svg("rect", { x: X(t[i]) - w, y: y1, width: w, height: y0 - y1, class: "shade" }));
    });
  }
  for (let k = 0; k <= 4; k++) {
    const v = vmax * k / 4, y = Y(v);
    if (k) g.appendChild(svg("line", { x1: x0, y1: y, x2: x1, y2: y, class: "grid" }));
    g.appendChild(svg("text", { x: x0 - 4, y: y + 4, "text-anchor": "end" }, fmtAxis(v)));
  }
  const span = tEnd - tStart;
  for (let k = 0; k <= 4; k++) {
    const tv = tStart + span * k / 4;
    const ago = Math.round(tEnd - tv);
    const label = ago === 0 ? "now" : ago >= 60 ? `-${(ago / 60).toFixed(ago % 60 ? 1 : 0)}m` : `-${ago}s`;
    g.appendChild(svg("text", { x: X(tv), y: CH - 4, "text-anchor": k === 0 ? "start" : k === 4 ? "end" : "middle" }, label));
  }
  for (const n of names) {
    let d = "", pen = false;
    h[n].forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      d += `${pen ? "L" : "M"} ${X(t[i]).toFixed(1)} ${Y(v).toFixed(1)} `;
      pen = true;
    });
    if (d) g.appendChild(svg("path", { d, class: "series", stroke: COLORS[n], "data-series": n }));
  }
}

// -- panels ------------------------------------------------------------------------------

function drawWindow(s) {
  const w = s.window;
  setText("window-text", `in flight ${num(w.in_flight)} / ${num(w.max_inflight)}`);
  const bar = $("window-bar");
  bar.style.width = `${Math.min(100, 100 * w.in_flight / Math.max(1, w.max_inflight))}%`;
  bar.classList.toggle("full", w.throttled);
  const state = $("window-state");
  clear(state);
  state.appendChild(el("span", { class: `badge ${w.throttled ? "full" : "running"}` },
    w.throttled ? "FULL: throttled, pulling stopped" : "open: pulling"));
  const wt = s.waiting;
  fillDl($("waits"), [
    ["waiting to be batched", `${num(wt.batching)} messages`],
    ["Spark jobs running", `${num(wt.jobs_running.batches)} batches, ${num(wt.jobs_running.messages)} messages`],
    ["sink commit", `${num(wt.sink_commit.batches)} batches, ${num(wt.sink_commit.messages)} messages`],
    ["held in grouped_within groups", `${num(wt.held_in_groups)} messages`],
    ["retries waiting", wt.retries_waiting === null || wt.retries_waiting === undefined
      ? "– (the source does not say)" : `${num(wt.retries_waiting)} messages`],
  ]);
  setText("episodes-count", num(w.throttle_episodes));
  const ol = $("episodes");
  clear(ol);
  for (const e of w.episodes.slice().reverse()) {
    const text = e.end === null ? `since ${clock(e.start)} (ongoing)`
      : `${clock(e.start)} for ${secs(Math.max(0, e.end - e.start))}`;
    ol.appendChild(el("li", {}, text));
  }
}

function drawSource(s) {
  const src = s.source;
  const box = $("source-state");
  clear(box);
  box.appendChild(el("span", { class: `badge ${src.connected ? "connected" : "reconnecting"}` },
    src.connected ? "connected" : "reconnecting"));
  box.appendChild(el("span", { class: "muted" }, ` ${src.name}`));
  const pairs = [];
  for (const [k, v] of Object.entries(src.details)) pairs.push([k.replace(/_/g, " "), typeof v === "number" ? num(v) : String(v)]);
  for (const [k, v] of Object.entries(src.probed || {})) pairs.push([k.replace(/_/g, " "), typeof v === "number" ? num(v) : String(v)]);
  pairs.push(["redelivered", num(src.redelivered)], ["recovered at start", num(src.recovered)]);
  fillDl($("source-details"), pairs);
}

function drawWindows(s) {
  const ws = Object.entries(s.windows || {});
  $("windows").hidden = ws.length === 0;
  const box = $("window-states");
  clear(box);
  for (const [name, f] of ws) {
    const dl = el("dl", {});
    fillDl(dl, [
      ["kind", String(f.kind)], ["watermark", f.watermark === null ? "– (no data yet)" : String(f.watermark)],
      ["watermark lag", f.watermark_lag_s === null ? "–" : secs(f.watermark_lag_s)],
      ["open windows", num(f.open_windows)], ["rows applied", num(f.rows_applied)],
      ["late rows", num(f.late_rows)], ["windows written", num(f.windows_written)],
      ["state size", `${num(f.state_bytes)} bytes`], ["failed result writes", num(f.output_failures)],
    ]);
    const div = el("div", { class: "window-state" });
    div.appendChild(el("h3", {}, name));
    div.appendChild(dl);
    box.appendChild(div);
  }
}

function drawLatency(s) {
  const l = s.latency;
  fillDl($("latency"), [
    ["batch duration p50", secs(l.batch_p50_s)], ["batch duration p99", secs(l.batch_p99_s)],
    ["pull to ack p50", secs(l.ack_p50_s)], ["pull to ack p99", secs(l.ack_p99_s)],
    ["batches", num(s.totals.batches)], ["Spark jobs", num(s.totals.jobs)],
    ["bisections", num(s.totals.bisections)],
  ]);
}

function drawSchema(s) {
  const sc = s.schema || { versions: {}, changes: [] };
  fillDl($("schema-versions"), Object.entries(sc.versions).map(([k, v]) => [k, `version ${v}`]));
  const list = $("schema-changes");
  clear(list);
  for (const c of sc.changes.slice().reverse()) {
    const who = !c.brought_by ? "" : c.brought_by === "(a probe of a batch)"
      ? " (found by a probe)" : ` (message ${c.brought_by})`;
    list.appendChild(el("li", {}, `${c.segment} v${c.version}${who}: ${c.changes.join("; ")}`));
  }
}

// -- dead letters ------------------------------------------------------------------------

const selected = new Set();
let dlKey = null;
let last = null;

function drawDeadLetters(s) {
  const filter = $("dl-step").value;
  const replay = s.replay;
  const replayed = new Set(replay.replayed);
  const steps = [...new Set(s.dead_letters.map((d) => d.step))].sort();
  const select = $("dl-step");
  const have = [...select.options].map((o) => o.value).slice(1);
  if (JSON.stringify(have) !== JSON.stringify(steps)) {
    while (select.options.length > 1) select.remove(1);
    for (const st of steps) select.appendChild(el("option", { value: st }, st));
    select.value = steps.includes(filter) ? filter : "";
  }
  const key = JSON.stringify([s.dead_letters.map((d) => d.id), replay, select.value]);
  if (key !== dlKey) {
    dlKey = key;
    const body = $("dead-letters").tBodies[0];
    clear(body);
    for (const d of s.dead_letters) {
      if (select.value && d.step !== select.value) continue;
      const done = replayed.has(d.id);
      const tr = el("tr", { "data-id": d.id, class: done ? "replayed" : "" });
      const box = el("input", { type: "checkbox", class: "dl-select", "aria-label": `select dead letter ${d.id}` });
      box.disabled = !(replay.enabled && d.replayable) || done;
      box.checked = selected.has(d.id) && !box.disabled;
      box.addEventListener("change", () => {
        if (box.checked) selected.add(d.id); else selected.delete(d.id);
        updateReplayButton();
      });
      const cb = el("td");
      cb.appendChild(box);
      tr.appendChild(cb);
      tr.appendChild(el("td", {}, clock(d.at)));
      const msg = el("td", { class: "message" }, d.message);
      if (done) msg.appendChild(el("span", { class: "tag" }, "replayed"));
      if (d.kept_by !== "source") msg.appendChild(el("span", { class: "tag" }, `in ${d.kept_by}`));
      tr.appendChild(msg);
      tr.appendChild(el("td", { class: "step" }, d.step));
      tr.appendChild(el("td", { class: "deliveries" }, d.deliveries));
      tr.appendChild(el("td", { class: "error" }, d.error));
      const pre = el("pre", { class: "body" },
        d.body + (d.truncated ? ` … (${num(d.body_bytes)} bytes in all)` : ""));
      const td = el("td");
      td.appendChild(pre);
      tr.appendChild(td);
      body.appendChild(tr);
    }
    for (const id of [...selected]) if (replayed.has(id) || !s.dead_letters.some((d) => d.id === id)) selected.delete(id);
  }
  $("dl-empty").hidden = s.dead_letters.length > 0;
  setText("replay-note", !replay.supported ? "this source cannot replay dead letters"
    : !replay.allowed ? "replay is off (start the run with --ui-allow-replay)"
    : !sessionStorage.getItem(TOKEN_KEY) ? "to replay, open the page from the link ackflow printed at start"
    : "");
  updateReplayButton();
}

function updateReplayButton() {
  const enabled = last && last.replay.enabled && last.state !== "stopped";
  $("replay").disabled = !(enabled && selected.size > 0);
}

// This run's replay token: in the fragment of the link printed at start (never sent to
// the server in a URL), kept in this tab's session storage, sent as a header.
const TOKEN_KEY = "ackflow-replay-token";
(function takeToken() {
  const m = /(?:^#|&)replay-token=([A-Za-z0-9_-]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, m[1]);
    history.replaceState(null, "", location.pathname + location.search);
  }
})();

async function replaySelected() {
  const ids = [...selected];
  if (!ids.length) return;
  $("replay").disabled = true;
  setText("replay-status", `replaying ${ids.length}…`);
  try {
    const r = await fetch("/api/replay", { method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Ackflow-Replay": "1",
                 "X-Ackflow-Replay-Token": sessionStorage.getItem(TOKEN_KEY) || "" },
      body: JSON.stringify({ ids }) });
    const answer = await r.json();
    if (!r.ok) throw new Error(answer.error || `HTTP ${r.status}`);
    for (const id of answer.ids) selected.delete(id);
    const kept = Object.entries(answer.kept || {}).map(([id, why]) => `#${id} ${why}`);
    setText("replay-status", `replayed ${answer.replayed} (back in the queue)`
      + (kept.length ? `; ${kept.join("; ")}` : ""));
  } catch (e) {
    setText("replay-status", `replay failed: ${e.message}`);
  }
  updateReplayButton();
}

function drawSystemic(s) {
  const box = $("systemic"), e = s.systemic;
  box.hidden = !e;
  if (!e) return;
  setText("systemic-step", e.step);
  setText("systemic-since", new Date(e.since * 1000).toLocaleTimeString());
  setText("systemic-error", e.error);
  setText("systemic-messages", num(e.messages));
  setText("systemic-batches", num(e.batches));
}

// -- the whole page ----------------------------------------------------------------------

function render(s) {
  last = s;
  const w = s.window, t = s.totals;
  setText("source-name", s.source.name);
  const state = w.throttled && s.state === "running" ? "throttled" : s.state;
  setText("state", state);
  $("state").className = `badge ${state}`;
  setText("elapsed", `${Math.round(s.elapsed_s)} s`);
  setText("c-pulled", num(t.pulled));
  setText("c-acked", num(t.acked));
  setText("c-nacked", num(t.nacked));
  setText("c-dead", num(t.dead_lettered));
  setText("c-rows", num(Object.values(s.rows_written).reduce((a, b) => a + b, 0)));
  setText("c-inflight", `${num(w.in_flight)} / ${num(w.max_inflight)}`);
  setText("c-redelivered", num(t.redelivered));
  setText("c-released", `${num(t.released)} / ${num(t.recovered)}`);
  setText("c-batches", num(t.batches));
  setText("c-jobs", `${num(t.jobs)} / ${num(t.bisections)}`);
  drawSystemic(s);
  drawGraph(s);
  legend("legend-rates", ["pulled", "acked", "nacked", "dead_lettered"]);
  legend("legend-window", ["in_flight", "max_inflight"]);
  legend("legend-latency", ["batch_p50_s", "batch_p99_s", "ack_p50_s", "ack_p99_s"]);
  chart("chart-rates", s.history, ["pulled", "acked", "nacked", "dead_lettered"]);
  chart("chart-window", s.history, ["max_inflight", "in_flight"], { shade: true });
  chart("chart-latency", s.history, ["batch_p50_s", "batch_p99_s", "ack_p50_s", "ack_p99_s"]);
  drawWindow(s);
  drawSource(s);
  drawLatency(s);
  drawWindows(s);
  drawSchema(s);
  drawDeadLetters(s);
  document.body.dataset.version = String((Number(document.body.dataset.version) || 0) + 1);
}

function connect() {
  const events = new EventSource("/api/events");
  events.onopen = () => setText("conn", "live");
  events.onmessage = (m) => {
    try { render(JSON.parse(m.data)); } catch (e) { setText("conn", `bad update: ${e.message}`); }
    if (last && last.state === "stopped") {  // the server goes away with the run
      events.close();
      setText("conn", "the run has ended; this is its last state");
    }
  };
  events.onerror = () => {
    setText("conn", last && last.state === "stopped" ? "the run has ended" : "reconnecting…");
  };
}

$("dl-step").addEventListener("change", () => { if (last) drawDeadLetters(last); });
$("replay").addEventListener("click", replaySelected);
fetch("/api/status").then((r) => r.json()).then(render).catch(() => {});
connect();

// evict explore: the lesson's page. Draws each figure from its JSON endpoint. Hand-written, no libraries: SVG + fetch.
"use strict";
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
// every colour used for text reaches 4.5:1 on white
const BLUE = "#2f5bd3", ORANGE = "#a35200", GREEN = "#1e7a46", RED = "#c62828", GREY = "#5f6878", PURPLE = "#7b4bc4";

function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function clear(svg) { while (svg.firstChild) svg.removeChild(svg.firstChild); }
async function get(url, opts) {
  const r = await fetch(url, opts);
  let j;
  try { j = await r.json(); } catch (e) { throw new Error(`${url}: HTTP ${r.status}, not JSON`); }
  if (!r.ok) throw new Error(j.detail || r.statusText);
  return j;
}
const num = (x) => (x === null || x === undefined ? "—" : String(+(+x).toFixed(3)).replace(/^-0$/, "0"));
const vec = (v) => "[" + v.map(num).join(", ") + "]";
const pct = (x) => (x === null || x === undefined ? "—" : (100 * x).toFixed(1) + " %");
function fmtBytes(b) {
  for (const [u, s] of [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["KB", 1e3]]) if (Math.abs(b) >= s) return +(b / s).toPrecision(3) + " " + u;
  return b + " B";
}
function fmtCount(n) {
  for (const [u, s] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]]) if (Math.abs(n) >= s) return +(n / s).toPrecision(3) + u;
  return String(n);
}
const comma = (n) => Math.round(n).toLocaleString("en-US");

// requests: one queue per figure. While a request is in flight, newer ones replace each other in a one-slot queue;
// an answer is drawn only if no newer request was made meanwhile, so the figure always ends on the last value asked.
// The figure is aria-busy (drawn as "computing…") while its queue runs; an error is drawn inside the figure.
const flights = {};
function ask(fig, url, draw) {
  const f = flights[fig] || (flights[fig] = { busy: false, next: null });
  f.next = { url, draw };
  if (!f.busy) pump(fig, f);
}
async function pump(fig, f) {
  f.busy = true; busy(fig, true);
  while (f.next) {
    const { url, draw } = f.next; f.next = null;
    let d = null, err = null;
    try { d = await get(url); } catch (e) { err = e; }
    if (f.next) continue;  // a newer request exists: this answer is stale, never drawn
    try { if (err) throw err; draw(d); showError(fig, null); } catch (e) { console.error(e); showError(fig, e.message || String(e)); }
  }
  f.busy = false; busy(fig, false);
}
function box(fig) { return $(`fig-${fig}`) || $(fig); }
function busy(fig, on) {
  const b = box(fig);
  if (on) b.setAttribute("aria-busy", "true"); else b.removeAttribute("aria-busy");
}
function showError(fig, message) {
  const b = box(fig);
  let e = b.querySelector(":scope > .error");
  if (!message) { if (e) e.remove(); return; }
  if (!e) { e = document.createElement("p"); e.className = "error"; e.setAttribute("role", "alert"); b.appendChild(e); }
  e.textContent = `The endpoint said: ${message}`;
}
function valueText(id, text) { $(id).setAttribute("aria-valuetext", text); }

// a matrix as coloured cells with their numbers; blue positive, red negative
function board(svg, M, x, y, cell, title, opts = {}) {
  const g = el("g", { transform: `translate(${x},${y})` }, svg);
  if (title) el("text", { x: 0, y: -6 }, g, title);
  const max = opts.max || Math.max(1e-9, ...M.flat().map(Math.abs));
  M.forEach((row, i) => row.forEach((v, j) => {
    const a = Math.min(1, Math.abs(v) / max);
    el("rect", { x: j * cell, y: i * cell, width: cell - 1, height: cell - 1, fill: v >= 0 ? `rgba(47,91,211,${a})` : `rgba(198,40,40,${a})`,
      stroke: opts.rows && opts.rows.includes(i) ? ORANGE : "#ccd2df", "stroke-width": opts.rows && opts.rows.includes(i) ? 2 : 1 }, g);
    if (opts.numbers !== false) el("text", { x: j * cell + cell / 2, y: i * cell + cell / 2 + 4, "text-anchor": "middle",
      style: `fill:${a > 0.45 ? "#fff" : "#1d2330"};font-size:12px` }, g, num(v));
  }));
  return g;
}

// log/linear axes
function scale(d0, d1, r0, r1, log) {
  const f = log ? Math.log10 : (v) => v;
  return (v) => r0 + (f(v) - f(d0)) / (f(d1) - f(d0)) * (r1 - r0);
}
function polyline(svg, pts, attrs) {
  el("polyline", { points: pts.map((p) => p.join(",")).join(" "), fill: "none", ...attrs }, svg);
}
function keyActivate(node, fn) {  // Enter or Space on a focusable SVG element acts like a click
  node.addEventListener("click", fn);
  node.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); fn(); } });
}

// concept map -----------------------------------------------------------------------------------------------------
function conceptMap(data) {
  const svg = $("concept-svg"); clear(svg);
  const pos = {};
  data.groups.forEach((grp, gi) => {
    el("text", { x: 20 + gi * 240, y: 18, style: "font-weight:bold" }, svg, grp);
    data.nodes.filter((n) => n.group === grp).forEach((n, i) => { pos[n.id] = [20 + gi * 240, 30 + i * 78]; });
  });
  const defs = el("defs", {}, svg);
  const m = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto" }, defs);
  el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#8d9ab8" }, m);
  const links = el("g", { "aria-hidden": "true" }, svg);
  data.links.forEach((l) => {
    const [x1, y1] = pos[l.from], [x2, y2] = pos[l.to];
    el("path", { d: `M${x1 + 110},${y1 + 27} C${x1 + 160},${y1 + 60} ${x2 + 60},${y2 - 20} ${x2 + 110},${y2 + 27}`, stroke: "#b9c3dc",
      fill: "none", "marker-end": "url(#arrow)" }, links);
  });
  const title = (fig) => fig ? box(fig).dataset.title : null;
  data.nodes.forEach((n) => {
    const [x, y] = pos[n.id];
    const g = el("g", { class: "node", id: `concept-${n.id}`, transform: `translate(${x},${y})`, tabindex: 0, role: "button",
      "aria-pressed": "false", "aria-label": n.idea }, svg);
    el("rect", { width: 220, height: 56, rx: 6 }, g);
    const words = n.idea.split(" "); let line = "", lines = [];
    for (const w of words) { if ((line + " " + w).length > 30) { lines.push(line); line = w; } else line = line ? line + " " + w : w; }
    lines.push(line);
    lines.slice(0, 3).forEach((t, i) => el("text", { x: 8, y: 17 + i * 16 }, g, t));
    keyActivate(g, () => {
      document.querySelectorAll(".node").forEach((e) => { e.classList.remove("on"); e.setAttribute("aria-pressed", "false"); });
      g.classList.add("on"); g.setAttribute("aria-pressed", "true");
      const from = data.links.filter((l) => l.to === n.id).map((l) => `${l.why} (${l.from})`);
      const to = data.links.filter((l) => l.from === n.id).map((l) => `${l.to}: ${l.why}`);
      $("concept-detail").innerHTML = `<b>${n.idea}</b> — ` + (n.figure ? `figure: <a href="#fig-${n.figure}">${title(n.figure)}</a> · ` : "") +
        `computed by <code>${n.command}</code>` + (from.length ? `<br>solves: ${from.join("; ")}` : "") + (to.length ? `<br>leads to: ${to.join("; ")}` : "");
    });
  });
}

// memory wall: the curves come once; each move of the slider asks only for its point --------------------------------
const WALL_COLORS = { gpt2_124m: BLUE, llama70b_gqa: GREEN, dense_mha_k3: RED, k3_mla: ORANGE, k3_kda: PURPLE };
let wallCurves = null;
function wallIndex(context) {  // the slider stop nearest to a context (log scale)
  let best = 0;
  wallCurves.grid.forEach((c, i) => { if (Math.abs(Math.log(c / context)) < Math.abs(Math.log(wallCurves.grid[best] / context))) best = i; });
  return best;
}
function memoryWall(context) {
  ask("memory-wall", `/api/memory-wall?context=${context}&curves=${wallCurves ? "false" : "true"}`, (d) => {
    if (!wallCurves) wallCurves = { grid: d.grid, lines: Object.fromEntries(d.lines.map((l) => [l.id, l.bytes])) };
    wallDraw(d);
  });
}
function wallDraw(d) {
  $("wall-context").textContent = comma(d.context);
  const s = $("wall-slider");
  if (document.activeElement !== s || wallCurves.grid[+s.value] !== d.context) s.value = wallIndex(d.context);
  valueText("wall-slider", `${comma(d.context)} tokens`);
  const svg = $("wall-svg"); clear(svg);
  const grid = wallCurves.grid;
  const X = scale(1e3, 1e7, 70, 940, true), Y = scale(1e5, 1e14, 330, 10, true);
  for (let e = 3; e <= 7; e++) { el("line", { x1: X(10 ** e), x2: X(10 ** e), y1: 10, y2: 330, stroke: "#eee" }, svg); el("text", { x: X(10 ** e) - 10, y: 350 }, svg, fmtCount(10 ** e)); }
  for (let e = 5; e <= 14; e += 3) { el("line", { x1: 70, x2: 940, y1: Y(10 ** e), y2: Y(10 ** e), stroke: "#eee" }, svg); el("text", { x: 4, y: Y(10 ** e) + 4 }, svg, fmtBytes(10 ** e)); }
  el("line", { x1: 70, x2: 940, y1: Y(d.ceiling.bytes), y2: Y(d.ceiling.bytes), stroke: RED, "stroke-dasharray": "6 4" }, svg);
  el("text", { x: 76, y: Y(d.ceiling.bytes) - 5, style: `fill:${RED}` }, svg, d.ceiling.label);
  el("line", { x1: X(d.context), x2: X(d.context), y1: 10, y2: 330, stroke: "#333", "stroke-dasharray": "2 3" }, svg);
  let rows = "<tr><th scope='col'>line</th><th scope='col'>bytes per sequence</th><th scope='col'>bytes / token</th><th scope='col'>fills 141 GB at</th></tr>";
  d.lines.forEach((l) => {
    polyline(svg, grid.map((c, i) => [X(c), Y(Math.max(wallCurves.lines[l.id][i], 1e5))]), { stroke: WALL_COLORS[l.id], "stroke-width": 2 });
    el("circle", { cx: X(d.context), cy: Y(Math.max(l.at_context, 1e5)), r: 4, fill: WALL_COLORS[l.id] }, svg);
    rows += `<tr><td><span style="color:${WALL_COLORS[l.id]}" aria-hidden="true">■</span> ${l.label}</td><td id="wall-at-${l.id}">${fmtBytes(l.at_context)}</td>` +
      `<td id="wall-pt-${l.id}">${l.bytes_per_token ? comma(l.bytes_per_token) + " B" : "0 (flat)"}</td>` +
      `<td>${l.hits_ceiling_at ? comma(l.hits_ceiling_at) + " tokens" : "never"}</td></tr>`;
  });
  $("wall-table").innerHTML = rows;
}

// history fold ----------------------------------------------------------------------------------------------------
function historyFold(step) {
  ask("history-fold", `/api/history-fold?step=${step}`, (d) => {
    $("fold-t").textContent = d.step;
    valueText("fold-step", `token ${d.step} of ${d.max_step}`);
    $("fold-kv-bytes").textContent = `${d.kv_bytes_read} B`;
    $("fold-state-bytes").textContent = `${d.state_bytes_read} B`;
    $("fold-t2").textContent = d.step;
    $("fold-o-attn").textContent = vec(d.o_attention);
    $("fold-o-fold").textContent = vec(d.o_fold);
    const svg = $("fold-svg"); clear(svg);
    const shelf = d.keys.map((k, i) => k.concat(d.values[i]));
    board(svg, shelf, 10, 30, 14, `KV shelf: ${d.step} rows × (8 keys + 8 values)`, { numbers: false, rows: shelf.map((_, i) => i), max: 2.5 });
    board(svg, d.S, 290, 30, 26, "state S (8×8): the same tokens folded", { numbers: false, max: 2.5 });
    const X = scale(0.5, d.max_step + 0.5, 560, 940, false), Y = scale(0, Math.max(...d.per_step.map((p) => p.kv_bytes)), 300, 40, false);
    el("text", { x: 560, y: 24 }, svg, "bytes read per step: shelf vs state");
    el("text", { x: 560, y: 318, style: `fill:${ORANGE}` }, svg, "■ shelf");
    el("text", { x: 630, y: 318, style: `fill:${BLUE}` }, svg, "■ state · token 1 … 16");
    d.per_step.forEach((p) => {
      el("rect", { x: X(p.step) - 10, y: Y(p.kv_bytes), width: 9, height: 300 - Y(p.kv_bytes), fill: p.step <= d.step ? ORANGE : "#f3d9bf" }, svg);
      el("rect", { x: X(p.step), y: Y(p.state_bytes), width: 9, height: 300 - Y(p.state_bytes), fill: p.step <= d.step ? BLUE : "#c9d4f1" }, svg);
    });
  });
}

// whiteboard: the writes on the page are the ones the endpoint accepted --------------------------------------------
let wbWrites = ["cat", "dog"];
function whiteboard(writes) {
  ask("whiteboard", `/api/whiteboard?writes=${writes.join(",")}&read=${$("wb-read").value}`, (d) => {
    wbWrites = d.writes;
    $("wb-writes").textContent = d.writes.length ? d.writes.join(", ") : "none";
    $("wb-key").textContent = `${d.read} ${vec(d.query)}`;
    $("wb-o").textContent = vec(d.o);
    $("wb-error").textContent = vec(d.error);
    $("wb-every").textContent = Object.entries(d.reads).map(([k, r]) => `${k} ${r.error_norm < 1e-9 ? "exact" : "off by " + num(r.error_norm)}`).join(" · ") || "nothing written";
    $("wb-law").textContent = d.terms.length ? "o = " + d.terms.map((t) => `${num(t.overlap)}·${vec(t.value)}`).join(" + ") : "o = 0: nothing written";
    const svg = $("wb-svg"); clear(svg);
    d.steps.slice(-4).forEach((s, i) => board(svg, s.S, 10 + i * 190, 24, 40, s.label, { max: 4 }));
    board(svg, [d.o], 780, 24, 40, `read ${d.read}`, { max: 4 });
  });
}

// delta stamp -----------------------------------------------------------------------------------------------------
let dsStep = 0;
function deltaStamp() {
  const step = dsStep;
  ask("delta-stamp", `/api/delta-stamp?beta=${+$("ds-beta").value}`, (d) => {
    const s = d.steps[step];
    $("ds-beta-val").textContent = num(d.beta);
    valueText("ds-beta", `β = ${num(d.beta)}`);
    $("ds-step").textContent = `${step + 1} / ${d.steps.length}`;
    $("ds-label").textContent = s.label;
    $("ds-vold").textContent = s.v_old ? vec(s.v_old) : "—";
    $("ds-u").textContent = s.u ? vec(s.u) : "—";
    $("ds-row0").textContent = vec(s.S[0]);
    $("ds-row1").textContent = vec(s.S[1]);
    const svg = $("ds-svg"); clear(svg);
    board(svg, s.S, 10, 24, 40, "board S", { max: 3, rows: [0] });
    if (s.v_old) board(svg, [s.v_old], 220, 24, 40, "v_old = k_cat S", { max: 3 });
    board(svg, [d.new_value], 220, 104, 40, "v_new (Biscuit)", { max: 3 });
    if (s.u) board(svg, [s.u], 430, 24, 40, "u = β (v_new − v_old)", { max: 3 });
    if (step === 3) board(svg, [s.u, [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]].map((r, i) => r.map((x) => x * d.key[i])), 640, 24, 40, "stamp k_catᵀ u", { max: 3 });
  });
}

// chunk dial ------------------------------------------------------------------------------------------------------
let dialSizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], dialPolling = false;
function chunkDial() {
  const C = dialSizes[+$("dial-C").value] || 64;
  ask("chunk-dial", `/api/chunk-dial?C=${C}`, dialDraw);
}
function dialDraw(d) {
  dialSizes = d.sizes; $("dial-C").max = d.sizes.length - 1;
  const i = d.sizes.indexOf(d.at.C);
  $("dial-c").textContent = d.at.C;
  valueText("dial-C", `chunk size ${d.at.C}`);
  $("dial-flops").textContent = `${num(d.at.flops / 1e6)} MFLOP (2Td² + 2TCd per head × ${d.shape.B * d.shape.H} heads)`;
  $("dial-cpu-ms").textContent = d.cpu ? `${num(d.cpu.seconds[i] * 1e3)} ms` : "not measured yet";
  const gi = d.gpu ? d.gpu.sizes.indexOf(d.at.C) : -1;
  $("dial-gpu").textContent = d.gpu ? `GPU (${d.gpu.card.gpu || "CUDA"}, B${d.gpu.shape.B} T${d.gpu.shape.T} H${d.gpu.shape.H} D${d.gpu.shape.D}): ${gi >= 0 ? num(d.gpu.seconds[gi] * 1e3) + " ms" : "—"}` : "GPU numbers: not yet measured";
  const p = d.progress;
  $("dial-progress").max = p.total; $("dial-progress").value = d.cpu ? p.total : p.done;
  $("dial-status").textContent = d.cpu ? `measured on this machine (B${d.shape.B} T${d.shape.T} H${d.shape.H} D${d.shape.D}, one thread; cached)` :
    p.status === "error" ? `measurement failed: ${p.error}` : `measuring the chunked op on this machine: ${p.done} / ${p.total} chunk sizes`;
  const svg = $("dial-svg"); clear(svg);
  const T = d.shape.T, side = 300, u = side / T;
  el("text", { x: 10, y: 16 }, svg, `T×T work map: ${comma(d.at.intra_pairs)} pairs in tiles,`);
  el("text", { x: 10, y: 344 }, svg, `${comma(d.at.folded_pairs)} folded into S`);
  el("polygon", { points: `10,24 10,${24 + side} ${10 + side},${24 + side}`, fill: "#dfe6f8" }, svg);
  for (let c = 0; c < d.at.chunks; c++) el("rect", { x: 10 + c * d.at.C * u, y: 24 + c * d.at.C * u, width: Math.max(d.at.C * u, 0.6), height: Math.max(d.at.C * u, 0.6), fill: "#e07b1a" }, svg);
  const X = scale(1, T, 400, 930, true);
  const series = [["cost law (FLOPs)", d.law.map((l) => l.flops), GREY]];
  if (d.cpu) series.push(["this machine (s)", d.cpu.seconds, BLUE]);
  if (d.gpu) series.push(["GPU (s)", d.gpu.sizes.filter((c) => c <= T).map((c) => d.gpu.seconds[d.gpu.sizes.indexOf(c)]), GREEN]);
  el("text", { x: 400, y: 16 }, svg, "each curve ÷ its own minimum (log scale); a U's bottom is the best C");
  const Y = scale(1, 64, 300, 30, true);
  for (const v of [1, 2, 4, 8, 16, 32, 64]) { el("line", { x1: 400, x2: 930, y1: Y(v), y2: Y(v), stroke: "#eee" }, svg); el("text", { x: 366, y: Y(v) + 4 }, svg, `${v}×`); }
  d.sizes.forEach((c) => el("text", { x: X(c) - 6, y: 320 }, svg, String(c)));
  series.forEach(([name, ys, color], k) => {
    const lo = Math.min(...ys);
    polyline(svg, ys.map((y, j) => [X(d.sizes[j]), Y(Math.min(64, y / lo))]), { stroke: color, "stroke-width": 2 });
    ys.forEach((y, j) => el("circle", { cx: X(d.sizes[j]), cy: Y(Math.min(64, y / lo)), r: j === i ? 5 : 3, fill: color }, svg));
    el("text", { x: 780, y: 40 + k * 17, style: `fill:${color}` }, svg, name);
  });
  el("line", { x1: X(d.at.C), x2: X(d.at.C), y1: 30, y2: 300, stroke: "#333", "stroke-dasharray": "2 3" }, svg);
  if (!d.cpu && p.status !== "error" && !dialPolling) dialPoll(p.status === "running");
}
async function dialPoll(running) {  // start the measurement once, follow its progress, then redraw at the dial's C
  dialPolling = true;
  try {
    if (!running) await get("/api/chunk-dial/measure", { method: "POST" });
    while (true) {
      const p = await get("/api/chunk-dial/progress");
      $("dial-progress").max = p.total; $("dial-progress").value = p.done;
      $("dial-status").textContent = `measuring the chunked op on this machine: ${p.done} / ${p.total} chunk sizes`;
      if (p.status !== "running") break;
      await new Promise((r) => setTimeout(r, 300));
    }
  } catch (e) { showError("chunk-dial", e.message); }
  chunkDial();
}

// fade curve ------------------------------------------------------------------------------------------------------
const FACT_COLORS = { mochi: BLUE, junk: RED, tax: GREEN };
function fadeCurve() {
  ask("fade-curve", `/api/fade-curve?slam=${+$("fade-slam").value}`, (d) => {
    $("fade-slam-val").textContent = num(d.slam);
    valueText("fade-slam", `slam α = ${num(d.slam)}`);
    for (const f of ["mochi", "junk", "tax"]) $(`fade-${f}`).textContent = num(d.survival[f][d.query]);
    $("fade-example-gates").textContent = Object.values(d.example.gates).map(num).join(" · ");
    $("fade-example").textContent = num(d.example.survival);
    $("fade-worked").textContent = ["mochi", "junk"].map((f) => {  // survival = the product of the gates after the write
      const gs = d.gates.slice(d.facts[f].token + 1, d.query + 1), prod = gs.reduce((a, g) => a * g, 1);
      const other = gs.filter((g) => g !== d.baseline);
      return `${f === "mochi" ? "Mochi" : "junk"} (written at token ${d.facts[f].token}): ${num(d.baseline)}^${gs.length - other.length}` +
        other.map((g) => ` × ${num(g)}`).join("") + ` = ${num(prod)}`;
    }).join(" · ") + " — the curve's values at the query.";
    const svg = $("fade-svg"); clear(svg);
    const X = scale(0, d.tokens - 1, 50, 930, false), Y = scale(0, 1, 270, 20, false);
    for (const v of [0, 0.5, 1]) { el("line", { x1: 50, x2: 930, y1: Y(v), y2: Y(v), stroke: "#eee" }, svg); el("text", { x: 14, y: Y(v) + 4 }, svg, num(v)); }
    el("line", { x1: X(d.switch), x2: X(d.switch), y1: 20, y2: 270, stroke: "#333", "stroke-dasharray": "3 3" }, svg);
    el("text", { x: X(d.switch) + 4, y: Y(0.62) }, svg, `switch: the gate slams to ${num(d.slam)} × ${num(d.baseline)}`);
    el("text", { x: X(d.query) - 44, y: 34 }, svg, "query");
    el("text", { x: 50, y: 292 }, svg, "token 0 … 24; survival = read · value / |value|²");
    Object.entries(d.survival).forEach(([f, ys], k) => {
      const pts = ys.map((y, t) => [t, y]).filter((p) => p[1] !== null).map(([t, y]) => [X(t), Y(y)]);
      polyline(svg, pts, { stroke: FACT_COLORS[f], "stroke-width": 2 });
      el("text", { x: 800, y: 60 + k * 17, style: `fill:${FACT_COLORS[f]}` }, svg, f === "tax" ? "tax form" : f);
    });
  });
}

// twin boards: computed for the chosen gates, scrubbed token by token ---------------------------------------------
let twinData = null, twinRunId = 0;
function twinDraw(t) {
  const d = twinData;
  $("twin-t").textContent = t;
  $("twin-t-slider").value = t;
  valueText("twin-t-slider", `token ${t} of ${d.scalar.tokens - 1}`);
  const svg = $("twin-svg"); clear(svg);
  const sides = [["scalar", "one knob (scalar gate)"], ["per_channel", "four knobs (per channel, KDA)"]];
  sides.forEach(([key, label], k) => {
    const s = d[key];
    board(svg, s.boards[t], 20 + k * 480, 40, 40, `${label}, after token ${t}`, { max: 3 });
    const gate = Array.isArray(s.gates[t]) ? s.gates[t] : [s.gates[t]];
    el("text", { x: 200 + k * 480, y: 60 }, svg, `gate now: ${vec(gate)}`);
    el("text", { x: 200 + k * 480, y: 80 }, svg, `Mochi ${pct(s.survival.mochi[t])} · junk ${pct(s.survival.junk[t])}`);
  });
  const sc = d.scalar, pc = d.per_channel;
  $("twin-scalar-gate").textContent = num(sc.gates[t]);
  $("twin-channel-gate").textContent = vec(pc.gates[t]);
  $("twin-scalar-mochi").textContent = pct(sc.survival.mochi[t]);
  $("twin-scalar-junk").textContent = pct(sc.survival.junk[t]);
  $("twin-channel-mochi").textContent = pct(pc.survival.mochi[t]);
  $("twin-channel-junk").textContent = pct(pc.survival.junk[t]);
  $("twin-scalar-read").textContent = vec(sc.reads.mochi[t]);
  $("twin-channel-read").textContent = vec(pc.reads.mochi[t]);
}
function twinBoards() {
  ask("twin-boards", `/api/twin-boards?keep=${+$("twin-keep").value}&clear=${+$("twin-clear").value}`, (d) => {
    twinData = d;
    $("twin-keep-val").textContent = num(d.keep); valueText("twin-keep", `keep ${num(d.keep)}`);
    $("twin-clear-val").textContent = num(d.clear); valueText("twin-clear", `clear ${num(d.clear)}`);
    twinDraw(+$("twin-t-slider").value);
  });
}
async function twinRun() {  // a new run (or a scrub) ends the one before: runs never interleave
  const id = ++twinRunId;
  for (let t = 0; t < twinData.scalar.tokens; t++) {
    if (id !== twinRunId) return;
    twinDraw(t);
    await new Promise((r) => setTimeout(r, 60));
  }
}

// parameter accountant --------------------------------------------------------------------------------------------
function params(view) {
  ask("param-accountant", `/api/params?view=${view}`, (d) => {
    document.querySelectorAll("#fig-param-accountant button").forEach((b) => {
      b.classList.toggle("on", b.dataset.view === d.view); b.setAttribute("aria-pressed", String(b.dataset.view === d.view));
    });
    $("params-headline").textContent = d.headline;
    $("params-notes").textContent = `experts ${(100 * d.experts_share).toFixed(1)} % of stored parameters · ` +
      `${comma(d.ratio_total)}× GPT-2 small stored (the lesson's 2.8T / 124M = ${comma(d.ratio_lesson)}×), ${comma(d.ratio_active)}× active · ` +
      `MLA caches ${d.mla_numbers_per_token} numbers / token / layer vs ${comma(d.mha_numbers_per_token)} for ${d.mha.heads}-head MHA ` +
      `(2 × ${d.mha.heads} heads × ${d.mha.head_dim}; ${num(d.mla_saving)}×) · ${d.moe.routed} routed + ${d.moe.shared} shared experts, top-${d.moe.top_k}`;
    $("params-arith").textContent = `arithmetic: ${comma(d.total)} stored ÷ ${comma(d.gpt2_total)} (GPT-2 small, counted by the same accountant) = ` +
      `${comma(d.ratio_total)}×; ${comma(d.active)} active ÷ ${comma(d.gpt2_total)} = ${comma(d.ratio_active)}×; the lesson's 2.8T ÷ 124M = ${comma(d.ratio_lesson)}×`;
    const svg = $("params-svg"); clear(svg);
    const bars = d.view === "ratio" ? [{ kind: "GPT-2 small (the unit)", params: d.gpt2_total, text: "1× GPT-2", unit: true }, ...d.bars] : d.bars;
    const X = d.view === "ratio" ? scale(1e-3, 1e5, 0, 560, true) : (v) => 560 * v / d.value;  // ratio: log scale in GPT-2 units
    if (d.view === "ratio") for (const e of [-3, -1, 1, 3, 5]) {
      el("line", { x1: 200 + X(10 ** e), x2: 200 + X(10 ** e), y1: 6, y2: 14 + bars.length * 28, stroke: "#e3e6ee" }, svg);
      el("text", { x: 190 + X(10 ** e), y: 30 + bars.length * 28 }, svg, `${10 ** e}×`);
    }
    bars.forEach((b, i) => {
      const w = Math.max(1, d.view === "ratio" ? X(b.params / d.gpt2_total) : X(b.params));
      const share = b.unit ? "" : ` (${(100 * b.share).toFixed(1)} %)`;
      el("text", { x: 10, y: 24 + i * 28 }, svg, b.kind.replace("_", " "));
      el("rect", { x: 200, y: 10 + i * 28, width: w, height: 18, fill: b.unit ? GREEN : b.kind === "experts" ? ORANGE : BLUE }, svg);
      el("text", { x: 208 + w, y: 24 + i * 28, id: `params-bar-${b.kind.split(" ")[0]}` }, svg, `${b.text}${share}`);
    });
  });
}

// layer map: bars are buttons (one Tab stop; arrows move between layers) --------------------------------------------
function layerMap(d) {
  const svg = $("layers-svg"); clear(svg);
  const max = Math.max(...d.layers.map((l) => l.params)), w = 920 / d.layers.length;
  const bars = [];
  const show = (l) => {
    $("layer-detail").textContent = `layer ${l.layer}: ${l.mixer.toUpperCase()} mixer + ${l.ffn === "moe" ? "latent MoE" : "dense " + l.ffn} FFN · ` +
      `${l.params_text} stored, ${fmtCount(l.active)} active per token · cache ${l.cache_bytes_per_token ? comma(l.cache_bytes_per_token) + " B per token" : "fixed state of " + comma(l.fixed_state_numbers) + " numbers"}` +
      (l.snapshot ? " · AttnRes snapshot" : "");
  };
  d.layers.forEach((l, i) => {
    const h = 190 * l.params / max, ha = 190 * l.active / max;
    const r = el("rect", { id: `layer-${l.layer}`, class: "bar", x: 20 + i * w, y: 220 - h, width: w - 1, height: h, fill: l.mixer === "mla" ? ORANGE : BLUE,
      stroke: l.ffn !== "moe" ? GREEN : "none", "stroke-width": 2, tabindex: i === 0 ? 0 : -1, role: "button",
      "aria-label": `layer ${l.layer}, ${l.mixer.toUpperCase()}` }, svg);
    bars.push(r);
    el("rect", { x: 20 + i * w, y: 220 - ha, width: w - 1, height: ha, fill: "#1d2330", "pointer-events": "none" }, svg);
    if (l.snapshot) el("text", { x: 20 + i * w + w / 2 - 5, y: 238 }, svg, "▲");
    r.addEventListener("mouseenter", () => show(l));
    r.addEventListener("focus", () => show(l));
    keyActivate(r, () => show(l));
    r.addEventListener("keydown", (e) => {
      const j = { ArrowRight: i + 1, ArrowDown: i + 1, ArrowLeft: i - 1, ArrowUp: i - 1, Home: 0, End: bars.length - 1 }[e.key];
      if (j === undefined || j < 0 || j >= bars.length) return;
      e.preventDefault(); r.setAttribute("tabindex", -1); bars[j].setAttribute("tabindex", 0); bars[j].focus();
    });
  });
  el("text", { x: 20, y: 16 }, svg, `${d.layers.length} layers: ${Object.entries(d.counts).map(([k, v]) => `${v} ${k.toUpperCase()}`).join(", ")} (pattern ${d.pattern}, final ${d.final_mixer}); dense FFN: layer ${d.dense_ffn_layers.join(", ")} (green outline); snapshots: ${d.snapshots.join(", ")}`);
  el("text", { x: 20, y: 256, style: `fill:${BLUE}` }, svg, "■ KDA");
  el("text", { x: 80, y: 256, style: `fill:${ORANGE}` }, svg, "■ MLA");
  el("text", { x: 140, y: 256 }, svg, `■ active per token (dark) · tallest bar ${fmtCount(max)} parameters`);
  $("layers-why").textContent = `Why ${d.layers.length} and not 92: ${d.why_93}`;
}

// depth lens ------------------------------------------------------------------------------------------------------
let lensData = null, lensPlain = false;
function lensDraw() {
  const d = lensData, a = d.attn_res, S = a.sources.length;
  const weights = lensPlain ? a.sources.map(() => 1 / S) : a.final_mean;
  $("lens-mode").textContent = lensPlain ? "plain residual (every snapshot added with weight 1: equal shares)" : "AttnRes (learned softmax over the snapshots)";
  $("lens-toggle").textContent = lensPlain ? "show AttnRes" : "show plain residual";
  $("lens-toggle").setAttribute("aria-pressed", String(lensPlain));
  $("lens-weights").textContent = vec(weights);
  const rms = lensPlain ? d.plain.layer_rms.map((r) => r.rms) : a.read_rms.map((r) => r.rms);
  $("lens-rms").textContent = vec(rms);
  const tr = d.training;
  $("lens-notes").textContent = `trained by ${d.command}: ${tr.attn_res.steps} steps, val loss ${num(tr.attn_res.val_loss)} (AttnRes) / ${num(tr.plain.val_loss)} (plain), unigram ${num(tr.attn_res.unigram_loss)} nats/char`;
  const t = Math.min(+$("lens-token").value, a.final_weights.length - 1);
  const mine = lensPlain ? weights : a.final_weights[t];
  $("lens-t").textContent = t;
  $("lens-char").textContent = `${JSON.stringify(d.text[t])} after ${JSON.stringify(d.text.slice(Math.max(0, t - 12), t))}`;
  valueText("lens-token", `token ${t}, ${JSON.stringify(d.text[t])}`);
  $("lens-token-weights").textContent = vec(mine);
  const svg = $("lens-svg"); clear(svg);
  el("text", { x: 10, y: 16 }, svg, `final read at token ${t}: share of each snapshot`);
  const hw = 180 / Math.max(0.25, ...a.final_mean, ...mine);
  mine.forEach((w, i) => {
    el("rect", { x: 10 + i * 50, y: 230 - hw * w, width: 42, height: hw * w, fill: lensPlain ? GREY : BLUE }, svg);
    el("line", { x1: 8 + i * 50, x2: 54 + i * 50, y1: 230 - hw * weights[i], y2: 230 - hw * weights[i], stroke: "#000", "stroke-width": 2 }, svg);
    el("text", { x: 10 + i * 50, y: 248, style: "font-size:12px" }, svg, a.sources[i].replace("layers ", "L").replace("layer ", "L").replace("embedding", "emb"));
    el("text", { x: 12 + i * 50, y: 226 - hw * Math.max(w, weights[i]) }, svg, num(w));
  });
  const n = d.plain.layer_rms.length;
  const curves = [[a.read_rms.map((r) => [r.read === "final" ? n + 0.5 : +r.read.split(" ")[1] - (r.read.endsWith("mixer") ? 0.5 : 0), r.rms]), !lensPlain, BLUE],
    [d.plain.layer_rms.map((r) => [r.layer, r.rms]), lensPlain, GREY]];
  const top = Math.max(...curves.flatMap((c) => c[0].map((p) => p[1]))) * 1.1;
  const X = scale(0, n + 0.5, 560, 930, false), Y = scale(0, top, 230, 30, false);
  el("text", { x: 560, y: 16 }, svg, "hidden-state RMS by depth");
  el("text", { x: 700, y: 278, style: `fill:${BLUE}` }, svg, "AttnRes: each sublayer's input");
  el("text", { x: 700, y: 296, style: `fill:${GREY}` }, svg, "plain: h after each layer");
  for (const v of [0, top / 2, top]) el("text", { x: 516, y: Y(v) + 4 }, svg, num(v));
  for (let l = 1; l <= n; l++) el("text", { x: X(l) - 3, y: 248, style: "font-size:12px" }, svg, String(l));
  curves.forEach(([pts, on, color]) => {
    polyline(svg, pts.map(([x, y]) => [X(x), Y(y)]), { stroke: color, "stroke-width": on ? 3 : 1.5, "stroke-dasharray": on ? "" : "4 3" });
    pts.forEach(([x, y]) => el("circle", { cx: X(x), cy: Y(y), r: on ? 3 : 2, fill: color }, svg));
  });
  el("text", { x: 560, y: 264 }, svg, "layer (shallow → deep)");
  el("text", { x: 10, y: 290, style: "font-size:12px" }, svg, `passage: ${JSON.stringify(d.text).slice(0, 60)}…`);
}

// the Mochi replays, computed by evict's ops -------------------------------------------------------------------------
const SHELF = (i) => 2 ** i;
function replay(n) {
  const q = n === 1 ? `?shelf=${SHELF(+$("replay1-shelf").value)}` : "";
  ask(`replay-${n}`, `/api/replay/${n}${q}`, (d) => { $(`replay${n}-out`).innerHTML = REPLAYS[n](d); });
}
const REPLAYS = {
  1: (d) => {
    $("replay1-n").textContent = comma(d.shelf);
    valueText("replay1-shelf", `${comma(d.shelf)} rows`);
    return `Mochi's row gets <b id="replay1-ratio">${num(d.ratio)}</b>× the weight of each orthogonal row (e⁴ = ${num(d.e_gap)}): weights Mochi <b id="replay1-w">${pct(d.w_mochi)}</b>, ` +
      `Rex ${pct(d.w_rex)} (its key overlaps cat by 0.6), each filler row ${pct(d.w_filler)}. The read is ${vec(d.read)}. ` +
      `To find it, this one token read <b id="replay1-bytes">${comma(d.bytes_read)} B</b> of 16-bit keys and values: the whole shelf, every step.`;
  },
  2: (d) => `Written cat → Mochi, then dog → Rex, the board reads cat as <b id="replay2-read">${vec(d.read)}</b>, not Mochi ${vec(d.mochi)}: ` +
    `the error ${vec(d.error)} is ${num(d.terms[1].overlap)} × Rex, because the two keys overlap by that much.`,
  3: (d) => `After the delta correction cat reads <b id="replay3-read">${vec(d.delta_read)}</b>, exactly Biscuit; the tax form still reads ${vec(d.tax_read)}. ` +
    `An additive write of Biscuit would have read ${vec(d.additive_read)}: Mochi plus Biscuit.<br>On a contaminated board (cat → Mochi and ` +
    `dog → Rex, keys overlapping by 0.6) the same correction makes cat read <b id="replay3-dirty-cat">${vec(d.contaminated.cat_after)}</b> ` +
    `(it read ${vec(d.contaminated.cat_before)}), exactly Biscuit again, but dog's read moves from ${vec(d.contaminated.dog_before)} to ` +
    `<b id="replay3-dirty-dog">${vec(d.contaminated.dog_after)}</b>: the eraser removes what k_cat retrieves, and part of that was dog's.`,
  4: (d) => `One scalar gate slammed to ${num(d.slam)} at the switch: at the query Mochi keeps <b id="replay4-mochi">${pct(d.mochi)}</b> and the junk ${pct(d.junk)} ` +
    `(without the slam: ${pct(d.mochi_no_slam)} and ${pct(d.junk_no_slam)}). Clearing the junk took Mochi down with it; cat reads ${vec(d.read)}.`,
  5: (d) => `KDA's four knobs keep Mochi's channel: Mochi <b id="replay5-kda">${pct(d.kda_mochi)}</b>, junk ${pct(d.kda_junk)}, cat reads ${vec(d.kda_read)}. ` +
    `The MLA layer's shelf still holds Mochi's row exactly, ${vec(d.shelf_row)}; its softmax read (score gap ${num(d.mla_gap)}) returns ` +
    `<b id="replay5-mla">${vec(d.mla_read)}</b>, ${pct(d.mla_w_mochi)} of its weight on Mochi.`,
};

// concept checks and the scorecard ----------------------------------------------------------------------------------
let score = null;
const answered = new Set();
function fillScore() {
  if (!score) return;
  const rows = score.rows.map((r) => {
    if (!answered.has(r.chapter)) return `<tr><th scope="row">${r.name}</th><td colspan="5" class="pending">answer chapter ${r.chapter}'s check to fill this row</td></tr>`;
    const m = r.measured;
    const meas = m ? `<a href="/results/${m.source.replace("results/recall/full/", "")}?line=${m.line}">${num(m.accuracy)}</a> <small>(lr ${m.lr}, ${comma(m.steps)} steps; ${m.source}, line ${m.line})</small>` :
      "not measured: the lab trains no K3-scale model";
    return `<tr class="filled" data-row="${r.name}"><th scope="row">${r.name}</th><td>${r.stores}</td><td>${r.write}</td><td>${r.read}</td><td>${r.eviction}</td><td>${meas}</td></tr>`;
  });
  document.querySelector("#scorecard tbody").innerHTML = rows.join("");
  const filled = score.rows.filter((r) => answered.has(r.chapter)).length;
  $("score-count").textContent = `${filled} of ${score.rows.length} rows filled.`;
}
function checks() {
  document.querySelectorAll(".check").forEach((c) => {
    const ch = +c.dataset.chapter;
    c.querySelectorAll("button[data-choice]").forEach((b) => {
      b.setAttribute("aria-pressed", "false");
      b.addEventListener("click", () => {
        const right = b.dataset.choice === c.dataset.answer;
        c.querySelectorAll("button[data-choice]").forEach((o) => { o.setAttribute("aria-pressed", String(o === b)); o.classList.toggle("right", o.dataset.choice === c.dataset.answer); });
        c.querySelector(".verdict").textContent = right ? "Right." : "Not quite: the answer is marked.";
        c.querySelector(".verdict").className = "verdict " + (right ? "ok" : "no");
        c.querySelector(".why").hidden = false;
        answered.add(ch); fillScore();
      });
    });
  });
  $("score-all").addEventListener("click", () => { for (let ch = 1; ch <= 8; ch++) answered.add(ch); fillScore(); });
}

// wiring ----------------------------------------------------------------------------------------------------------
function once(fig, url, draw) { ask(fig, url, draw); }
window.addEventListener("DOMContentLoaded", () => {
  $("toc").innerHTML = [...document.querySelectorAll("section.chapter")].map((s) => `<a href="#${s.id}">${s.dataset.title}</a>`).join("");
  checks();
  once("concept-map", "/api/concepts", conceptMap);
  memoryWall(1024);
  $("wall-slider").addEventListener("input", (e) => { if (wallCurves) memoryWall(wallCurves.grid[+e.target.value]); });
  document.querySelectorAll("#fig-memory-wall button").forEach((b) => b.addEventListener("click", () => memoryWall(+b.dataset.context)));
  $("wall-note").textContent = "The lesson's 4.7 GB at 128K and 37 GB at 1M are GPT-2's 36,864 B × 128,000 and × 1,000,000 tokens; the page opens at 1,024 tokens (37.7 MB).";
  historyFold(1);
  $("fold-step").addEventListener("input", (e) => historyFold(+e.target.value));
  whiteboard(wbWrites);
  for (const k of ["cat", "dog", "tax", "owl", "bee", "fox"]) $(`wb-write-${k}`).addEventListener("click", () => whiteboard(wbWrites.concat(k)));
  $("wb-clear").addEventListener("click", () => whiteboard([]));
  $("wb-read").addEventListener("change", () => whiteboard(wbWrites));
  deltaStamp();
  $("ds-next").addEventListener("click", () => { dsStep = Math.min(3, dsStep + 1); deltaStamp(); });
  $("ds-prev").addEventListener("click", () => { dsStep = Math.max(0, dsStep - 1); deltaStamp(); });
  $("ds-beta").addEventListener("input", () => deltaStamp());
  chunkDial();
  $("dial-C").addEventListener("input", () => chunkDial());
  fadeCurve();
  $("fade-slam").addEventListener("input", () => fadeCurve());
  twinBoards();
  $("twin-run").addEventListener("click", () => { if (twinData) twinRun(); });
  $("twin-t-slider").addEventListener("input", (e) => { twinRunId++; if (twinData) twinDraw(+e.target.value); });
  $("twin-keep").addEventListener("input", () => twinBoards());
  $("twin-clear").addEventListener("input", () => twinBoards());
  params("stored");
  document.querySelectorAll("#fig-param-accountant button").forEach((b) => b.addEventListener("click", () => params(b.dataset.view)));
  once("layer-map", "/api/layers", layerMap);
  once("depth-lens", "/api/depth-lens", (d) => { lensData = d; lensDraw(); });
  $("lens-toggle").addEventListener("click", () => { if (lensData) { lensPlain = !lensPlain; lensDraw(); } });
  $("lens-token").addEventListener("input", () => { if (lensData) lensDraw(); });
  for (let n = 1; n <= 5; n++) replay(n);
  $("replay1-shelf").addEventListener("input", () => replay(1));
  ask("ch-9", "/api/scorecard", (d) => {
    score = d; fillScore();
    $("score-setting").textContent = `K = ${d.setting.pairs} pairs, L = ${d.setting.seq_len}, d_model = ${d.setting.d_model}`;
  });
});

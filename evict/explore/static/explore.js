// evict explore: draws each figure from its JSON endpoint. Hand-written, no libraries: SVG + fetch.
"use strict";
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
const BLUE = "#2f5bd3", ORANGE = "#e07b1a", GREEN = "#2a9d5c", RED = "#c62828", GREY = "#8a93a6";

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
  const j = await r.json();
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
      style: `fill:${a > 0.55 ? "#fff" : "#1d2330"};font-size:${Math.min(12, cell / 3)}px` }, g, num(v));
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

// 1 · concept map -------------------------------------------------------------------------------------------------
async function conceptMap() {
  const data = await get("/api/concepts");
  const svg = $("concept-svg"); clear(svg);
  const pos = {};
  data.groups.forEach((grp, gi) => {
    el("text", { x: 20 + gi * 240, y: 18, style: "font-weight:bold" }, svg, grp);
    data.nodes.filter((n) => n.group === grp).forEach((n, i) => { pos[n.id] = [20 + gi * 240, 30 + i * 78]; });
  });
  const links = el("g", {}, svg);
  data.links.forEach((l) => {
    const [x1, y1] = pos[l.from], [x2, y2] = pos[l.to];
    el("path", { d: `M${x1 + 110},${y1 + 27} C${x1 + 160},${y1 + 60} ${x2 + 60},${y2 - 20} ${x2 + 110},${y2 + 27}`, stroke: "#b9c3dc",
      fill: "none", "marker-end": "url(#arrow)" }, links);
  });
  const defs = el("defs", {}, svg);
  const m = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto" }, defs);
  el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#b9c3dc" }, m);
  const title = (fig) => fig ? document.querySelector(`#fig-${fig}`).dataset.title : null;
  data.nodes.forEach((n) => {
    const [x, y] = pos[n.id];
    const g = el("g", { class: "node", id: `concept-${n.id}`, transform: `translate(${x},${y})` }, svg);
    el("rect", { width: 220, height: 56, rx: 6 }, g);
    const words = n.idea.split(" "); let line = "", lines = [];
    for (const w of words) { if ((line + " " + w).length > 32) { lines.push(line); line = w; } else line = line ? line + " " + w : w; }
    lines.push(line);
    lines.slice(0, 3).forEach((t, i) => el("text", { x: 8, y: 17 + i * 15 }, g, t));
    g.addEventListener("click", () => {
      document.querySelectorAll(".node").forEach((e) => e.classList.remove("on")); g.classList.add("on");
      const from = data.links.filter((l) => l.to === n.id).map((l) => `${l.why} (${l.from})`);
      const to = data.links.filter((l) => l.from === n.id).map((l) => `${l.to}: ${l.why}`);
      $("concept-detail").innerHTML = `<b>${n.idea}</b> — ` + (n.figure ? `figure: <a href="#fig-${n.figure}">${title(n.figure)}</a> · ` : "") +
        `computed by <code>${n.command}</code>` + (from.length ? `<br>solves: ${from.join("; ")}` : "") + (to.length ? `<br>leads to: ${to.join("; ")}` : "");
    });
  });
}

// 2 · memory wall -------------------------------------------------------------------------------------------------
const WALL_COLORS = { gpt2_124m: BLUE, llama70b_gqa: GREEN, dense_mha_k3: RED, k3_mla: ORANGE, k3_kda: "#7b4bc4" };
let wallGrid = null, wallSeq = 0;
async function memoryWall(context) {
  const seq = ++wallSeq;
  const d = await get(`/api/memory-wall?context=${context}`);
  if (seq !== wallSeq) return;  // a newer request (the slider moved on) owns the figure: never draw a stale answer
  wallGrid = d.grid;
  $("wall-context").textContent = comma(d.context);
  const svg = $("wall-svg"); clear(svg);
  const X = scale(1e3, 1e7, 60, 940, true), Y = scale(1e5, 1e14, 330, 10, true);
  for (let e = 3; e <= 7; e++) { el("line", { x1: X(10 ** e), x2: X(10 ** e), y1: 10, y2: 330, stroke: "#eee" }, svg); el("text", { x: X(10 ** e) - 10, y: 348 }, svg, fmtCount(10 ** e)); }
  for (let e = 5; e <= 14; e += 3) { el("line", { x1: 60, x2: 940, y1: Y(10 ** e), y2: Y(10 ** e), stroke: "#eee" }, svg); el("text", { x: 4, y: Y(10 ** e) + 4 }, svg, fmtBytes(10 ** e)); }
  el("line", { x1: 60, x2: 940, y1: Y(d.ceiling.bytes), y2: Y(d.ceiling.bytes), stroke: RED, "stroke-dasharray": "6 4" }, svg);
  el("text", { x: 66, y: Y(d.ceiling.bytes) - 5, style: `fill:${RED}` }, svg, d.ceiling.label);
  el("line", { x1: X(d.context), x2: X(d.context), y1: 10, y2: 330, stroke: "#333", "stroke-dasharray": "2 3" }, svg);
  let rows = "<tr><th>line</th><th>bytes per sequence</th><th>bytes / token</th><th>fills 141 GB at</th></tr>";
  d.lines.forEach((l) => {
    polyline(svg, d.grid.map((c, i) => [X(c), Y(Math.max(l.bytes[i], 1e5))]), { stroke: WALL_COLORS[l.id], "stroke-width": 2 });
    el("circle", { cx: X(d.context), cy: Y(Math.max(l.at_context, 1e5)), r: 4, fill: WALL_COLORS[l.id] }, svg);
    rows += `<tr><td><span style="color:${WALL_COLORS[l.id]}">■</span> ${l.label}</td><td id="wall-at-${l.id}">${fmtBytes(l.at_context)}</td>` +
      `<td id="wall-pt-${l.id}">${l.bytes_per_token ? comma(l.bytes_per_token) + " B" : "0 (flat)"}</td>` +
      `<td>${l.hits_ceiling_at ? comma(l.hits_ceiling_at) + " tokens" : "never"}</td></tr>`;
  });
  $("wall-table").innerHTML = rows;
}

// 3 · history fold ------------------------------------------------------------------------------------------------
async function historyFold(step) {
  const d = await get(`/api/history-fold?step=${step}`);
  $("fold-t").textContent = d.step;
  $("fold-kv-bytes").textContent = `${d.kv_bytes_read} B`;
  $("fold-state-bytes").textContent = `${d.state_bytes_read} B`;
  const svg = $("fold-svg"); clear(svg);
  const shelf = d.keys.map((k, i) => k.concat(d.values[i]));
  board(svg, shelf, 10, 30, 14, `KV shelf: ${d.step} rows × (8 keys + 8 values), every row read`, { numbers: false, rows: shelf.map((_, i) => i), max: 2.5 });
  board(svg, d.S, 290, 30, 26, "state S (8×8): the same tokens folded", { numbers: false, max: 2.5 });
  const X = scale(0.5, d.max_step + 0.5, 540, 940, false), Y = scale(0, Math.max(...d.per_step.map((p) => p.kv_bytes)), 300, 40, false);
  el("text", { x: 540, y: 24 }, svg, "bytes read per step: shelf (orange) vs state (blue)");
  d.per_step.forEach((p) => {
    el("rect", { x: X(p.step) - 10, y: Y(p.kv_bytes), width: 9, height: 300 - Y(p.kv_bytes), fill: p.step <= d.step ? ORANGE : "#f3d9bf" }, svg);
    el("rect", { x: X(p.step), y: Y(p.state_bytes), width: 9, height: 300 - Y(p.state_bytes), fill: p.step <= d.step ? BLUE : "#c9d4f1" }, svg);
  });
  el("text", { x: 540, y: 318 }, svg, "token 1 … 16");
}

// 4 · whiteboard --------------------------------------------------------------------------------------------------
let wbWrites = ["cat", "dog"];
async function whiteboard() {
  const d = await get(`/api/whiteboard?writes=${wbWrites.join(",")}&read=${$("wb-read").value}`);
  $("wb-writes").textContent = d.writes.length ? d.writes.join(", ") : "none";
  $("wb-key").textContent = `${d.read} ${vec(d.query)}`;
  $("wb-o").textContent = vec(d.o);
  $("wb-error").textContent = vec(d.error);
  $("wb-law").textContent = d.terms.length ? "o = " + d.terms.map((t) => `${num(t.overlap)}·${vec(t.value)}`).join(" + ") : "o = 0: nothing written";
  const svg = $("wb-svg"); clear(svg);
  d.steps.slice(-4).forEach((s, i) => board(svg, s.S, 10 + i * 190, 24, 40, s.label, { max: 4 }));
  board(svg, [d.o], 780, 24, 40, `read ${d.read}`, { max: 4 });
}

// 5 · delta stamp -------------------------------------------------------------------------------------------------
let dsStep = 0;
async function deltaStamp() {
  const beta = +$("ds-beta").value;
  $("ds-beta-val").textContent = num(beta);
  const d = await get(`/api/delta-stamp?beta=${beta}`);
  const s = d.steps[dsStep];
  $("ds-step").textContent = `${dsStep + 1} / ${d.steps.length}`;
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
  if (dsStep === 3) board(svg, [s.u, [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]].map((r, i) => r.map((x) => x * d.key[i])), 640, 24, 40, "stamp k_catᵀ u", { max: 3 });
}

// 6 · chunk dial --------------------------------------------------------------------------------------------------
let dialSizes = [1];
async function chunkDial() {
  const C = dialSizes[+$("dial-C").value] || 64;
  const d = await get(`/api/chunk-dial?C=${C}`);
  dialSizes = d.sizes; $("dial-C").max = d.sizes.length - 1;
  const i = d.sizes.indexOf(d.at.C);
  $("dial-c").textContent = d.at.C;
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
  for (let c = 0; c < d.at.chunks; c++) el("rect", { x: 10 + c * d.at.C * u, y: 24 + c * d.at.C * u, width: Math.max(d.at.C * u, 0.6), height: Math.max(d.at.C * u, 0.6), fill: ORANGE }, svg);
  const X = scale(1, T, 400, 930, true);
  const series = [["cost law (FLOPs)", d.law.map((l) => l.flops), GREY]];
  if (d.cpu) series.push(["this machine (s)", d.cpu.seconds, BLUE]);
  if (d.gpu) series.push(["GPU (s)", d.gpu.sizes.filter((c) => c <= T).map((c) => d.gpu.seconds[d.gpu.sizes.indexOf(c)]), GREEN]);
  el("text", { x: 420, y: 16 }, svg, "each curve ÷ its own minimum (log scale); the bottom of a U is the best C");
  const Y = scale(1, 64, 300, 30, true);
  for (const v of [1, 2, 4, 8, 16, 32, 64]) { el("line", { x1: 400, x2: 930, y1: Y(v), y2: Y(v), stroke: "#eee" }, svg); el("text", { x: 372, y: Y(v) + 4 }, svg, `${v}×`); }
  d.sizes.forEach((c) => el("text", { x: X(c) - 6, y: 318 }, svg, String(c)));
  series.forEach(([name, ys, color], k) => {
    const lo = Math.min(...ys);
    polyline(svg, ys.map((y, j) => [X(d.sizes[j]), Y(Math.min(64, y / lo))]), { stroke: color, "stroke-width": 2 });
    ys.forEach((y, j) => el("circle", { cx: X(d.sizes[j]), cy: Y(Math.min(64, y / lo)), r: j === i ? 5 : 3, fill: color }, svg));
    el("text", { x: 780, y: 40 + k * 16, style: `fill:${color}` }, svg, name);
  });
  el("line", { x1: X(d.at.C), x2: X(d.at.C), y1: 30, y2: 300, stroke: "#333", "stroke-dasharray": "2 3" }, svg);
  return d;
}
async function dialMeasure() {
  let d = await chunkDial();
  if (d.cpu) return;
  if (d.progress.status !== "running") await get("/api/chunk-dial/measure", { method: "POST" });
  while (true) {
    const p = await get("/api/chunk-dial/progress");
    $("dial-progress").max = p.total; $("dial-progress").value = p.done;
    $("dial-status").textContent = `measuring the chunked op on this machine: ${p.done} / ${p.total} chunk sizes`;
    if (p.status !== "running") break;
    await new Promise((r) => setTimeout(r, 300));
  }
  await chunkDial();
}

// 7 · fade curve --------------------------------------------------------------------------------------------------
const FACT_COLORS = { mochi: BLUE, junk: RED, tax: GREEN };
async function fadeCurve() {
  const slam = +$("fade-slam").value;
  $("fade-slam-val").textContent = num(slam);
  const d = await get(`/api/fade-curve?slam=${slam}`);
  for (const f of ["mochi", "junk", "tax"]) $(`fade-${f}`).textContent = num(d.survival[f][d.query]);
  $("fade-example-gates").textContent = Object.values(d.example.gates).map(num).join(" · ");
  $("fade-example").textContent = num(d.example.survival);
  const svg = $("fade-svg"); clear(svg);
  const X = scale(0, d.tokens - 1, 50, 930, false), Y = scale(0, 1, 270, 20, false);
  for (const v of [0, 0.5, 1]) { el("line", { x1: 50, x2: 930, y1: Y(v), y2: Y(v), stroke: "#eee" }, svg); el("text", { x: 14, y: Y(v) + 4 }, svg, num(v)); }
  el("line", { x1: X(d.switch), x2: X(d.switch), y1: 20, y2: 270, stroke: "#333", "stroke-dasharray": "3 3" }, svg);
  el("text", { x: X(d.switch) + 4, y: 34 }, svg, "switch: the gate slams");
  el("text", { x: X(d.query) - 40, y: 34 }, svg, "query");
  el("text", { x: 50, y: 292 }, svg, "token 0 … 24; survival = read · value / |value|²");
  Object.entries(d.survival).forEach(([f, ys], k) => {
    const pts = ys.map((y, t) => [t, y]).filter((p) => p[1] !== null).map(([t, y]) => [X(t), Y(y)]);
    polyline(svg, pts, { stroke: FACT_COLORS[f], "stroke-width": 2 });
    el("text", { x: 800, y: 60 + k * 16, style: `fill:${FACT_COLORS[f]}` }, svg, f === "tax" ? "tax form" : f);
  });
}

// 8 · twin boards -------------------------------------------------------------------------------------------------
function twinDraw(d, t) {
  const svg = $("twin-svg"); clear(svg);
  $("twin-t").textContent = t;
  const sides = [["scalar", "one knob (scalar gate)"], ["per_channel", "four knobs (per channel, KDA)"]];
  sides.forEach(([key, label], k) => {
    const s = d[key];
    board(svg, s.boards[t], 20 + k * 480, 40, 40, `${label}, after token ${t}`, { max: 3 });
    const gate = Array.isArray(s.gates[t]) ? s.gates[t] : [s.gates[t]];
    el("text", { x: 200 + k * 480, y: 60 }, svg, `gate now: ${vec(gate)}`);
    el("text", { x: 200 + k * 480, y: 80 }, svg, `Mochi ${pct(s.survival.mochi[t])} · junk ${pct(s.survival.junk[t])}`);
  });
  const sc = d.scalar, pc = d.per_channel;
  $("twin-scalar-mochi").textContent = pct(sc.survival.mochi[t]);
  $("twin-scalar-junk").textContent = pct(sc.survival.junk[t]);
  $("twin-channel-mochi").textContent = pct(pc.survival.mochi[t]);
  $("twin-channel-junk").textContent = pct(pc.survival.junk[t]);
  $("twin-scalar-read").textContent = vec(sc.reads.mochi[t]);
  $("twin-channel-read").textContent = vec(pc.reads.mochi[t]);
}
async function twinRun() {
  const d = await get("/api/twin-boards");
  for (let t = 0; t < d.scalar.tokens; t++) { twinDraw(d, t); await new Promise((r) => setTimeout(r, 60)); }
}

// 9 · parameter accountant ----------------------------------------------------------------------------------------
async function params(view) {
  document.querySelectorAll("#fig-param-accountant button").forEach((b) => b.classList.toggle("on", b.dataset.view === view));
  const d = await get(`/api/params?view=${view}`);
  $("params-headline").textContent = d.headline;
  $("params-notes").textContent = `experts ${(100 * d.experts_share).toFixed(1)} % of stored parameters · ` +
    `${comma(d.ratio_total)}× GPT-2 small stored (the lesson's 2.8T / 124M = ${comma(d.ratio_lesson)}×), ${comma(d.ratio_active)}× active · ` +
    `MLA caches ${d.mla_numbers_per_token} numbers / token / layer vs ${comma(d.mha_numbers_per_token)} for 128-head MHA (${num(d.mla_saving)}×) · ` +
    `${d.moe.routed} routed + ${d.moe.shared} shared experts, top-${d.moe.top_k}`;
  const svg = $("params-svg"); clear(svg);
  d.bars.forEach((b, i) => {
    el("text", { x: 10, y: 26 + i * 32 }, svg, b.kind.replace("_", " "));
    el("rect", { x: 160, y: 12 + i * 32, width: Math.max(1, 640 * b.share), height: 20, fill: b.kind === "experts" ? ORANGE : BLUE }, svg);
    el("text", { x: 170 + Math.max(1, 640 * b.share), y: 26 + i * 32, id: `params-bar-${b.kind}` }, svg, `${b.text} (${(100 * b.share).toFixed(1)} %)`);
  });
}

// 10 · layer map --------------------------------------------------------------------------------------------------
async function layerMap() {
  const d = await get("/api/layers");
  const svg = $("layers-svg"); clear(svg);
  const max = Math.max(...d.layers.map((l) => l.params)), w = 920 / d.layers.length;
  d.layers.forEach((l, i) => {
    const h = 190 * l.params / max, ha = 190 * l.active / max;
    const r = el("rect", { id: `layer-${l.layer}`, x: 20 + i * w, y: 220 - h, width: w - 1, height: h, fill: l.mixer === "mla" ? ORANGE : BLUE,
      stroke: l.ffn !== "moe" ? GREEN : "none", "stroke-width": 2 }, svg);
    el("rect", { x: 20 + i * w, y: 220 - ha, width: w - 1, height: ha, fill: "#1d2330", "pointer-events": "none" }, svg);
    if (l.snapshot) el("text", { x: 20 + i * w + w / 2 - 5, y: 240 }, svg, "▲");
    r.addEventListener("mouseenter", () => {
      $("layer-detail").textContent = `layer ${l.layer}: ${l.mixer.toUpperCase()} mixer + ${l.ffn === "moe" ? "latent MoE" : "dense " + l.ffn} FFN · ` +
        `${l.params_text} stored, ${fmtCount(l.active)} active per token · cache ${l.cache_bytes_per_token ? comma(l.cache_bytes_per_token) + " B per token" : "fixed state of " + comma(l.fixed_state_numbers) + " numbers"}` +
        (l.snapshot ? " · AttnRes snapshot" : "");
    });
  });
  el("text", { x: 20, y: 16 }, svg, `${d.layers.length} layers: ${Object.entries(d.counts).map(([k, v]) => `${v} ${k.toUpperCase()}`).join(", ")} (pattern ${d.pattern}, final ${d.final_mixer}); dense FFN in layer ${d.dense_ffn_layers.join(", ")} (green outline); snapshots after layers ${d.snapshots.join(", ")}`);
  el("text", { x: 20, y: 256, style: `fill:${BLUE}` }, svg, "■ KDA");
  el("text", { x: 80, y: 256, style: `fill:${ORANGE}` }, svg, "■ MLA");
  el("text", { x: 140, y: 256 }, svg, `■ active per token (dark) · tallest bar ${fmtCount(max)} parameters`);
}

// 11 · depth lens -------------------------------------------------------------------------------------------------
let lensData = null, lensPlain = false;
function lensDraw() {
  const d = lensData, a = d.attn_res, S = a.sources.length;
  const weights = lensPlain ? a.sources.map(() => 1 / S) : a.final_mean;
  $("lens-mode").textContent = lensPlain ? "plain residual (every snapshot added with weight 1: equal shares)" : "AttnRes (learned softmax over the snapshots)";
  $("lens-toggle").textContent = lensPlain ? "show AttnRes" : "show plain residual";
  $("lens-weights").textContent = vec(weights);
  const rms = lensPlain ? d.plain.layer_rms.map((r) => r.rms) : a.read_rms.map((r) => r.rms);
  $("lens-rms").textContent = vec(rms);
  const tr = d.training;
  $("lens-notes").textContent = `trained by ${d.command}: ${tr.attn_res.steps} steps, val loss ${num(tr.attn_res.val_loss)} (AttnRes) / ${num(tr.plain.val_loss)} (plain), unigram ${num(tr.attn_res.unigram_loss)} nats/char`;
  const svg = $("lens-svg"); clear(svg);
  el("text", { x: 10, y: 16 }, svg, "final read: share of each depth snapshot (mean over the passage)");
  const hw = 180 / Math.max(0.25, ...a.final_mean);
  weights.forEach((w, i) => {
    el("rect", { x: 10 + i * 48, y: 230 - hw * w, width: 40, height: hw * w, fill: lensPlain ? GREY : BLUE }, svg);
    el("text", { x: 10 + i * 48, y: 246, style: "font-size:10px" }, svg, a.sources[i].replace("layer ", "L").replace("embedding", "emb"));
    el("text", { x: 12 + i * 48, y: 226 - hw * w }, svg, num(w));
  });
  const n = d.plain.layer_rms.length;
  const curves = [[a.read_rms.map((r) => [r.read === "final" ? n + 0.5 : +r.read.split(" ")[1] - (r.read.endsWith("mixer") ? 0.5 : 0), r.rms]), !lensPlain, BLUE],
    [d.plain.layer_rms.map((r) => [r.layer, r.rms]), lensPlain, GREY]];
  const top = Math.max(...curves.flatMap((c) => c[0].map((p) => p[1]))) * 1.1;
  const X = scale(0, n + 0.5, 540, 930, false), Y = scale(0, top, 230, 30, false);
  el("text", { x: 520, y: 16 }, svg, "hidden-state RMS by depth");
  el("text", { x: 760, y: 280, style: `fill:${BLUE}` }, svg, "AttnRes: each sublayer's input");
  el("text", { x: 760, y: 296, style: `fill:${GREY}` }, svg, "plain: h after each layer");
  for (const v of [0, top / 2, top]) el("text", { x: 500, y: Y(v) + 4 }, svg, num(v));
  for (let l = 1; l <= n; l++) el("text", { x: X(l) - 3, y: 246, style: "font-size:10px" }, svg, String(l));
  curves.forEach(([pts, on, color]) => {
    polyline(svg, pts.map(([x, y]) => [X(x), Y(y)]), { stroke: color, "stroke-width": on ? 3 : 1.5, "stroke-dasharray": on ? "" : "4 3" });
    pts.forEach(([x, y]) => el("circle", { cx: X(x), cy: Y(y), r: on ? 3 : 2, fill: color }, svg));
  });
  el("text", { x: 540, y: 262 }, svg, "layer (shallow → deep)");
  el("text", { x: 10, y: 280, style: "font-size:11px" }, svg, `passage: ${JSON.stringify(d.text).slice(0, 120)}`);
}
async function depthLens() { lensData = await get("/api/depth-lens"); lensDraw(); }

// wiring ----------------------------------------------------------------------------------------------------------
function guard(p) { p.catch((e) => { console.error(e); document.body.dataset.error = String(e); }); }
window.addEventListener("DOMContentLoaded", () => {
  $("toc").innerHTML = [...document.querySelectorAll("section")].map((s) => `<a href="#${s.id}">${s.dataset.title}</a>`).join("");
  guard(conceptMap());
  guard(memoryWall(1000));
  $("wall-slider").addEventListener("input", (e) => { if (wallGrid) guard(memoryWall(wallGrid[+e.target.value])); });
  document.querySelectorAll("#fig-memory-wall button").forEach((b) => b.addEventListener("click", () => guard(memoryWall(+b.dataset.context))));
  guard(historyFold(1));
  $("fold-step").addEventListener("input", (e) => guard(historyFold(+e.target.value)));
  guard(whiteboard());
  $("wb-write-cat").addEventListener("click", () => { wbWrites.push("cat"); guard(whiteboard()); });
  $("wb-write-dog").addEventListener("click", () => { wbWrites.push("dog"); guard(whiteboard()); });
  $("wb-clear").addEventListener("click", () => { wbWrites = []; guard(whiteboard()); });
  $("wb-read").addEventListener("change", () => guard(whiteboard()));
  guard(deltaStamp());
  $("ds-next").addEventListener("click", () => { dsStep = Math.min(3, dsStep + 1); guard(deltaStamp()); });
  $("ds-prev").addEventListener("click", () => { dsStep = Math.max(0, dsStep - 1); guard(deltaStamp()); });
  $("ds-beta").addEventListener("input", () => guard(deltaStamp()));
  guard(dialMeasure());
  $("dial-C").addEventListener("input", () => guard(chunkDial()));
  guard(fadeCurve());
  $("fade-slam").addEventListener("input", () => guard(fadeCurve()));
  guard(get("/api/twin-boards").then((d) => twinDraw(d, 0)));
  $("twin-run").addEventListener("click", () => guard(twinRun()));
  guard(params("stored"));
  document.querySelectorAll("#fig-param-accountant button").forEach((b) => b.addEventListener("click", () => guard(params(b.dataset.view))));
  guard(layerMap());
  guard(depthLens());
  $("lens-toggle").addEventListener("click", () => { lensPlain = !lensPlain; lensDraw(); });
});

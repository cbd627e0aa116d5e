// Section 05: storage and work of the full-P path against the one-LSE-per-row path, storage
// against the length (P grows as L², the LSE as L), the memory-traffic model of three
// schedules, and the tile classes (flashledger.accounting). Pictures are drawn at 1:1
// scale for the width they have, so their text stays readable on a phone.
//
// The section books the sizes of its own fields. A line above them says whether they are the
// problem section 04 steps through, and a button books that problem (sizes, tiles and its
// exact mask, as a grid when no plain kind gives the same), so the two never silently differ.

import { latest } from "./api.js";
import * as backward from "./backward.js";
import { count, fill, h, s } from "./fmt.js";
import { t, tNodes } from "./i18n.js";
import { get, set, subscribe } from "./state.js";
import {
  alignText,
  bindInput,
  computeSection,
  keepToOptions,
  parseIntField,
  resultShown,
  staleNote,
  widthOf,
} from "./widgets.js";

const KEYS = ["slq", "slk", "sd", "sdv", "sbq", "sbk", "smask", "swl", "swr", "scm", "sdt"];
const INTS = { lq: "slq", lk: "slk", d: "sd", block_q: "sbq", block_k: "sbk" };
let section;
let data = null;
let shownBody = null; // the request `data` answers
let visible = false;
const sequence = latest();

export function init(ctx) {
  section = document.getElementById("sec-storage");
  keepToOptions(document.getElementById("f-s-mask"), "smask");
  keepToOptions(document.getElementById("f-s-dtype"), "sdt");
  const ids = { slq: "f-s-lq", slk: "f-s-lk", sd: "f-s-d", sdv: "f-s-dv", sbq: "f-s-bq", sbk: "f-s-bk", swl: "f-s-wl", swr: "f-s-wr" };
  const bindings = Object.entries(ids).map(([key, id]) => bindInput(document.getElementById(id), key));
  bindings.push(bindInput(document.getElementById("f-s-mask"), "smask", { event: "change" }));
  bindings.push(bindInput(document.getElementById("f-s-dtype"), "sdt", { event: "change" }));
  document.getElementById("storage-take").addEventListener("click", bookSection04);
  subscribe((changes) => {
    if (KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync(changes);
      compute();
    }
  });
  ctx.bus.addEventListener("backward", () => visible && renderSource());
  for (const id of ["storage-plot", "storage-traffic"]) {
    new ResizeObserver(() => visible && data && renderPictures()).observe(document.getElementById(id));
  }
  compute();
}

export function shown(sec) {
  visible = sec === "storage";
  if (visible) renderSource();
  if (visible && data) renderPictures();
}

// ------------------------------------------------------------------------ masks as grids

function gridText(dense) {
  return dense.map((row) => row.map((x) => (x ? "1" : "0")).join("")).join(";");
}

function gridOf(text) {
  return text ? text.split(";").map((row) => [...row].map((c) => c === "1")) : [];
}

/** Visibility (lq, lk) of a storage mask body as the ledger reads it (its windows align top-left). */
function denseOf(mask, lq, lk) {
  if (mask.kind === "custom") return mask.dense;
  return Array.from({ length: lq }, (_r, i) =>
    Array.from({ length: lk }, (_c, j) => {
      if (mask.kind === "causal_top_left") return j <= i;
      if (mask.kind === "causal_bottom_right") return j <= i + lk - lq;
      if (mask.kind === "sliding_window") return (mask.left < 0 || j >= i - mask.left) && (mask.right < 0 || j <= i + mask.right);
      return true;
    }),
  );
}

const sameGrid = (a, b) => a.length === b.length && a.every((row, i) => row.length === b[i].length && row.every((x, j) => x === b[i][j]));

// ------------------------------------------------------------------------ section 04's problem

/** The storage fields (state keys) that book section 04's problem `p` exactly. */
function fieldsFor(p) {
  const changes = { slq: String(p.lq), slk: String(p.lk), sd: String(p.d), sdv: p.dv === p.d ? "" : String(p.dv), sbq: String(p.bq), sbk: String(p.bk), scm: "" };
  const spec = p.maskSpec;
  let plain = null;
  if (spec.kind === "none") plain = { smask: "none" };
  else if (spec.kind === "causal") plain = { smask: p.align === "bottom_right" ? "causal_bottom_right" : "causal_top_left" };
  else if (spec.kind === "causal_top_left" || spec.kind === "causal_bottom_right") plain = { smask: spec.kind };
  else if (spec.kind === "sliding_window") plain = { smask: "sliding_window", swl: String(spec.left), swr: String(spec.right) };
  const body = plain && { kind: plain.smask, left: spec.left, right: spec.right };
  if (plain && sameGrid(denseOf(body, p.lq, p.lk), p.dense)) return { ...changes, ...plain };
  return { ...changes, smask: "custom", scm: gridText(p.dense) };
}

function bookSection04() {
  const p = backward.problem();
  if (p) set(fieldsFor(p));
}

/** True when the result shown books section 04's problem `p` (sizes, tiles, the same grid). */
function books(p) {
  const b = shownBody;
  if (!b || !p) return false;
  const same = b.lq === p.lq && b.lk === p.lk && b.d === p.d && (b.d_v ?? b.d) === p.dv && b.block_q === p.bq && b.block_k === p.bk;
  return same && sameGrid(denseOf(b.mask, b.lq, b.lk), p.dense);
}

/** Section 04's problem in one line: sizes, tiles, mask. */
function describe(p) {
  const sizes = p.lq === p.lk ? `L = ${p.lq}` : `Lq = ${p.lq}, Lk = ${p.lk}`;
  const dims = p.dv === p.d ? `d = ${p.d}` : `d = ${p.d}, d_v = ${p.dv}`;
  const spec = p.maskSpec;
  let mask = document.querySelector(`#f-mask option[value="${CSS.escape(spec.kind)}"]`)?.textContent ?? spec.kind;
  if (spec.kind === "causal") mask = `${t("s7.maskCausal")}, ${alignText(p.align)}`;
  if (spec.kind === "custom") mask = t("s4.maskCustomShort");
  if (spec.kind === "sliding_window") mask += ` (${spec.left}, ${spec.right})`;
  return [sizes, dims, t("s5.tilesOf", { bq: p.bq, bk: p.bk }), mask].join(" \u00b7 ");
}

/** The line above the fields: whose sizes the figures book, and a button to book section 04's. */
function renderSource() {
  const line = document.getElementById("storage-source");
  const take = document.getElementById("storage-take");
  const p = backward.problem();
  if (!p) {
    fill(line, t("s5.booksOwn"));
    take.hidden = true;
    return;
  }
  const same = books(p);
  fill(line, t(same ? "s5.booksSame" : "s5.booksOther", { what: describe(p) }));
  line.classList.toggle("differs", !same);
  take.hidden = same;
}

// ------------------------------------------------------------------------ compute

/** The request for `read(key)` (the fields' state, or the defaults): {body} or {field, error}. */
function request(read) {
  const body = {};
  for (const [field, key] of Object.entries(INTS)) {
    body[field] = parseIntField(read(key));
    if (body[field] === null) return { field, error: ["err.integer", {}] };
  }
  const dv = String(read("sdv") ?? "").trim();
  if (dv) {
    body.d_v = parseIntField(dv);
    if (body.d_v === null) return { field: "d_v", error: ["err.integer", {}] };
  }
  const kind = read("smask");
  body.mask = { kind };
  if (kind === "sliding_window") {
    body.mask.left = parseIntField(read("swl"));
    body.mask.right = parseIntField(read("swr"));
    if (body.mask.left === null || body.mask.right === null) return { field: "mask", error: ["err.integer", {}] };
  } else if (kind === "custom") {
    body.mask.dense = gridOf(read("scm"));
  }
  body.dtype = read("sdt");
  return { body };
}

async function compute() {
  for (const el of section.querySelectorAll(".s-window-only")) el.hidden = get("smask") !== "sliding_window";
  document.getElementById("f-s-mask-custom").hidden = get("smask") !== "custom";
  return computeSection({
    section,
    request,
    path: "/api/storage",
    sequence,
    errorBox: document.getElementById("storage-error"),
    shown: () => data !== null,
    accept,
  });
}

function accept(result, body, isDefault) {
  resultShown(section, { fallback: isDefault });
  data = result;
  shownBody = body;
  render();
}

export function render() {
  const ids = ["storage-summary", "storage-table", "storage-traffic", "storage-grid"];
  if (!data) {
    for (const id of ids) fill(document.getElementById(id));
    return;
  }
  const L = data.ledger;
  const c = L.config;
  const figure = (name, value) => h("span", { "data-figure": name }, count(value));
  const summary = tNodes("s5.summary", {
    lq: figure("lq", c.lq),
    lk: figure("lk", c.lk),
    full: figure("full", L.full_p_elements),
    lse: figure("lse", L.lse_elements),
    bq: figure("bq", c.block_q),
    bk: figure("bk", c.block_k),
    cap: figure("cap", L.temp_block_capacity),
    fwd: figure("fwd", L.qk_dots_forward),
    bwd: figure("bwd", L.qk_dots_backward),
  });
  // the figures are the shown result's (L.config); while inputs are refused the note says so
  fill(document.getElementById("storage-summary"), staleNote(), summary);
  renderSource();
  renderTable(L);
  renderPictures();
  renderGrid();
}

function renderPictures() {
  renderPlot();
  renderTraffic();
}

function sup(n) {
  const digits = "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079";
  return String(n)
    .split("")
    .map((c) => digits[Number(c)])
    .join("");
}

/** Elements kept against L on log-log axes: P (L², slope 2), the LSE (L), Q/K/V/O (4Ld). */
function renderPlot() {
  const holder = document.getElementById("storage-plot");
  const W = Math.max(280, widthOf(holder, 540));
  const legendH = 3 * 16 + 6; // the series' legend above the axes, clear of the lines and L's marker
  const H = 240 + legendH;
  const left = 46;
  const right = 12;
  const top = 12 + legendH;
  const bottom = 40;
  const pts = data.sweep;
  const c = data.ledger.config;
  const xs = pts.map((p) => p.length);
  const ys = pts.flatMap((p) => [p.full_p, p.lse, p.common]);
  const lx0 = Math.log10(Math.min(...xs));
  const lx1 = Math.log10(Math.max(...xs));
  const ly1 = Math.ceil(Math.log10(Math.max(...ys)));
  const X = (v) => left + ((Math.log10(v) - lx0) / (lx1 - lx0 || 1)) * (W - left - right);
  const Y = (v) => top + (1 - Math.log10(Math.max(v, 1)) / (ly1 || 1)) * (H - top - bottom);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "storage-plot", role: "img", "aria-label": t("s5.plotTitle") });
  for (let e = 0; e <= ly1; e += ly1 > 8 ? 3 : 1) {
    svg.append(s("line", { x1: left, x2: W - right, y1: Y(10 ** e), y2: Y(10 ** e), class: "grid-line" }), s("text", { x: left - 6, y: Y(10 ** e) + 4, "text-anchor": "end", class: "value" }, e === 0 ? "1" : `10${sup(e)}`));
  }
  for (const v of [1, 16, 256, 4096, 65536].filter((v) => v >= Math.min(...xs) && v <= Math.max(...xs))) {
    svg.append(s("line", { x1: X(v), x2: X(v), y1: top, y2: H - bottom, class: "grid-line" }), s("text", { x: X(v), y: H - bottom + 15, "text-anchor": X(v) > W - right - 24 ? "end" : "middle", class: "value" }, String(v)));
  }
  svg.append(s("text", { x: (left + W - right) / 2, y: H - 6, "text-anchor": "middle", class: "label" }, t("s5.plotX")));
  const series = [
    ["full_p", "series-p", t("s5.plotP")],
    ["common", "series-common", t(c.d_v === c.d ? "s5.plotCommon" : "s5.plotCommonDv")],
    ["lse", "series-lse", t("s5.plotLse")],
  ];
  series.forEach(([key, cls, name], n) => {
    const d = pts.map((p, i) => `${i ? "L" : "M"}${X(p.length).toFixed(1)} ${Y(p[key]).toFixed(1)}`).join("");
    const g = s("g", { class: `series ${cls}`, "data-series": key });
    g.append(s("path", { d }));
    for (const p of pts) {
      g.append(s("circle", { cx: X(p.length), cy: Y(p[key]), r: 2.6, "data-length": p.length, "data-value": p[key] }, s("title", {}, `L = ${p.length}: ${p[key]}`)));
    }
    const lx = left + 8;
    const ly = 16 + n * 16;
    g.append(s("line", { x1: lx, x2: lx + 16, y1: ly - 4, y2: ly - 4 }), s("text", { x: lx + 22, y: ly, class: "label" }, name));
    svg.append(g);
  });
  const here = pts.find((p) => p.length === data.ledger.config.lq);
  if (here) {
    svg.append(
      s("line", { x1: X(here.length), x2: X(here.length), y1: top, y2: H - bottom, class: "here-line" }),
      s("text", { x: Math.min(X(here.length) + 4, W - right - 60), y: H - bottom - 6, class: "value here-text" }, `L = ${here.length}`),
    );
  }
  fill(holder, svg);
}

function renderTable(L) {
  const dash = () => h("span", { class: "muted" }, t("s5.notNeeded"));
  const none = () => h("span", { class: "muted", title: t("s5.notApplicable") }, "\u2014");
  const sum = (obj) => Object.values(obj).reduce((a, b) => a + b, 0);
  const rows = [
    ["common", "Q, K, V, O", count(sum(L.common_elements)), count(sum(L.common_elements))],
    ["saved", t("s5.saved"), count(L.full_p_elements), count(L.lse_elements)],
    ["saved-bytes", t("s5.savedBytes"), count(L.bytes.full_p), count(L.bytes.lse)],
    ["temp", t("s5.temp"), dash(), count(L.temp_block_capacity)],
    ["dots-forward", t("s5.dotsFwd"), count(L.qk_dots_forward), count(L.qk_dots_forward)],
    ["dots-backward", t("s5.dotsBwd"), dash(), count(L.qk_dots_backward)],
    ["dots-computed", t("s5.dotsComputed"), none(), count(L.qk_dots_computed)],
    ["tiles", t("s5.tiles"), none(), h("span", {}, count(L.tiles_run), " / ", count(L.tiles_skipped))],
    ["gradients", "G, dQ, dK, dV", count(sum(L.gradient_elements)), count(sum(L.gradient_elements))],
  ];
  fill(
    document.getElementById("storage-table"),
    h("thead", {}, h("tr", {}, h("th", {}, t("s5.thItem")), h("th", { class: "num-col" }, t("s5.thFull")), h("th", { class: "num-col" }, t("s5.thLse")))),
    h(
      "tbody",
      {},
      rows.map(([id, label, full, lse]) => h("tr", { "data-row": id }, h("td", {}, label), h("td", { class: "num-col" }, full), h("td", { class: "num-col", "data-col": "lse" }, lse))),
    ),
  );
}

function humanBytes(x) {
  for (const [unit, size] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (x >= size) return `${(x / size).toPrecision(3)} ${unit}`;
  }
  return `${x} B`;
}

/** Horizontal bars: for each schedule and pass, bytes read (blue) then written (amber). */
function renderTraffic() {
  const schedules = [
    ["standard", t("s5.standard")],
    ["fa1", "FlashAttention-1"],
    ["fa2", "FlashAttention-2"],
  ];
  const rows = [];
  for (const [key, label] of schedules) {
    const tr = data.traffic[key];
    for (const pass of ["forward", "backward"]) {
      // bytes as the API books them: the statistics (m, ℓ, LSE, D) in float32 at least
      rows.push({ label: `${label} \u00b7 ${t(`s7.${pass}`)}`, read: tr[pass].bytes_read, write: tr[pass].bytes_written });
    }
  }
  const max = Math.max(...rows.map((r) => r.read + r.write), 1);
  const holder = document.getElementById("storage-traffic");
  const W = Math.max(280, widthOf(holder, 540));
  const stacked = W < 480; // narrow: each label on its own line above its bar
  const labelW = stacked ? 0 : 200;
  const rowH = stacked ? 40 : 26;
  const barW = W - labelW - 80;
  const svg = s("svg", { viewBox: `0 0 ${W} ${rows.length * rowH + 30}`, width: W, height: rows.length * rowH + 30, role: "img" });
  rows.forEach((r, i) => {
    const y = i * rowH + 4 + (stacked ? 16 : 0);
    const wr = (barW * r.read) / max;
    const ww = (barW * r.write) / max;
    svg.append(
      s("text", { x: 0, y: stacked ? y - 4 : y + 14, class: "label" }, r.label),
      s("rect", { x: labelW, y, width: wr, height: 17, class: "bar-read" }, s("title", {}, `${t("s5.read")}: ${r.read} B`)),
      s("rect", { x: labelW + wr, y, width: ww, height: 17, class: "bar-write" }, s("title", {}, `${t("s5.written")}: ${r.write} B`)),
      s("text", { x: labelW + wr + ww + 6, y: y + 13, class: "value" }, humanBytes(r.read + r.write)),
    );
  });
  const ly = rows.length * rowH + 20;
  svg.append(
    s("rect", { x: labelW, y: ly - 10, width: 12, height: 12, class: "bar-read" }),
    s("text", { x: labelW + 18, y: ly, class: "value" }, t("s5.read")),
    s("rect", { x: labelW + 90, y: ly - 10, width: 12, height: 12, class: "bar-write" }),
    s("text", { x: labelW + 108, y: ly, class: "value" }, t("s5.written")),
  );
  fill(document.getElementById("storage-traffic"), svg);
}

function renderGrid() {
  const el = document.getElementById("storage-grid");
  if (!data.tile_kinds) return fill(el, h("p", { class: "muted small" }, t("s5.gridBig")));
  const cols = data.tile_kinds[0].length;
  const size = Math.max(6, Math.min(28, Math.floor(300 / Math.max(cols, data.tile_kinds.length))));
  const grid = h("div", { class: "tile-grid", style: `grid-template-columns: repeat(${cols}, ${size}px)` });
  data.tile_kinds.forEach((row, i) => row.forEach((kind, j) => grid.append(h("span", { class: kind, title: `(${i}, ${j}) ${t(`s5.${kind}`)}` }))));
  const legend = h(
    "div",
    { class: "legend" },
    ["full", "partial", "empty"].map((kind) => h("span", { class: "legend-item" }, h("span", { class: `swatch tile-grid-${kind}` }), t(`s5.${kind}`))),
  );
  fill(el, grid, legend);
}

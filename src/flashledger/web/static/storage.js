// Section 05: storage and work of the full-P path against the one-LSE-per-row path, the
// memory-traffic model of three schedules, and the tile classes (flashledger.accounting).

import { latest, post } from "./api.js";
import { count, fill, h, s } from "./fmt.js";
import { t, tNodes } from "./i18n.js";
import { get, subscribe } from "./state.js";
import { bindInput, clearErrors, parseIntField, showErrors, showFieldError } from "./widgets.js";

const KEYS = ["slq", "slk", "sd", "sbq", "sbk", "smask", "swl", "swr", "sdt"];
const INTS = { lq: "slq", lk: "slk", d: "sd", block_q: "sbq", block_k: "sbk" };
let section;
let data = null;
const sequence = latest();

export function init() {
  section = document.getElementById("sec-storage");
  const ids = { slq: "f-s-lq", slk: "f-s-lk", sd: "f-s-d", sbq: "f-s-bq", sbk: "f-s-bk", swl: "f-s-wl", swr: "f-s-wr" };
  const bindings = Object.entries(ids).map(([key, id]) => bindInput(document.getElementById(id), key));
  bindings.push(bindInput(document.getElementById("f-s-mask"), "smask", { event: "change" }));
  bindings.push(bindInput(document.getElementById("f-s-dtype"), "sdt", { event: "change" }));
  subscribe((changes) => {
    if (KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync();
      compute();
    }
  });
  compute();
}

export function shown() {}

async function compute() {
  for (const el of section.querySelectorAll(".s-window-only")) el.hidden = get("smask") !== "sliding_window";
  const body = {};
  for (const [field, key] of Object.entries(INTS)) {
    body[field] = parseIntField(get(key));
    if (body[field] === null) return showFieldError(section, field, t("err.integer"));
  }
  body.mask = { kind: get("smask") };
  if (get("smask") === "sliding_window") {
    body.mask.left = parseIntField(get("swl"));
    body.mask.right = parseIntField(get("swr"));
    if (body.mask.left === null || body.mask.right === null) return showFieldError(section, "mask", t("err.integer"));
  }
  body.dtype = get("sdt");
  const answer = await sequence(post("/api/storage", body));
  if (answer === null) return;
  if (!answer.ok) {
    return showErrors(section, document.getElementById("storage-error"), answer);
  }
  clearErrors(section);
  data = answer.data;
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
  fill(document.getElementById("storage-summary"), summary);
  renderTable(L);
  renderTraffic();
  renderGrid();
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
    ["standard", "standard"],
    ["fa1", "FlashAttention-1"],
    ["fa2", "FlashAttention-2"],
  ];
  const rows = [];
  for (const [key, label] of schedules) {
    const tr = data.traffic[key];
    const b = tr.bytes_per_element;
    for (const pass of ["forward", "backward"]) {
      rows.push({ label: `${label} \u00b7 ${pass}`, read: tr[pass].elements_read * b, write: tr[pass].elements_written * b });
    }
  }
  const max = Math.max(...rows.map((r) => r.read + r.write), 1);
  const W = 540;
  const labelW = 200;
  const rowH = 26;
  const barW = W - labelW - 90;
  const svg = s("svg", { viewBox: `0 0 ${W} ${rows.length * rowH + 30}`, width: "100%", role: "img" });
  rows.forEach((r, i) => {
    const y = i * rowH + 4;
    const wr = (barW * r.read) / max;
    const ww = (barW * r.write) / max;
    svg.append(
      s("text", { x: 0, y: y + 14, class: "label" }, r.label),
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

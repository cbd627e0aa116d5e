// Section 04: the blocked backward, tile by tile (flashledger.blocked_backward with a trace).
// The server runs the loop once and returns every tile; the page steps through them and
// adds up each tile's contribution to dQ, dK, dV in loop order.

import { latest, post } from "./api.js";
import { fill, h, maxAbsDiff, num, parseMatrix, s, vec } from "./fmt.js";
import { t } from "./i18n.js";
import { get, getDefault, set, subscribe } from "./state.js";
import { bindInput, clearErrors, parseIntField, readout, showErrors, showFieldError, stepper } from "./widgets.js";

const INPUT_KEYS = ["q", "k", "v", "g", "bq", "bk", "mask", "wl", "wr", "cm", "conv", "p", "seed", "cap", "alibi", "slope"];
const MATRIX_KEYS = ["q", "k", "v", "g"];
let section;
let data = null;
let bus;
let stepCtl;
let bindings = [];
const sequence = latest();

export function init(ctx) {
  bus = ctx.bus;
  section = document.getElementById("sec-backward");
  const conv = document.getElementById("f-conv");
  for (const preset of ctx.examples.presets) {
    conv.append(h("option", { value: preset.name, title: preset.description }, preset.name));
  }
  bindings = [
    ...MATRIX_KEYS.map((key) => bindInput(document.getElementById(`f-${key}`), key, { delay: 500 })),
    bindInput(document.getElementById("f-bq"), "bq"),
    bindInput(document.getElementById("f-bk"), "bk"),
    bindInput(document.getElementById("f-wl"), "wl"),
    bindInput(document.getElementById("f-wr"), "wr"),
    bindInput(conv, "conv", { event: "change" }),
    bindInput(document.getElementById("f-p"), "p"),
    bindInput(document.getElementById("f-seed"), "seed"),
    bindInput(document.getElementById("f-cap"), "cap"),
    bindInput(document.getElementById("f-alibi"), "alibi"),
    bindInput(document.getElementById("f-slope"), "slope"),
  ];
  const maskSelect = document.getElementById("f-mask");
  maskSelect.value = get("mask");
  maskSelect.addEventListener("change", () => chooseMask(maskSelect.value));
  document.getElementById("bw-reset").addEventListener("click", () => {
    const changes = {};
    for (const key of [...INPUT_KEYS, "bstep"]) changes[key] = getDefault(key);
    set(changes);
  });
  stepCtl = stepper(
    document.getElementById("bw-stepper"),
    "bstep",
    () => (data ? data.steps.length : 0),
    (step, total) => `${t("s4.progress")}: ${step} / ${total}`,
  );
  subscribe((changes) => {
    if (INPUT_KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync();
      maskSelect.value = get("mask");
      compute();
    } else if ("bstep" in changes) {
      render();
    }
  });
  render();
  compute();
}

export function shown() {}

/** The data of the last successful run and the current step (for section 03). */
export function snapshot() {
  return data ? { data, step: stepCtl.current(), stepper: stepCtl } : null;
}

function causalDense(lq, lk, bottomRight) {
  const offset = bottomRight ? lk - lq : 0;
  return Array.from({ length: lq }, (_r, i) => Array.from({ length: lk }, (_c, j) => j <= i + offset));
}

function denseText(dense) {
  return dense.map((row) => row.map((x) => (x ? "1" : "0")).join("")).join(";");
}

function shapes() {
  const q = parseMatrix(get("q"));
  const k = parseMatrix(get("k"));
  return { lq: q.rows ? q.rows.length : 0, lk: k.rows ? k.rows.length : 0 };
}

/** Apply the mask select: the fully-masked-row preset becomes a custom grid. */
function chooseMask(kind) {
  const { lq, lk } = shapes();
  if (kind === "masked_row") {
    const dense = causalDense(lq, lk, false);
    const row = Math.min(2, lq - 1);
    dense[row] = dense[row].map(() => false);
    set({ mask: "custom", cm: denseText(dense), bstep: "0" });
  } else if (kind === "custom") {
    const current = data ? data.mask : causalDense(lq, lk, false);
    set({ mask: "custom", cm: denseText(current), bstep: "0" });
  } else {
    set({ mask: kind, bstep: "0" });
  }
}

/** The custom grid from state, resized to (lq, lk): new cells attend. */
function customDense(lq, lk) {
  const rows = get("cm") ? get("cm").split(";") : [];
  return Array.from({ length: lq }, (_r, i) =>
    Array.from({ length: lk }, (_c, j) => (rows[i] && j < rows[i].length ? rows[i][j] === "1" : true)),
  );
}

function maskSpec(lq, lk) {
  const kind = get("mask");
  if (kind === "custom") return { kind, dense: customDense(lq, lk) };
  if (kind === "sliding_window") {
    return { kind, left: parseIntField(get("wl")), right: parseIntField(get("wr")) };
  }
  return { kind };
}

/** A client-side input error: open the inputs so that the message next to the field shows. */
function inputError(field, message) {
  document.getElementById("bw-inputs").open = true;
  showFieldError(section, field, message);
}

async function compute() {
  document.getElementById("mask-grid-wrap").hidden = get("mask") !== "custom";
  for (const el of section.querySelectorAll(".window-only")) el.hidden = get("mask") !== "sliding_window";
  const body = {};
  for (const key of MATRIX_KEYS) {
    const parsed = parseMatrix(get(key));
    if (parsed.error) {
      const [msg, vars] = parsed.error;
      return inputError(key, t(msg, vars));
    }
    body[key] = parsed.rows;
  }
  const ints = { block_q: "bq", block_k: "bk", seed: "seed" };
  for (const [field, key] of Object.entries(ints)) {
    body[field] = parseIntField(get(key));
    if (body[field] === null) return inputError(field, t("err.integer"));
  }
  body.mask = maskSpec(body.q.length, body.k.length);
  if (get("mask") === "sliding_window" && (body.mask.left === null || body.mask.right === null)) {
    return inputError(body.mask.left === null ? "left" : "right", t("err.integer"));
  }
  body.conventions = get("conv");
  body.dropout_p = Number(get("p") || "0");
  body.softcap = get("cap").trim() === "" ? null : Number(get("cap"));
  body.alibi = get("alibi") === "1";
  body.alibi_slope = Number(get("slope") || "0");
  const answer = await sequence(post("/api/backward", body));
  if (answer === null) return;
  if (!answer.ok) {
    document.getElementById("bw-inputs").open = true;
    return showErrors(section, document.getElementById("bw-error"), answer);
  }
  clearErrors(section);
  data = answer.data;
  if (stepCtl.current() > data.steps.length) set({ bstep: String(data.steps.length) });
  render();
}

/** dQ, dK, dV after the first `step` tiles, summed in loop order from the tiles' contributions. */
function accumulated(step) {
  const zeros = (rows) => rows.map((row) => row.map(() => 0));
  const acc = { dq: zeros(data.grads.dq), dk: zeros(data.grads.dk), dv: zeros(data.grads.dv) };
  for (const st of data.steps.slice(0, step)) {
    const targets = [
      ["dq", st.q_range[0], st.dq],
      ["dk", st.k_range[0], st.dk],
      ["dv", st.k_range[0], st.dv],
    ];
    for (const [name, start, contrib] of targets) {
      contrib.forEach((row, r) => {
        row.forEach((x, c) => {
          acc[name][start + r][c] += x;
        });
      });
    }
  }
  return acc;
}

/** One line under the inputs' summary: mask, tiles, conventions and the score options. */
function renderConfig() {
  const select = document.getElementById("f-mask");
  const parts = [select.options[select.selectedIndex]?.textContent ?? get("mask"), `${get("bq")}\u00d7${get("bk")}`, get("conv")];
  if (Number(get("p")) > 0) parts.push(`dropout ${get("p")}`);
  if (get("cap").trim()) parts.push(`softcap ${get("cap")}`);
  if (get("alibi") === "1") parts.push(`ALiBi ${get("slope")}`);
  document.getElementById("bw-config").textContent = parts.join(" \u00b7 ");
}

export function render() {
  stepCtl.render();
  renderMaskGrid();
  renderConfig();
  const ids = ["bw-readouts", "bw-heat", "bw-legend", "bw-step", "bw-stats", "bw-grads"];
  if (!data) {
    for (const id of ids) fill(document.getElementById(id));
    bus.dispatchEvent(new Event("backward"));
    return;
  }
  const step = stepCtl.current();
  const current = step > 0 ? data.steps[step - 1] : null;
  const total = data.steps.length;
  const ag = data.autograd;
  fill(
    document.getElementById("bw-readouts"),
    readout("bw-progress", "s4.progress", h("span", { class: "num" }, `${step} / ${total}`)),
    readout("fwd-diff", "s4.fwdDiff", num(data.forward_max_diff), data.forward_max_diff <= data.tolerance ? "good" : "bad"),
    readout("grad-diff", "s4.gradDiff", num(data.grad_max_diff), data.grad_max_diff <= data.tolerance ? "good" : "bad"),
    readout(
      "autograd",
      "s4.autograd",
      h(
        "span",
        { class: `badge ${ag.ok ? "ok" : "fail"}`, title: t("s4.autogradBody", { diff: ag.max_diff }) },
        `${ag.ok ? "\u2713" : "\u2717"} ${t(ag.ok ? "common.ok" : "common.fail")} `,
        num(ag.max_diff),
      ),
      "wide",
    ),
    readout("tiles", "s5.tiles", h("span", { class: "num" }, t("s4.tiles", { run: data.counters.tiles_run, skipped: data.counters.tiles_skipped }))),
  );
  fill(document.getElementById("bw-heat"), heatmap(step, current));
  fill(document.getElementById("bw-legend"), legend());
  renderStep(step, current);
  renderStats(current);
  renderGrads(step, current);
  bus.dispatchEvent(new Event("backward"));
}

function renderMaskGrid() {
  const wrap = document.getElementById("mask-grid");
  if (get("mask") !== "custom") return fill(wrap);
  const { lq, lk } = shapes();
  if (!lq || !lk) return fill(wrap);
  const dense = customDense(lq, lk);
  const grid = h("div", { class: "mask-grid", style: `grid-template-columns: repeat(${lk}, 22px)` });
  dense.forEach((row, i) =>
    row.forEach((on, j) => {
      grid.append(
        h("button", {
          type: "button",
          class: on ? "on" : "",
          title: `q${i} \u00d7 k${j}`,
          "data-cell": `${i},${j}`,
          onclick: () => {
            dense[i][j] = !dense[i][j];
            set({ cm: denseText(dense), bstep: "0" });
          },
        }),
      );
    }),
  );
  fill(wrap, grid);
}

const HEAT_SIZE = 320;

function heatColor(p) {
  const light = 97 - 66 * Math.pow(Math.min(Math.max(p, 0), 1), 0.6);
  return `hsl(174 55% ${light.toFixed(1)}%)`;
}

/** SVG heat map of the P rebuilt in the first `step` tiles, with the tile grid. */
function heatmap(step, current) {
  const { lq, lk } = data;
  const cell = Math.max(6, Math.min(56, Math.floor(HEAT_SIZE / Math.max(lq, lk))));
  const pad = cell >= 14 ? 22 : 4;
  const width = pad + lk * cell + 2;
  const height = pad + lq * cell + 2;
  const rebuilt = Array.from({ length: lq }, () => new Array(lk).fill(null));
  for (const st of data.steps.slice(0, step)) {
    st.p.forEach((row, r) => row.forEach((x, c) => (rebuilt[st.q_range[0] + r][st.k_range[0] + c] = x)));
  }
  const svg = s("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "heat", role: "img" });
  svg.append(
    s(
      "defs",
      {},
      s(
        "pattern",
        { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" },
        s("rect", { width: 6, height: 6, fill: "#f3f4f6" }),
        s("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#cbd5e1", "stroke-width": 2 }),
      ),
    ),
  );
  const showText = cell >= 36;
  for (let i = 0; i < lq; i++) {
    for (let j = 0; j < lk; j++) {
      const x = pad + j * cell;
      const y = pad + i * cell;
      const visible = data.mask[i][j];
      const value = rebuilt[i][j];
      let fillColor = "#fbfbfa";
      let title = `P[${i},${j}]: ${t("s4.legendPending")}`;
      if (!visible) {
        fillColor = "url(#hatch)";
        title = `P[${i},${j}]: ${t("s4.legendMasked")}`;
      } else if (value !== null) {
        fillColor = heatColor(value);
        title = `P[${i},${j}] = ${value}`;
      }
      const g = s("g", { "data-cell": `${i},${j}` }, s("rect", { x, y, width: cell, height: cell, fill: fillColor, stroke: "#e5e7eb", "stroke-width": 0.5 }), s("title", {}, title));
      if (!visible && cell >= 12) {
        g.append(s("text", { x: x + cell / 2, y: y + cell / 2 + 4, "text-anchor": "middle", class: "heat-x" }, "\u00d7"));
      } else if (value !== null && showText) {
        g.append(s("text", { x: x + cell / 2, y: y + cell / 2 + 4, "text-anchor": "middle", class: value > 0.45 ? "heat-num dark" : "heat-num" }, value.toFixed(2)));
      }
      if (data.keep && visible && !data.keep[i][j] && value !== null) {
        g.append(s("circle", { cx: x + cell - 5, cy: y + 5, r: 2.5, class: "heat-drop" }));
      }
      svg.append(g);
    }
  }
  data.q_tiles.forEach(([a, b], ti) => {
    data.k_tiles.forEach(([c, d], tj) => {
      const kind = data.tile_kinds[ti][tj];
      svg.append(
        s("rect", {
          x: pad + c * cell,
          y: pad + a * cell,
          width: (d - c) * cell,
          height: (b - a) * cell,
          class: kind === "empty" ? "tile skipped" : "tile",
          "data-tile": `${ti},${tj}`,
        }),
      );
    });
  });
  if (current) {
    const [a, b] = current.q_range;
    const [c, d] = current.k_range;
    svg.append(s("rect", { x: pad + c * cell, y: pad + a * cell, width: (d - c) * cell, height: (b - a) * cell, class: "tile current" }));
  }
  if (pad > 4) {
    for (let j = 0; j < lk; j++) svg.append(s("text", { x: pad + j * cell + cell / 2, y: 14, "text-anchor": "middle", class: "axis" }, `k${j}`));
    for (let i = 0; i < lq; i++) svg.append(s("text", { x: pad - 4, y: pad + i * cell + cell / 2 + 4, "text-anchor": "end", class: "axis" }, `q${i}`));
  }
  return svg;
}

function legend() {
  const item = (cls, key) => h("span", { class: "legend-item" }, h("span", { class: `swatch ${cls}` }), t(key));
  return [
    item("sw-p", "s4.heat"),
    item("sw-pending", "s4.legendPending"),
    item("sw-masked", "s4.legendMasked"),
    item("sw-current", "s4.legendCurrent"),
    data.keep ? item("sw-drop", "s4.legendDropped") : null,
  ];
}

const STEP_WINDOW = 12;

function rangeText(lo, hi, prefix) {
  return hi - lo === 1 ? `${prefix}${lo}` : `${prefix}${lo}\u2013${prefix}${hi - 1}`;
}

function renderStep(step, current) {
  const el = document.getElementById("bw-step");
  const parts = [];
  if (!current) {
    parts.push(h("p", { class: "muted" }, t("s4.noStep")));
  } else {
    const [a, b] = current.q_range;
    const [c, d] = current.k_range;
    parts.push(
      h(
        "table",
        { class: "data compact" },
        h("thead", {}, h("tr", {}, ["s4.thTile", "s4.thQueries", "s4.thKeys", "s4.thKind"].map((key) => h("th", {}, t(key))))),
        h(
          "tbody",
          {},
          h(
            "tr",
            {},
            h("td", {}, `(${current.q_tile}, ${current.k_tile})`),
            h("td", {}, rangeText(a, b, "q")),
            h("td", {}, rangeText(c, d, "k")),
            h("td", {}, t(current.kind === "full" ? "s4.kindFull" : "s4.kindPartial")),
          ),
        ),
      ),
      h(
        "table",
        { class: "data compact", id: "bw-prows" },
        h("thead", {}, h("tr", {}, h("th", {}, t("s4.thRow")), h("th", {}, "P = exp(S \u2212 LSE)"), h("th", {}, "\u2202S"))),
        h(
          "tbody",
          {},
          current.p.map((row, r) => h("tr", {}, h("td", {}, `q${a + r}`), h("td", {}, vec(row)), h("td", {}, vec(current.ds[r])))),
        ),
      ),
    );
  }
  const total = data.steps.length;
  const lo = Math.max(0, Math.min(step - STEP_WINDOW / 2, total - STEP_WINDOW));
  const hi = Math.min(total, lo + STEP_WINDOW);
  const body = h("tbody");
  for (let n = lo; n < hi; n++) {
    const st = data.steps[n];
    const read = n < step;
    body.append(
      h(
        "tr",
        { class: n === step - 1 ? "current" : read ? "" : "future", "data-step": n + 1 },
        h("td", {}, String(n + 1)),
        h("td", {}, `(${st.q_tile}, ${st.k_tile})`),
        h("td", {}, rangeText(st.q_range[0], st.q_range[1], "q")),
        h("td", {}, rangeText(st.k_range[0], st.k_range[1], "k")),
        h(
          "td",
          {},
          read
            ? st.p.map((row, r) => h("div", {}, h("span", { class: "muted small" }, `q${st.q_range[0] + r} `), vec(row)))
            : h("span", { class: "muted" }, t("s4.legendPending")),
        ),
      ),
    );
  }
  parts.push(
    h("h4", { class: "steps-title" }, t("s4.stepsTitle", { lo: lo + 1, hi, total })),
    h(
      "table",
      { class: "data compact", id: "bw-steps" },
      h("thead", {}, h("tr", {}, ["s4.thStep", "s4.thTile", "s4.thQueries", "s4.thKeys", "s4.thP"].map((key) => h("th", {}, t(key))))),
      body,
    ),
  );
  fill(el, parts);
}

function renderStats(current) {
  const masked = new Set(data.fully_masked_rows);
  const body = h("tbody");
  data.lse.forEach((lse, i) => {
    const active = current && i >= current.q_range[0] && i < current.q_range[1];
    body.append(
      h(
        "tr",
        { class: active ? "current" : "", "data-row": i },
        h("td", {}, String(i), masked.has(i) ? h("span", { class: "tag" }, t("s4.fullyMasked")) : null),
        h("td", { class: "num-col", "data-col": "lse" }, num(lse)),
        h("td", { "data-col": "o" }, vec(data.o[i])),
        h("td", { class: "num-col", "data-col": "D" }, num(data.D[i])),
      ),
    );
  });
  fill(
    document.getElementById("bw-stats"),
    h("thead", {}, h("tr", {}, ["s4.thRow", "s4.thLse", "s4.thO", "s4.thD"].map((key, i) => h("th", { class: i % 2 ? "num-col" : "" }, t(key))))),
    body,
  );
}

function renderGrads(step, current) {
  const acc = accumulated(step);
  const body = h("tbody");
  const names = { dq: "dQ", dk: "dK", dv: "dV" };
  for (const name of ["dq", "dk", "dv"]) {
    const range = current ? (name === "dq" ? current.q_range : current.k_range) : [0, 0];
    acc[name].forEach((row, i) => {
      const touched = i >= range[0] && i < range[1];
      const done = maxAbsDiff(row, data.reference[name][i]) < 1e-12;
      body.append(
        h(
          "tr",
          { class: touched ? "current" : "", "data-grad": `${name}${i}` },
          h("td", {}, `${names[name]}[${i}]`),
          h("td", { class: done ? "" : "muted-num" }, vec(row)),
          h("td", {}, vec(data.reference[name][i])),
        ),
      );
    });
  }
  fill(
    document.getElementById("bw-grads"),
    h("thead", {}, h("tr", {}, ["s4.thObject", "s4.thAcc", "s4.thRef"].map((key) => h("th", {}, t(key))))),
    body,
  );
}


// Section 03: the four stages, a diagram of what is on chip at the backward step of
// section 04, and run times of the blocked loop measured on this machine.

import { latest, post } from "./api.js";
import { count, fill, h, num, s } from "./fmt.js";
import { t } from "./i18n.js";
import * as backward from "./backward.js";
import { get, subscribe } from "./state.js";
import { bindInput, clearErrors, parseIntField, showErrors, showFieldError, stepper } from "./widgets.js";

const MEASURE_KEYS = ["ml", "md", "mb", "mdt", "mc"];
let section;
let stepCtl;
let measured = null;
let measuredFor = null;
let visible = false;
const sequence = latest();

export function init(ctx) {
  section = document.getElementById("sec-gpu");
  stepCtl = stepper(
    document.getElementById("gpu-stepper"),
    "bstep",
    () => backward.snapshot()?.data.steps.length ?? 0,
    (step, total) => `${t("s4.progress")}: ${step} / ${total}`,
  );
  const bindings = [
    bindInput(document.getElementById("f-m-length"), "ml"),
    bindInput(document.getElementById("f-m-d"), "md"),
    bindInput(document.getElementById("f-m-block"), "mb"),
    bindInput(document.getElementById("f-m-dtype"), "mdt", { event: "change" }),
    bindInput(document.getElementById("f-m-causal"), "mc"),
  ];
  document.getElementById("measure-run").addEventListener("click", () => measure(true));
  ctx.bus.addEventListener("backward", renderDiagram);
  renderDiagram();
  subscribe((changes) => {
    if (MEASURE_KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync();
      if (visible) measure(false);
    }
  });
}

export function shown(sec) {
  visible = sec === "gpu";
  if (visible) measure(false);
}

function measureBody() {
  return {
    length: parseIntField(get("ml")),
    d: parseIntField(get("md")),
    block: parseIntField(get("mb")),
    dtype: get("mdt"),
    causal: get("mc") === "1",
  };
}

/** Time the blocked loop on the server; `again` repeats a measurement of the same shape. */
async function measure(again) {
  const body = measureBody();
  for (const field of ["length", "d", "block"]) {
    if (body[field] === null) return showFieldError(section, field, t("err.integer"));
  }
  const key = JSON.stringify(body);
  if (!again && key === measuredFor) return;
  measuredFor = key;
  fill(document.getElementById("measure-device"), t("common.computing"));
  const answer = await sequence(post("/api/measure", body));
  if (answer === null) return;
  if (!answer.ok) {
    return showErrors(section, document.getElementById("measure-error"), answer);
  }
  clearErrors(section);
  measured = answer.data;
  renderMeasure();
}

export function render() {
  renderDiagram();
  renderMeasure();
}

function renderMeasure() {
  const table = document.getElementById("measure-table");
  const device = document.getElementById("measure-device");
  fill(document.getElementById("measure-sub"), t("s3.measuredSub", { repeats: measured?.repeats ?? 3 }));
  if (!measured) {
    fill(table);
    return;
  }
  const m = measured;
  const rows = [
    ["s3.blockedFwd", m.times_ms.blocked_forward],
    ["s3.blockedBwd", m.times_ms.blocked_backward],
    ["s3.refFwd", m.times_ms.reference_forward],
    ["s3.refBwd", m.times_ms.reference_backward],
  ];
  fill(
    table,
    h("thead", {}, h("tr", {}, h("th", {}, t("s3.thWhat")), h("th", { class: "num-col" }, t("s3.thMs")))),
    h(
      "tbody",
      {},
      rows.map(([key, ms]) => h("tr", {}, h("td", {}, t(key)), h("td", { class: "num-col" }, num(ms)))),
      h("tr", {}, h("td", {}, t("s3.fwdDiff")), h("td", { class: "num-col" }, num(m.forward_max_diff))),
      h("tr", {}, h("td", {}, t("s3.gradDiff")), h("td", { class: "num-col" }, num(m.grad_max_diff))),
      h("tr", {}, h("td", {}, t("s3.pBytes")), h("td", { class: "num-col" }, count(m.full_p_bytes))),
      h("tr", {}, h("td", {}, t("s3.lseBytes")), h("td", { class: "num-col" }, count(m.lse_bytes))),
    ),
  );
  device.textContent = t("s3.device", { device: m.device, threads: m.threads, version: m.torch_version });
}

// ------------------------------------------------------------------------ diagram

const W = 1080;
const H = 292;
const HBM_Y = 34;
const BAR_H = 120;
const SRAM_Y = 214;

function renderDiagram() {
  stepCtl.render();
  const snap = backward.snapshot();
  const holder = document.getElementById("gpu-diagram");
  const title = document.getElementById("gpu-diagram-title");
  if (!snap) {
    fill(title);
    fill(holder);
    return;
  }
  const { data, step } = snap;
  const current = step > 0 ? data.steps[step - 1] : null;
  title.textContent = current ? t("s3.diagramTitle", { step, total: data.steps.length }) : t("s3.diagramIdle");
  fill(holder, diagram(data, current));
}

function diagram(data, current) {
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", class: "chip-diagram", role: "img" });
  svg.append(s("rect", { x: 8, y: 8, width: W - 16, height: 176, rx: 10, class: "panel hbm" }));
  svg.append(s("text", { x: 22, y: 28, class: "panel-label" }, t("s3.hbm")));
  svg.append(s("rect", { x: 8, y: SRAM_Y - 20, width: W - 16, height: H - SRAM_Y + 12, rx: 10, class: "panel sram" }));
  svg.append(s("text", { x: 22, y: SRAM_Y - 2, class: "panel-label" }, t("s3.sram")));

  const qi = current ? current.q_tile : -1;
  const kj = current ? current.k_tile : -1;
  // tensors in HBM, in the order of the on-chip boxes below: [label, tiles, highlighted tile, role]
  const tensors = [
    ["K", data.k_tiles, kj, "keep"],
    ["V", data.k_tiles, kj, "keep"],
    ["dK", data.k_tiles, kj, "write"],
    ["dV", data.k_tiles, kj, "write"],
    ["Q", data.q_tiles, qi, "load"],
    ["G = dO", data.q_tiles, qi, "load"],
    ["LSE", data.q_tiles, qi, "load"],
    ["D", data.q_tiles, qi, "load"],
    ["O", data.q_tiles, -1, "idle"],
    ["dQ", data.q_tiles, qi, "write"],
  ];
  const colW = 70;
  const gap = (W - 60 - tensors.length * colW) / (tensors.length - 1);
  const anchors = {};
  tensors.forEach(([label, tiles, hi, role], n) => {
    const x = 30 + n * (colW + gap);
    const rows = tiles[tiles.length - 1][1];
    tiles.forEach(([a, b], ti) => {
      const y = HBM_Y + (BAR_H * a) / rows;
      const hgt = (BAR_H * (b - a)) / rows;
      const cls = ti === hi ? `tile-bar ${role}` : "tile-bar";
      svg.append(s("rect", { x, y, width: colW, height: hgt, class: cls }, s("title", {}, `${label} rows ${a}\u2013${b - 1}`)));
    });
    if (hi >= 0) anchors[label] = [x + colW / 2, HBM_Y + BAR_H + 22];
    svg.append(s("text", { x: x + colW / 2, y: HBM_Y + BAR_H + 16, "text-anchor": "middle", class: "tensor-label" }, label));
  });

  const chips = current
    ? [
        ["K", `K${sub(kj)}, V${sub(kj)}`, "keep", ["K", "V"]],
        ["dK", `dK${sub(kj)}, dV${sub(kj)} (+=)`, "keep", ["dK", "dV"]],
        ["Q", `Q${sub(qi)}, G${sub(qi)}, LSE${sub(qi)}, D${sub(qi)}`, "load", ["Q", "G = dO", "LSE", "D"]],
        ["P", `S, P, dP, dS  (${current.q_range[1] - current.q_range[0]}\u00d7${current.k_range[1] - current.k_range[0]})`, "temp", []],
        ["dQ", `dQ${sub(qi)} += dS K`, "write", ["dQ"]],
      ]
    : [];
  const chipW = (W - 60 - 4 * 16) / 5;
  chips.forEach(([, label, role, sources], n) => {
    const x = 30 + n * (chipW + 16);
    const y = SRAM_Y + 10;
    for (const src of sources) {
      const anchor = anchors[src];
      if (anchor) svg.append(s("line", { x1: anchor[0], y1: anchor[1], x2: x + chipW / 2, y2: y, class: `wire ${role}` }));
    }
    svg.append(s("rect", { x, y, width: chipW, height: 56, rx: 6, class: `chip ${role}` }));
    svg.append(s("text", { x: x + chipW / 2, y: y + 33, "text-anchor": "middle", class: "chip-label" }, label));
  });
  const legend = [
    ["load", "s3.legendLoad"],
    ["keep", "s3.legendKeep"],
    ["write", "s3.legendWrite"],
  ];
  legend.forEach(([role, key], n) => {
    const x = W - 640 + n * 210;
    svg.append(s("rect", { x, y: 18, width: 12, height: 12, class: `tile-bar ${role}` }));
    svg.append(s("text", { x: x + 18, y: 28, class: "legend-text" }, t(key)));
  });
  return svg;
}

function sub(n) {
  const digits = "\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089";
  return String(n)
    .split("")
    .map((c) => digits[Number(c)])
    .join("");
}

// Section 03: the four stages, a picture of what is on chip at the current tile of section
// 04 (forward or backward pass), and run times of the blocked loop measured on this machine.
// The picture is drawn at 1:1 scale for the width it has (two rows of tensors on a phone);
// stepping one tile forward shows the tiles moving from HBM into on-chip memory and the
// accumulators going back.

import { latest, post } from "./api.js";
import { count, fill, h, num, s } from "./fmt.js";
import { PHASE } from "./formula.js";
import { t } from "./i18n.js";
import * as backward from "./backward.js";
import { get, getDefault, subscribe } from "./state.js";
import {
  animate,
  bindInput,
  keepToOptions,
  parseIntField,
  registerStepper,
  resultShown,
  showErrors,
  showFieldError,
  staleNote,
  stepper,
  widthOf,
} from "./widgets.js";

const MEASURE_KEYS = ["ml", "md", "mb", "mdt", "mc"];
let section;
let bwCtl;
let fwCtl;
let measured = null;
let measuredBody = null; // the shape `measured` timed (the line above the table states it)
let measuredFor = null;
let visible = false;
let drawn = { mode: null, step: -1, data: null, width: 0 };
const sequence = latest();

export function init(ctx) {
  section = document.getElementById("sec-gpu");
  const holder = document.getElementById("gpu-stepper");
  const bwBox = h("div", { class: "stepper", "data-pass": "backward" });
  const fwBox = h("div", { class: "stepper", "data-pass": "forward" });
  holder.replaceWith(h("div", { id: "gpu-stepper" }, bwBox, fwBox));
  bwCtl = stepper(bwBox, "bstep", () => backward.snapshot()?.data.steps.length ?? 0, (step, total) => `${t("s4.progress")}: ${step} / ${total}`);
  fwCtl = stepper(fwBox, "fstep", () => backward.snapshot()?.data.forward_steps.length ?? 0, (step, total) => `${t("s4.fwdProgress")}: ${step} / ${total}`);
  registerStepper("gpu", () => (backward.mode() === "forward" ? fwCtl : bwCtl));
  keepToOptions(document.getElementById("f-m-dtype"), "mdt");
  const bindings = [
    bindInput(document.getElementById("f-m-length"), "ml"),
    bindInput(document.getElementById("f-m-d"), "md"),
    bindInput(document.getElementById("f-m-block"), "mb"),
    bindInput(document.getElementById("f-m-dtype"), "mdt", { event: "change" }),
    bindInput(document.getElementById("f-m-causal"), "mc"),
  ];
  const limits = ctx.examples.limits;
  document.getElementById("f-m-length").max = String(limits.max_measure_len);
  document.getElementById("f-m-d").max = String(limits.max_measure_dim);
  document.getElementById("measure-run").addEventListener("click", () => measure(true));
  ctx.bus.addEventListener("backward", () => visible && renderDiagram());
  new ResizeObserver(() => visible && renderDiagram()).observe(document.getElementById("gpu-diagram"));
  subscribe((changes) => {
    if (MEASURE_KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync(changes);
      if (visible) measure(false);
    }
  });
}

export function shown(sec) {
  visible = sec === "gpu";
  if (visible) {
    drawn = { mode: null, step: -1, data: null, width: 0 };
    renderDiagram();
    measure(false);
  }
}

function measureBody(read) {
  return {
    length: parseIntField(read("ml")),
    d: parseIntField(read("md")),
    block: parseIntField(read("mb")),
    dtype: read("mdt"),
    causal: read("mc") === "1",
  };
}

/** Time the blocked loop on the server; `again` repeats a measurement of the same shape. */
async function measure(again) {
  const body = measureBody(get);
  const missing = ["length", "d", "block"].find((field) => body[field] === null);
  if (missing) {
    showFieldError(section, missing, "err.integer");
    return fallback();
  }
  const key = JSON.stringify(body);
  if (!again && key === measuredFor) return;
  measuredFor = key;
  fill(document.getElementById("measure-device"), t("common.computing"));
  const answer = await sequence(post("/api/measure", body));
  if (answer === null) return;
  if (!answer.ok) {
    measuredFor = null;
    showErrors(section, document.getElementById("measure-error"), answer);
    renderMeasure(); // the device line of the timings still shown, not "computing…"
    return fallback();
  }
  accept(answer.data, body, false);
}

/** Inputs refused before anything was measured: time the default shape, errors kept. */
async function fallback() {
  if (measured) return;
  const body = measureBody(getDefault);
  fill(document.getElementById("measure-device"), t("common.computing"));
  const answer = await sequence(post("/api/measure", body));
  if (answer?.ok) accept(answer.data, body, true);
}

function accept(result, body, isDefault) {
  resultShown(section, { fallback: isDefault });
  measured = result;
  measuredBody = body;
  renderMeasure();
}

export function render() {
  drawn = { mode: null, step: -1, data: null, width: 0 };
  if (visible) renderDiagram();
  renderMeasure();
}

function renderMeasure() {
  const table = document.getElementById("measure-table");
  const device = document.getElementById("measure-device");
  fill(document.getElementById("measure-sub"), t("s3.measuredSub", { repeats: measured?.repeats ?? 9 }));
  const config = document.getElementById("measure-config");
  if (!measured) {
    fill(table);
    fill(config);
    return;
  }
  const b = measuredBody;
  fill(config, staleNote(), [`L = ${b.length}`, `d = ${b.d}`, t("common.tileN", { n: b.block }), b.dtype, b.causal ? t("s3.causal") : t("s3.noMask")].join(" \u00b7 "));
  const m = measured;
  const rows = [
    ["blocked_forward", "s3.blockedFwd"],
    ["blocked_backward", "s3.blockedBwd"],
    ["reference_forward", "s3.refFwd"],
    ["reference_backward", "s3.refBwd"],
  ];
  const wide = (key, value) => h("tr", {}, h("td", {}, t(key)), h("td", { class: "num-col", colspan: 4 }, value));
  fill(
    table,
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        h("th", {}, t("s3.thWhat")),
        ["s3.thMs", "s3.thMin", "s3.thMax", "s3.thRuns"].map((key) => h("th", { class: "num-col" }, t(key))),
      ),
    ),
    h(
      "tbody",
      {},
      rows.map(([name, key]) =>
        h(
          "tr",
          { "data-run": name },
          h("td", {}, t(key)),
          h("td", { class: "num-col", "data-col": "median" }, num(m.times_ms[name])),
          h("td", { class: "num-col muted-num", "data-col": "min" }, num(m.min_ms[name])),
          h("td", { class: "num-col muted-num", "data-col": "max" }, num(m.max_ms[name])),
          h("td", { class: "num-col", "data-col": "runs" }, String(m.runs[name])),
        ),
      ),
      wide("s3.fwdDiff", num(m.forward_max_diff)),
      wide("s3.gradDiff", num(m.grad_max_diff)),
      wide("s3.pBytes", count(m.full_p_bytes)),
      wide("s3.lseBytes", count(m.lse_bytes)),
    ),
  );
  device.textContent = t("s3.device", { device: m.device, threads: m.threads, version: m.torch_version });
}

// ------------------------------------------------------------------------ diagram

function sub(n) {
  const digits = "\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089";
  return String(n)
    .split("")
    .map((c) => digits[Number(c)])
    .join("");
}

/** What the pass keeps where at step `current`: tensors in HBM and boxes on chip. */
function plan(data, mode, current) {
  const qi = current ? current.q_tile : -1;
  const kj = current ? current.k_tile : -1;
  if (mode === "forward") {
    const list = current ? data.forward_steps.filter((st) => st.q_tile === qi) : [];
    const lastOfRow = current && list[list.length - 1] === current;
    return {
      tensors: [
        ["Q", data.q_tiles, qi, "keep"],
        ["K", data.k_tiles, kj, "load"],
        ["V", data.k_tiles, kj, "load"],
        ["O", data.q_tiles, lastOfRow ? qi : -1, "write"],
        ["LSE", data.q_tiles, lastOfRow ? qi : -1, "write"],
      ],
      chips: current
        ? [
            [`Q${sub(qi)}`, "keep", ["Q"]],
            [`K${sub(kj)}, V${sub(kj)}`, "load", ["K", "V"]],
            [`S, P  (${current.q_range[1] - current.q_range[0]}\u00d7${current.k_range[1] - current.k_range[0]})`, "temp", []],
            [`m, \u2113, acc`, "keep", []],
            [lastOfRow ? `O${sub(qi)}, LSE${sub(qi)} \u2192 HBM` : t("s3.stillOnChip"), lastOfRow ? "write" : "idle", lastOfRow ? ["O", "LSE"] : []],
          ]
        : [],
    };
  }
  return {
    tensors: [
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
    ],
    chips: current
      ? [
          [`K${sub(kj)}, V${sub(kj)}`, "keep", ["K", "V"]],
          [`dK${sub(kj)}, dV${sub(kj)} (+=)`, "keep", ["dK", "dV"]],
          [`Q${sub(qi)}, G${sub(qi)}, LSE${sub(qi)}, D${sub(qi)}`, "load", ["Q", "G = dO", "LSE", "D"]],
          [`S, P, dP, dS  (${current.q_range[1] - current.q_range[0]}\u00d7${current.k_range[1] - current.k_range[0]})`, "temp", []],
          [`dQ${sub(qi)} += dS K`, "write", ["dQ"]],
        ]
      : [],
  };
}

function renderDiagram() {
  const snap = backward.snapshot();
  const holder = document.getElementById("gpu-diagram");
  const title = document.getElementById("gpu-diagram-title");
  const fwd = backward.mode() === "forward";
  for (const box of document.querySelectorAll("#gpu-stepper > .stepper")) box.hidden = box.dataset.pass !== (fwd ? "forward" : "backward");
  bwCtl.render();
  fwCtl.render();
  if (!snap) {
    fill(title);
    fill(holder);
    return;
  }
  const { data, step, mode } = snap;
  const steps = mode === "forward" ? data.forward_steps : data.steps;
  const current = step > 0 ? steps[step - 1] : null;
  title.textContent = current
    ? t(mode === "forward" ? "s3.diagramTitleFwd" : "s3.diagramTitle", { step, total: steps.length })
    : t(mode === "forward" ? "s3.diagramIdleFwd" : "s3.diagramIdle");
  const width = Math.max(300, widthOf(holder, 1080));
  const before = drawn;
  if (before.mode === mode && before.step === step && before.data === data && before.width === width) return;
  drawn = { mode, step, data, width };
  const moving = before.mode === mode && before.data === data && before.width === width && step === before.step + 1;
  fill(holder, diagram(plan(data, mode, current), width, moving));
}

/** About the width of a chip's label in px (13 px monospace: 7.8 a Latin character, a
 * full em a CJK one). */
function labelWidth(label) {
  let w = 0;
  for (const ch of label) w += ch.codePointAt(0) >= 0x2e80 ? 13 : 7.8;
  return w;
}

/** ``label`` in two lines, split at the space nearest its middle (at its middle without one). */
function splitLabel(label) {
  const mid = label.length / 2;
  let at = -1;
  for (let i = 0; i < label.length; i++) if (label[i] === " " && (at < 0 || Math.abs(i - mid) < Math.abs(at - mid))) at = i;
  if (at < 0) return [label.slice(0, Math.ceil(mid)), label.slice(Math.ceil(mid))];
  return [label.slice(0, at), label.slice(at + 1)];
}

function diagram({ tensors, chips }, W, moving) {
  const wide = W >= 760;
  const perRow = wide ? tensors.length : Math.ceil(tensors.length / 2);
  const tensorRows = Math.ceil(tensors.length / perRow);
  const barH = wide ? 120 : 72;
  const rowH = barH + 34;
  const hbmTop = 36;
  const hbmH = hbmTop + tensorRows * rowH + 4;
  const chipH = wide ? 56 : 38;
  const chipCols = wide ? 5 : 1;
  const chipRows = Math.ceil(Math.max(chips.length, 1) / chipCols);
  const sramTop = hbmH + 22;
  const sramH = 28 + chipRows * (chipH + 10) + 6;
  const legendH = wide ? 0 : 3 * 18 + 10; // narrow: the legend under the panels, one per line
  const H = sramTop + sramH + legendH;
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "chip-diagram", role: "img" });
  svg.append(s("rect", { x: 4, y: 4, width: W - 8, height: hbmH - 4, rx: 10, class: "panel hbm" }));
  svg.append(s("text", { x: 16, y: 24, class: "panel-label" }, t("s3.hbm")));
  svg.append(s("rect", { x: 4, y: sramTop, width: W - 8, height: sramH - 4, rx: 10, class: "panel sram" }));
  svg.append(s("text", { x: 16, y: sramTop + 19, class: "panel-label" }, t("s3.sram")));

  const legend = [
    ["load", "s3.legendLoad"],
    ["keep", "s3.legendKeep"],
    ["write", "s3.legendWrite"],
  ];
  legend.forEach(([role, key], n) => {
    // wide: along the top, right of the HBM label; narrow: under the on-chip panel
    const x = wide ? W - 600 + n * 200 : 16;
    const y = wide ? 14 : sramTop + sramH + 4 + n * 18;
    svg.append(s("rect", { x, y, width: 12, height: 12, class: `tile-bar ${role}` }), s("text", { x: x + 18, y: y + 10, class: "legend-text" }, t(key)));
  });

  const colW = Math.min(70, (W - 40 - (perRow - 1) * 10) / perRow);
  const gap = perRow > 1 ? (W - 40 - perRow * colW) / (perRow - 1) : 0;
  const anchors = {};
  const tiles = {};
  tensors.forEach(([label, list, hi, role], n) => {
    const x = 20 + (n % perRow) * (colW + gap);
    const top = hbmTop + Math.floor(n / perRow) * rowH;
    const rows = list[list.length - 1][1];
    list.forEach(([a, b], ti) => {
      const y = top + (barH * a) / rows;
      const hgt = (barH * (b - a)) / rows;
      const cls = ti === hi ? `tile-bar ${role}` : "tile-bar";
      const rect = s("rect", { x, y, width: colW, height: hgt, class: cls, "data-tensor": label, "data-tile": ti });
      rect.append(s("title", {}, t("s3.tileRows", { tensor: label, a, b: b - 1 })));
      if (ti === hi) tiles[label] = { x, y, w: colW, h: hgt };
      svg.append(rect);
    });
    if (hi >= 0) anchors[label] = [x + colW / 2, top + barH + 20];
    svg.append(s("text", { x: x + colW / 2, y: top + barH + 15, "text-anchor": "middle", class: "tensor-label" }, label));
  });

  const chipW = wide ? (W - 40 - 4 * 14) / 5 : W - 40;
  chips.forEach(([label, role, sources], n) => {
    const x = 20 + (n % chipCols) * (chipW + 14);
    const y = sramTop + 28 + Math.floor(n / chipCols) * (chipH + 10);
    if (wide) {
      for (const src of sources) {
        const anchor = anchors[src];
        if (anchor) svg.append(s("line", { x1: anchor[0], y1: anchor[1], x2: x + chipW / 2, y2: y, class: `wire ${role}` }));
      }
    }
    const g = s("g", { class: `chip-box ${role}`, "data-chip": n });
    // a label longer than the box holds goes on two lines (the box is tall enough on a
    // wide view, where the five boxes are narrow), split at the space nearest its middle
    const lines = wide && labelWidth(label) > chipW - 12 ? splitLabel(label) : [label];
    const text = s("text", { x: x + chipW / 2, y: y + chipH / 2 + 5 - (lines.length - 1) * 8, "text-anchor": "middle", class: "chip-label" });
    lines.forEach((line, i) => text.append(s("tspan", { x: x + chipW / 2, dy: i ? 16 : 0 }, line)));
    g.append(s("rect", { x, y, width: chipW, height: chipH, rx: 6, class: `chip ${role}` }), text);
    svg.append(g);
    // one tile forward: the tiles fly from HBM into on-chip memory, the results fly back
    const from = sources.map((src) => tiles[src]).find(Boolean);
    if (!moving || !from) return;
    if (role === "load" || role === "keep") {
      const dx = from.x - x;
      const dy = from.y - y;
      animate(g, [{ transform: `translate(${dx}px, ${dy}px) scale(${from.w / chipW}, ${Math.max(from.h, 4) / chipH})`, opacity: 0.6 }, { transform: "none", opacity: 1 }], {
        duration: 2 * PHASE,
      });
    } else if (role === "write") {
      const ghost = s("rect", { x, y, width: chipW, height: chipH, rx: 6, class: "chip write ghost" });
      svg.append(ghost);
      const a = animate(ghost, [{ transform: "none", opacity: 0.9 }, { transform: `translate(${from.x - x}px, ${from.y - y}px) scale(${from.w / chipW}, ${Math.max(from.h, 4) / chipH})`, opacity: 0 }], {
        duration: 2 * PHASE,
        delay: 2 * PHASE,
        fill: "both",
      });
      if (a) a.finished.then(() => ghost.remove()).catch(() => {});
      else ghost.remove();
    }
  });
  return svg;
}

// Section 04: the five-position example (or any Q/K/V/G) tile by tile, through the forward
// loop (flashledger.blocked_forward traced) and the backward loop (blocked_backward traced).
// The server runs both loops once and returns every tile; the page steps through them.
// Stepping changes the page in place: the heat map fills the new tile's cells, the gradient
// rows the tile touches are rewritten, and the accumulated dQ, dK, dV are summed in loop
// order from checkpoints, so that a 64 × 64 problem in 1 × 1 tiles steps as fast as the
// seed's 5 × 5. Hovering a cell, a tile's row or a gradient row lights what belongs to it.

import { latest } from "./api.js";
import { fill, h, maxAbsDiff, num, parseMatrix, s, vec } from "./fmt.js";
import { lightUp, PHASE } from "./formula.js";
import { HeatMap, tipNumber } from "./heatmap.js";
import { currentLanguage, t } from "./i18n.js";
import { get, getDefault, set, subscribe } from "./state.js";
import {
  animate,
  bindInput,
  computeSection,
  keepToOptions,
  normalizeStep,
  parseIntField,
  presetText,
  readout,
  registerStepper,
  resultShown,
  showFieldError,
  staleNote,
  stepper,
  typedField,
  widthOf,
} from "./widgets.js";

const INPUT_KEYS = ["q", "k", "v", "g", "bq", "bk", "mask", "wl", "wr", "cm", "conv", "p", "seed", "cap", "alibi", "slope"];
const MATRIX_KEYS = ["q", "k", "v", "g"];
const CHECKPOINT = 64;
const STEP_WINDOW = 12;
const NAMES = { dq: "dQ", dk: "dK", dv: "dV" };

let section;
let presets = [];
let data = null;
let dataInputs = null; // the settings `data` was computed with (the summary line states them)
let bus;
let bwCtl;
let fwCtl;
let bindings = [];
let lengthField;
let maxLen = 64;
let heat;
let heatFor = null;
let builtWidth = 0;
let painted = { mode: null, step: -1, lang: null };
let maskGridFor = null;
let checkpoints = [];
let gradRows = {};
let statRows = [];
let fwdIndex = null;
let linkedEls = [];
const sequence = latest();

export function init(ctx) {
  bus = ctx.bus;
  maxLen = ctx.examples.limits.max_trace_len;
  section = document.getElementById("sec-backward");
  presets = ctx.examples.presets;
  const conv = document.getElementById("f-conv");
  for (const preset of presets) {
    conv.append(h("option", { value: preset.name, title: presetText(preset) }, preset.name));
  }
  // a link may name a preset or mask the page does not offer, or the select's own
  // fully-masked-row preset, which is a custom grid: make the state one the page can send
  keepToOptions(conv, "conv");
  keepToOptions(document.getElementById("f-mask"), "mask");
  if (get("mask") === "masked_row") chooseMask("masked_row");
  keepGridReadable();
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
  const lengthInput = document.getElementById("f-len");
  lengthInput.max = String(maxLen);
  lengthField = typedField(lengthInput, resizeTo);
  syncLength();
  const maskSelect = document.getElementById("f-mask");
  maskSelect.value = get("mask");
  maskSelect.addEventListener("change", () => chooseMask(maskSelect.value));
  document.getElementById("bw-reset").addEventListener("click", () => {
    const changes = {};
    for (const key of [...INPUT_KEYS, "bstep", "fstep"]) changes[key] = getDefault(key);
    set(changes);
  });
  for (const btn of section.querySelectorAll("#bw-pass button")) {
    btn.addEventListener("click", () => set({ bpass: btn.dataset.pass }));
  }
  bwCtl = stepper(
    document.getElementById("bw-stepper"),
    "bstep",
    () => (data ? data.steps.length : 0),
    (step, total) => `${t("s4.progress")}: ${step} / ${total}`,
  );
  fwCtl = stepper(
    document.getElementById("fw-stepper"),
    "fstep",
    () => (data ? data.forward_steps.length : 0),
    (step, total) => `${t("s4.fwdProgress")}: ${step} / ${total}`,
  );
  registerStepper("backward", () => (mode() === "forward" ? fwCtl : bwCtl));
  heat = new HeatMap(document.getElementById("bw-heat"), { onHover: (target) => link(target) });
  subscribe((changes) => {
    if (INPUT_KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync(changes);
      maskSelect.value = get("mask");
      syncLength();
      compute();
    } else if ("bstep" in changes || "fstep" in changes || "bpass" in changes) {
      render();
    }
  });
  render();
  compute();
}

export function shown(sec) {
  if (sec !== "backward" || !data) return;
  if (heatWidth() !== builtWidth) {
    heatFor = null;
    render();
  }
}

function heatWidth() {
  return widthOf(section.querySelector(".bw-main"), 360);
}

/** "forward" or "backward": which loop the section steps through. */
export function mode() {
  return get("bpass") === "forward" ? "forward" : "backward";
}

/** The data of the last successful run, the pass and its current step (for section 03). */
export function snapshot() {
  if (!data) return null;
  const m = mode();
  return { data, mode: m, step: (m === "forward" ? fwCtl : bwCtl).current(), stepper: m === "forward" ? fwCtl : bwCtl };
}

// ------------------------------------------------------------------------ inputs

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

function syncLength() {
  if (lengthField.pending()) return;
  const { lq, lk } = shapes();
  const input = document.getElementById("f-len");
  input.value = lq ? String(lq) : "";
  input.title = lq !== lk ? t("s4.lengthDiffers", { lq, lk }) : "";
}

/** A made-up entry for a new row: in (−1, 1), two decimals, the same every time. */
function madeUp(row, col, salt) {
  const x = Math.sin((row + 1) * 12.9898 + (col + 1) * 78.233 + salt * 37.719) * 43758.5453;
  return Math.round((x - Math.floor(x)) * 200 - 100) / 100;
}

function resizeMatrix(text, length, salt, widthFallback) {
  const parsed = parseMatrix(text);
  const rows = parsed.rows ?? [];
  const width = rows.length ? rows[0].length : widthFallback;
  const out = rows.slice(0, length);
  for (let r = out.length; r < length; r++) out.push(Array.from({ length: width }, (_x, c) => madeUp(r, c, salt)));
  return out.map((row) => row.map((x) => String(x)).join(", ")).join("\n");
}

/** One length for Q, K, V and G: cut rows off or add made-up rows, blocks at most L. */
function resizeTo(text) {
  const length = parseIntField(text);
  if (length === null || length < 1 || length > maxLen) {
    return showFieldError(section, "length", "err.range", { min: 1, max: maxLen });
  }
  for (const key of MATRIX_KEYS) {
    const parsed = parseMatrix(get(key));
    if (parsed.error) {
      // the rows there are kept: fix them first rather than lose them to made-up ones
      const [msg, vars] = parsed.error;
      return inputError(key, msg, vars);
    }
  }
  const width = (key, fallback) => parseMatrix(get(key)).rows?.[0]?.length ?? fallback;
  const d = width("q", 2);
  const dv = width("v", 2);
  const changes = {
    q: resizeMatrix(get("q"), length, 1, d),
    k: resizeMatrix(get("k"), length, 2, d),
    v: resizeMatrix(get("v"), length, 3, dv),
    g: resizeMatrix(get("g"), length, 4, dv),
    bstep: "0",
    fstep: "0",
  };
  for (const key of ["bq", "bk"]) {
    const b = parseIntField(get(key));
    if (b !== null && b > length) changes[key] = String(length);
  }
  set(changes);
}

/** Apply the mask select: the fully-masked-row preset becomes a custom grid. */
function chooseMask(kind) {
  const { lq, lk } = shapes();
  if (kind === "masked_row") {
    const dense = causalDense(lq, lk, false);
    const row = Math.min(2, lq - 1);
    dense[row] = dense[row].map(() => false);
    set({ mask: "custom", cm: denseText(dense), bstep: "0", fstep: "0" });
  } else if (kind === "custom") {
    const current = data ? data.mask : causalDense(lq, lk, false);
    set({ mask: "custom", cm: denseText(current), bstep: "0", fstep: "0" });
  } else {
    set({ mask: kind, bstep: "0", fstep: "0" });
  }
}

/**
 * The custom grid's key holds rows of 0 and 1 joined by ";". Other text (a link may carry any)
 * is not read as some grid ("garbage" would read as row 0 fully masked, silently): it becomes
 * the grid the Mask select's "custom" starts from, the causal one, or the default without a
 * custom mask, so that the URL states the grid the page shows and computes with.
 */
function keepGridReadable() {
  if (/^[01;]*$/.test(get("cm"))) return;
  const { lq, lk } = shapes();
  set({ cm: get("mask") === "custom" ? denseText(causalDense(lq, lk, false)) : getDefault("cm") });
}

/** The custom grid from state, resized to (lq, lk): new cells attend. */
function customDense(lq, lk, read = get) {
  const rows = read("cm") ? read("cm").split(";") : [];
  return Array.from({ length: lq }, (_r, i) =>
    Array.from({ length: lk }, (_c, j) => (rows[i] && j < rows[i].length ? rows[i][j] === "1" : true)),
  );
}

function maskSpec(lq, lk, read = get) {
  const kind = read("mask");
  if (kind === "custom") return { kind, dense: customDense(lq, lk, read) };
  if (kind === "sliding_window") {
    return { kind, left: parseIntField(read("wl")), right: parseIntField(read("wr")) };
  }
  return { kind };
}

/** A client-side input error (UI string `key`): open the inputs so that the message next to the field shows. */
function inputError(field, key, vars = {}) {
  document.getElementById("bw-inputs").open = true;
  showFieldError(section, field, key, vars);
}

function numberOrNull(text) {
  const trimmed = String(text).trim().replace(/^\u2212/, "-");
  if (trimmed === "") return null;
  const x = Number(trimmed);
  return Number.isFinite(x) ? x : NaN;
}

/**
 * The request for the inputs `read(key)` gives (the fields' state, or the defaults): {body},
 * or {field, error: [i18n key, vars]} for what cannot be sent.
 */
function request(read) {
  const body = {};
  for (const key of MATRIX_KEYS) {
    const parsed = parseMatrix(read(key));
    if (parsed.error) return { field: key, error: parsed.error };
    body[key] = parsed.rows;
  }
  const ints = { block_q: "bq", block_k: "bk" };
  for (const [field, key] of Object.entries(ints)) {
    body[field] = parseIntField(read(key));
    if (body[field] === null) return { field, error: ["err.integer", {}] };
  }
  body.mask = maskSpec(body.q.length, body.k.length, read);
  if (read("mask") === "sliding_window" && (body.mask.left === null || body.mask.right === null)) {
    return { field: body.mask.left === null ? "left" : "right", error: ["err.integer", {}] };
  }
  body.conventions = read("conv");
  // dropout p and the ALiBi slope are numbers (empty is refused, never taken for 0);
  // softcap is off when empty, as its label says. The seed is sent only with dropout and
  // the slope only with ALiBi: the API refuses a field that would have no effect.
  body.alibi = read("alibi") === "1";
  const numbers = [["dropout_p", "p"]];
  if (body.alibi) numbers.push(["alibi_slope", "slope"]);
  for (const [field, key] of numbers) {
    const x = numberOrNull(read(key));
    if (x === null) return { field, error: ["err.k.not_number", {}] };
    if (Number.isNaN(x)) return { field, error: ["err.notNumberOne", { token: read(key) }] };
    body[field] = x;
  }
  if (body.dropout_p > 0) {
    body.seed = parseIntField(read("seed"));
    if (body.seed === null) return { field: "seed", error: ["err.integer", {}] };
  }
  const cap = numberOrNull(read("cap"));
  if (Number.isNaN(cap)) return { field: "softcap", error: ["err.notNumberOne", { token: read("cap") }] };
  body.softcap = cap;
  return { body };
}

async function compute() {
  document.getElementById("mask-grid-wrap").hidden = get("mask") !== "custom";
  for (const el of section.querySelectorAll(".window-only")) el.hidden = get("mask") !== "sliding_window";
  // the seed serves dropout and the slope ALiBi: each field is off while what it serves is
  document.getElementById("f-seed").disabled = !(numberOrNull(get("p")) > 0);
  document.getElementById("f-slope").disabled = get("alibi") !== "1";
  return computeSection({
    section,
    request,
    path: "/api/backward",
    sequence,
    errorBox: document.getElementById("bw-error"),
    shown: () => data !== null,
    accept: (result, body, isDefault) =>
      accept(result, body, isDefault, isDefault ? getDefault("mask") : get("mask")),
    fieldError: inputError,
    onRefused: () => {
      document.getElementById("bw-inputs").open = true;
    },
  });
}

function accept(result, body, isDefault, maskKind = get("mask")) {
  resultShown(section, { fallback: isDefault });
  data = result;
  dataInputs = settingsOf(body, maskKind);
  prepare();
  normalizeStep("bstep", data.steps.length);
  normalizeStep("fstep", data.forward_steps.length);
  render();
}

// ------------------------------------------------------------------------ derived, once per answer

/** Checkpoints of the gradients summed in loop order, every CHECKPOINT steps, and the forward index. */
function prepare() {
  const zeros = (rows) => rows.map((row) => row.map(() => 0));
  let acc = { dq: zeros(data.grads.dq), dk: zeros(data.grads.dk), dv: zeros(data.grads.dv) };
  checkpoints = [clone(acc)];
  data.steps.forEach((st, n) => {
    addStep(acc, st);
    if ((n + 1) % CHECKPOINT === 0) checkpoints.push(clone(acc));
  });
  // forward: the steps of each query tile, in loop order
  const byTile = new Map();
  data.forward_steps.forEach((st, n) => {
    if (!byTile.has(st.q_tile)) byTile.set(st.q_tile, []);
    byTile.get(st.q_tile).push(n);
  });
  fwdIndex = byTile;
  heatFor = null;
  painted = { mode: null, step: -1, lang: null };
  acc = null;
}

function clone(acc) {
  return { dq: acc.dq.map((r) => r.slice()), dk: acc.dk.map((r) => r.slice()), dv: acc.dv.map((r) => r.slice()) };
}

function addStep(acc, st) {
  const targets = [
    ["dq", st.q_range[0], st.dq],
    ["dk", st.k_range[0], st.dk],
    ["dv", st.k_range[0], st.dv],
  ];
  for (const [name, start, contrib] of targets) {
    contrib.forEach((row, r) => {
      const out = acc[name][start + r];
      row.forEach((x, c) => {
        out[c] += x;
      });
    });
  }
}

/** dQ, dK, dV after the first `step` tiles, summed in loop order (from the last checkpoint). */
function accumulated(step) {
  const base = Math.floor(step / CHECKPOINT);
  const acc = clone(checkpoints[base]);
  for (let n = base * CHECKPOINT; n < step; n++) addStep(acc, data.steps[n]);
  return acc;
}

/** Row i's forward state after the first `step` forward tiles: {st, r, finished} or null. */
function rowState(i, step) {
  const qt = data.q_tiles.findIndex(([a, b]) => i >= a && i < b);
  const list = fwdIndex.get(qt) ?? [];
  if (!list.length) return { st: null, r: 0, finished: true };
  let lo = 0;
  let hi = list.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (list[mid] < step) lo = mid + 1;
    else hi = mid;
  }
  if (lo === 0) return null;
  const n = list[lo - 1];
  const st = data.forward_steps[n];
  return { st, r: i - st.q_range[0], finished: lo === list.length };
}

// ------------------------------------------------------------------------ hover links

function clearLinks() {
  for (const el of linkedEls) el.classList.remove("linked");
  linkedEls = [];
  heat?.highlight(null);
}

function addLinks(selectors) {
  if (!selectors.length) return;
  for (const el of section.querySelectorAll(selectors.join(","))) {
    el.classList.add("linked");
    linkedEls.push(el);
    const box = el.closest(".table-scroll.tall");
    if (box && el.tagName === "TR") {
      const top = el.offsetTop;
      if (top < box.scrollTop || top + el.offsetHeight > box.scrollTop + box.clientHeight) box.scrollTop = top - box.clientHeight / 2;
    }
  }
}

function stepsOf() {
  return mode() === "forward" ? data.forward_steps : data.steps;
}

/**
 * Light what belongs together. target: {cell: [i, j]} a heat-map cell; {step: n} a tile
 * (1-based step); {row: i} a query row (LSE, O, dQ); {key: j} a key row (dK, dV).
 */
function link(target) {
  clearLinks();
  if (!target || !data) return;
  const fwd = mode() === "forward";
  const sel = [];
  let rows = null;
  let cols = null;
  if (target.cell) {
    const [i, j] = target.cell;
    const n = heat.stepOf(i, j);
    if (n) sel.push(`#bw-steps tr[data-step="${n}"]`);
    sel.push(`#bw-stats tr[data-row="${i}"]`);
    if (!fwd) sel.push(`#bw-grads tr[data-grad="dq${i}"]`, `#bw-grads tr[data-grad="dk${j}"]`, `#bw-grads tr[data-grad="dv${j}"]`);
    const st = n ? stepsOf()[n - 1] : null;
    if (st) [rows, cols] = [st.q_range, st.k_range];
    else [rows, cols] = [[i, i + 1], [j, j + 1]];
  } else if (target.step) {
    const st = stepsOf()[target.step - 1];
    [rows, cols] = [st.q_range, st.k_range];
    sel.push(`#bw-steps tr[data-step="${target.step}"]`);
    for (let i = rows[0]; i < rows[1]; i++) sel.push(`#bw-stats tr[data-row="${i}"]`, `#bw-grads tr[data-grad="dq${i}"]`);
    if (!fwd) for (let j = cols[0]; j < cols[1]; j++) sel.push(`#bw-grads tr[data-grad="dk${j}"]`, `#bw-grads tr[data-grad="dv${j}"]`);
  } else if (target.row !== undefined) {
    rows = [target.row, target.row + 1];
    sel.push(`#bw-stats tr[data-row="${target.row}"]`, `#bw-grads tr[data-grad="dq${target.row}"]`);
  } else if (target.key !== undefined) {
    cols = [target.key, target.key + 1];
    sel.push(`#bw-grads tr[data-grad="dk${target.key}"]`, `#bw-grads tr[data-grad="dv${target.key}"]`);
  }
  addLinks(sel);
  heat.highlight({ rows, cols });
}

function hoverable(el, target) {
  el.addEventListener("pointerenter", () => link(target));
  el.addEventListener("pointerleave", () => link(null));
  return el;
}

// ------------------------------------------------------------------------ render

/** What the summary line states of a request: sizes, mask, tiles, conventions, score options. */
function settingsOf(body, maskKind) {
  const { q, k, v, block_q: bq, block_k: bk, conventions: conv, dropout_p: p, softcap: cap, alibi, alibi_slope: slope } = body;
  return { lq: q.length, lk: k.length, d: q[0].length, dv: v[0].length, mask: maskKind, maskSpec: body.mask, bq, bk, conv, p, cap, alibi, slope };
}

/**
 * The problem of the result shown, for section 05 to book: sizes, tiles, the mask as asked
 * (kind, window sides) with the causal alignment of its conventions, and the visibility grid
 * the loop used. Null before the first result.
 */
export function problem() {
  if (!data || !dataInputs) return null;
  const preset = presets.find((x) => x.name === dataInputs.conv);
  return { ...dataInputs, align: preset?.causal_align ?? "top_left", dense: data.mask };
}

/**
 * One line under the inputs' summary: the settings of the result shown, not of the fields,
 * which may hold refused inputs; while they do, staleNote marks the line as the previous result.
 */
function renderConfig() {
  const el = document.getElementById("bw-config");
  if (!data) return fill(el);
  const c = dataInputs;
  const option = document.querySelector(`#f-mask option[value="${CSS.escape(c.mask)}"]`);
  const parts = [c.lq === c.lk ? `L = ${c.lq}` : `Lq = ${c.lq}, Lk = ${c.lk}`, option?.textContent ?? c.mask, `${c.bq}\u00d7${c.bk}`, c.conv];
  if (c.p > 0) parts.push(`dropout ${c.p}`);
  if (c.cap !== null) parts.push(`softcap ${c.cap}`);
  if (c.alibi) parts.push(`ALiBi ${c.slope}`);
  fill(el, staleNote(), parts.join(" \u00b7 "));
}

/** True when the result shown was computed with a softcap (its formulas then differ). */
function capped() {
  return dataInputs !== null && dataInputs.cap !== null && dataInputs.cap !== undefined;
}

/**
 * The backward formulas of the result shown: with a softcap, the capped score and the cap's
 * derivative 1 − t² that ∂S takes on its way to ∂Q and ∂K (without it a step cannot be
 * followed by hand), and a note on the column that shows ∂S·(1 − t²).
 */
function renderCapFormula() {
  const on = capped();
  for (const el of section.querySelectorAll("#bw-formula .formula-cap")) el.hidden = (el.dataset.cap === "on") !== on;
  document.getElementById("bw-cap-note").textContent = on ? t("s4.capNote", { cap: dataInputs.cap }) : "";
}

/** Names of the backward formulas shown: the capped ones when the result has a softcap. */
function formulaNames() {
  return capped() ? { backward: "backward_softcap", scores: "scores_softcap", lines: [0, 1] } : { backward: "backward", scores: "scores", lines: [0] };
}

export function render() {
  const m = mode();
  const fwd = m === "forward";
  for (const option of document.getElementById("f-conv").options) {
    const preset = presets.find((x) => x.name === option.value);
    if (preset) option.title = presetText(preset);
  }
  bwCtl.render();
  fwCtl.render();
  document.getElementById("bw-stepper").hidden = fwd;
  document.getElementById("fw-stepper").hidden = !fwd;
  for (const btn of section.querySelectorAll("#bw-pass button")) {
    const on = btn.dataset.pass === m;
    btn.classList.toggle("active", on);
    btn.setAttribute("aria-pressed", String(on));
  }
  for (const el of section.querySelectorAll("#bw-formula .formula-pass")) el.hidden = el.dataset.pass !== m;
  renderCapFormula();
  document.getElementById("bw-card-title").textContent = t(fwd ? "s4.cardFwd" : "s4.card");
  document.getElementById("bw-card-sub").textContent = t(fwd ? "s4.cardSubFwd" : "s4.cardSub");
  document.getElementById("bw-heat-title").textContent = t(fwd ? "s4.heatFwd" : "s4.heat");
  document.getElementById("bw-stats-title").textContent = t(fwd ? "s4.statsTitleFwd" : "s4.statsTitle");
  document.getElementById("bw-grads-card").hidden = fwd;
  renderMaskGrid();
  renderConfig();
  const ids = ["bw-readouts", "bw-heat", "bw-legend", "bw-step", "bw-stats", "bw-grads"];
  if (!data) {
    for (const id of ids) fill(document.getElementById(id));
    bus.dispatchEvent(new Event("backward"));
    return;
  }
  const ctl = fwd ? fwCtl : bwCtl;
  const step = ctl.current();
  // the legend, the tables' headers and the "fully masked" tags are built with the words
  // of one language: a language switch builds them again
  const rebuilt = painted.mode !== m || heatFor !== data || painted.lang !== currentLanguage();
  const prev = rebuilt ? -1 : painted.step;
  if (rebuilt) {
    clearLinks();
    const steps = fwd ? data.forward_steps.map((st) => ({ ...st, values: st.p })) : data.steps.map((st) => ({ ...st, values: st.p }));
    builtWidth = heatWidth();
    heat.build(data, steps, fwd ? forwardTip : backwardTip, builtWidth);
    heatFor = data;
    fill(document.getElementById("bw-legend"), legend(fwd));
    buildStats(fwd);
    if (!fwd) buildGrads();
  }
  heat.show(step);
  painted = { mode: m, step, lang: currentLanguage() };
  if (fwd) {
    renderForwardReadouts(step);
    renderForwardStep(step, prev);
    updateForwardStats(step, prev);
  } else {
    renderBackwardReadouts(step);
    renderBackwardStep(step);
    updateStats(step);
    updateGrads(step, prev);
  }
  lightUp(document.getElementById("bw-formula"), fwd ? forwardPhases(step) : backwardPhases(step));
  bus.dispatchEvent(new Event("backward"));
}

function backwardTip(i, j, value, n) {
  if (!data.mask[i][j]) return `P[${i},${j}]: ${t("s4.legendMasked")}`;
  const where = n ? ` \u00b7 ${t("s4.tipStep", { n })}` : "";
  return value === null ? `P[${i},${j}]: ${t("s4.legendPending")}${where}` : `P[${i},${j}] = ${tipNumber(value)}${where}`;
}

function forwardTip(i, j, value, n) {
  if (!data.mask[i][j]) return `S[${i},${j}]: ${t("s4.legendMasked")}`;
  const where = n ? ` \u00b7 ${t("s4.tipStep", { n })}` : "";
  if (value === null) return `S[${i},${j}]: ${t("s4.legendUnread")}${where}`;
  const st = data.forward_steps[n - 1];
  const score = st.s[i - st.q_range[0]][j - st.k_range[0]];
  return `S[${i},${j}] = ${tipNumber(score)} \u00b7 exp(S \u2212 m) = ${tipNumber(value)}${where}`;
}

/** Formula lines of a backward step: λ and D before the loop; P, ∂S, ∂Q, ∂K/∂V in a tile. */
function backwardPhases(step) {
  const { backward: b, scores, lines } = formulaNames();
  if (step === 0) return [{ [b]: [0] }, { [b]: [2] }];
  return [{ [scores]: lines, [b]: [1] }, { [b]: [3] }, { [b]: [4] }, { [b]: [5, 6] }];
}

/** Formula lines of a forward step: scores, m′, α when a row's max moved, ℓ′ and a′, o′ at a row's end. */
function forwardPhases(step) {
  if (step === 0) return [{ initial: [0] }];
  const st = data.forward_steps[step - 1];
  const { scores, lines } = formulaNames();
  const phases = [{ [scores]: lines }, { running: [0] }];
  if (st.alpha.some((a) => a > 0 && a < 1)) phases.push({ running: [1] });
  phases.push({ running: [2, 3] });
  const list = fwdIndex.get(st.q_tile);
  if (list && list[list.length - 1] === step - 1) phases.push({ running: [4] });
  if (st.k_tile === 0 || st.m_before.every((x) => x === -Infinity)) phases.unshift({ initial: [0] });
  return phases;
}

function legend(fwd) {
  const item = (cls, key) => h("span", { class: "legend-item" }, h("span", { class: `swatch ${cls}` }), t(key));
  return [
    item("sw-p", fwd ? "s4.heatFwdShort" : "s4.heat"),
    item("sw-pending", fwd ? "s4.legendUnread" : "s4.legendPending"),
    item("sw-masked", "s4.legendMasked"),
    item("sw-current", "s4.legendCurrent"),
    data.keep && !fwd ? item("sw-drop", "s4.legendDropped") : null,
  ];
}

function renderBackwardReadouts(step) {
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
}

function renderForwardReadouts(step) {
  const total = data.forward_steps.length;
  let finished = 0;
  for (let i = 0; i < data.lq; i++) if (rowState(i, step)?.finished) finished += 1;
  const done = step === total;
  fill(
    document.getElementById("bw-readouts"),
    readout("fw-progress", "s4.fwdProgress", h("span", { class: "num" }, `${step} / ${total}`)),
    readout("fw-rows", "s4.fwdRows", h("span", { class: "num" }, `${finished} / ${data.lq}`)),
    readout("fw-diff", "s4.fwdStepsDiff", done ? num(data.forward_steps_max_diff) : h("span", { class: "muted" }, t("s4.fwdNotYet")), done && data.forward_steps_max_diff <= data.tolerance ? "good" : ""),
    readout("tiles", "s5.tiles", h("span", { class: "num" }, t("s4.tiles", { run: data.forward_counters.tiles_run, skipped: data.forward_counters.tiles_skipped }))),
  );
}

/**
 * Row r of a tile's values (query q_range[0] + r, keys from k_range[0]): each entry a number,
 * or "masked" where the mask hides that key from that query (the loop stores 0 there).
 */
function tileRow(st, r, values) {
  const i = st.q_range[0] + r;
  const parts = [];
  values.forEach((x, c) => {
    if (c) parts.push(", ");
    const j = st.k_range[0] + c;
    parts.push(data.mask[i][j] ? num(x) : h("span", { class: "masked-entry", title: `P[${i},${j}]: ${t("s4.legendMasked")}` }, t("s4.maskedEntry")));
  });
  return h("span", { class: "vec" }, "[", parts, "]");
}

function rangeText(lo, hi, prefix) {
  return hi - lo === 1 ? `${prefix}${lo}` : `${prefix}${lo}\u2013${prefix}${hi - 1}`;
}

function tileTable(current) {
  const [a, b] = current.q_range;
  const [c, d] = current.k_range;
  return h(
    "div",
    {},
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
  );
}

/** The window of steps around the current one (at most STEP_WINDOW rows). */
function stepsWindow(step, total, rowOf, head) {
  const lo = Math.max(0, Math.min(step - STEP_WINDOW / 2, total - STEP_WINDOW));
  const hi = Math.min(total, lo + STEP_WINDOW);
  const body = h("tbody");
  for (let n = lo; n < hi; n++) {
    const cls = n === step - 1 ? "current" : n < step ? "" : "future";
    body.append(hoverable(h("tr", { class: cls, "data-step": n + 1 }, rowOf(n, n < step)), { step: n + 1 }));
  }
  return [
    h("h4", { class: "steps-title" }, t(mode() === "forward" ? "s4.stepsTitleFwd" : "s4.stepsTitle", { lo: lo + 1, hi, total })),
    h("div", {}, h("table", { class: "data compact", id: "bw-steps" }, h("thead", {}, h("tr", {}, head.map((key) => h("th", {}, t(key))))), body)),
  ];
}

function renderBackwardStep(step) {
  const current = step > 0 ? data.steps[step - 1] : null;
  const throughCap = Boolean(current?.ds_qk);
  const parts = [];
  if (!current) {
    parts.push(h("p", { class: "muted" }, t("s4.noStep")));
  } else {
    const a = current.q_range[0];
    parts.push(
      tileTable(current),
      h(
        "div",
        {},
        h(
          "table",
          { class: "data compact", id: "bw-prows" },
          h("thead", {}, h("tr", {}, h("th", {}, t("s4.thRow")), h("th", {}, "P = exp(S \u2212 LSE)"), h("th", {}, "\u2202S"), throughCap ? h("th", { title: t("s4.thDsCapTitle") }, "\u2202S\u00b7(1 \u2212 t\u00b2)") : null)),
          h(
            "tbody",
            {},
            current.p.map((row, r) =>
              h(
                "tr",
                { "data-row": a + r },
                h("td", {}, `q${a + r}`),
                h("td", { "data-col": "p" }, tileRow(current, r, row)),
                h("td", { "data-col": "ds" }, tileRow(current, r, current.ds[r])),
                // with a softcap, ∂S reaches Q and K through the cap: the factor they take
                throughCap ? h("td", { "data-col": "ds_qk" }, tileRow(current, r, current.ds_qk[r])) : null,
              ),
            ),
          ),
        ),
      ),
    );
  }
  parts.push(
    ...stepsWindow(
      step,
      data.steps.length,
      (n, read) => {
        const st = data.steps[n];
        return [
          h("td", {}, String(n + 1)),
          h("td", {}, `(${st.q_tile}, ${st.k_tile})`),
          h("td", {}, rangeText(st.q_range[0], st.q_range[1], "q")),
          h("td", {}, rangeText(st.k_range[0], st.k_range[1], "k")),
          h(
            "td",
            {},
            read
              ? st.p.map((row, r) => h("div", {}, h("span", { class: "muted small" }, `q${st.q_range[0] + r} `), tileRow(st, r, row)))
              : h("span", { class: "muted" }, t("s4.legendPending")),
          ),
        ];
      },
      ["s4.thStep", "s4.thTile", "s4.thQueries", "s4.thKeys", "s4.thP"],
    ),
  );
  fill(document.getElementById("bw-step"), parts);
}

/** ℓ of one row in this tile: the old ℓ shrinking by α, then the tile's terms added. */
function ellBar(before, alpha, after, most, animateIt) {
  const W = 120;
  const scale = (x) => (most > 0 ? (W * x) / most : 0);
  const kept = alpha * before;
  const svg = s("svg", { width: W + 2, height: 12, class: "ell-bar", viewBox: `0 0 ${W + 2} 12` });
  const old = s("rect", { x: 0, y: 2, width: scale(kept), height: 8, class: "ell-old" });
  const added = s("rect", { x: scale(kept), y: 2, width: Math.max(scale(after - kept), 0), height: 8, class: "ell-new" });
  svg.append(old, added, s("title", {}, `\u2113: ${before} \u00d7 \u03b1 (${alpha}) + \u2026 = ${after}`));
  if (animateIt) {
    if (kept < before && before > 0) animate(old, [{ width: `${scale(before)}px` }, { width: `${scale(kept)}px` }], { duration: PHASE, delay: PHASE });
    animate(added, [{ opacity: 0 }, { opacity: 1 }], { duration: PHASE, delay: 2 * PHASE });
  }
  return svg;
}

function renderForwardStep(step, prev) {
  const current = step > 0 ? data.forward_steps[step - 1] : null;
  const parts = [];
  if (!current) {
    parts.push(h("p", { class: "muted" }, t("s4.noStepFwd")));
  } else {
    const a = current.q_range[0];
    const most = Math.max(...current.ell, ...current.ell_before, 1e-300);
    const moving = prev === step - 1;
    parts.push(
      tileTable(current),
      h(
        "div",
        {},
        h(
          "table",
          { class: "data compact", id: "fw-rows" },
          h("thead", {}, h("tr", {}, ["s4.thRow", "s4.thMmove", "s4.thAlpha", "s4.thEllMove", "s4.thOsoFar"].map((key) => h("th", {}, t(key))))),
          h(
            "tbody",
            {},
            current.m.map((m, r) =>
              h(
                "tr",
                { "data-row": a + r, class: current.alpha[r] > 0 && current.alpha[r] < 1 ? "rescaled" : "" },
                h("td", {}, `q${a + r}`),
                h("td", { "data-col": "m" }, num(current.m_before[r]), " \u2192 ", num(m)),
                h("td", { "data-col": "alpha" }, num(current.alpha[r])),
                h("td", { "data-col": "ell" }, num(current.ell_before[r]), " \u2192 ", num(current.ell[r]), h("br"), ellBar(current.ell_before[r], current.alpha[r], current.ell[r], most, moving)),
                h("td", { "data-col": "o" }, vec(current.o[r])),
              ),
            ),
          ),
        ),
      ),
    );
  }
  parts.push(
    ...stepsWindow(
      step,
      data.forward_steps.length,
      (n, read) => {
        const st = data.forward_steps[n];
        return [
          h("td", {}, String(n + 1)),
          h("td", {}, `(${st.q_tile}, ${st.k_tile})`),
          h("td", {}, rangeText(st.q_range[0], st.q_range[1], "q")),
          h("td", {}, rangeText(st.k_range[0], st.k_range[1], "k")),
          h("td", {}, read ? vec(st.m) : h("span", { class: "muted" }, t("s4.legendUnread"))),
          h("td", {}, read ? vec(st.alpha) : ""),
        ];
      },
      ["s4.thStep", "s4.thTile", "s4.thQueries", "s4.thKeys", "s4.thM", "s4.thAlphaShort"],
    ),
  );
  fill(document.getElementById("bw-step"), parts);
}

// ------------------------------------------------------------------------ per-row tables

function buildStats(fwd) {
  const masked = new Set(data.fully_masked_rows);
  const body = h("tbody");
  statRows = [];
  data.lse.forEach((lse, i) => {
    const tag = masked.has(i) ? h("span", { class: "tag" }, t("s4.fullyMasked")) : null;
    const cells = fwd
      ? [
          h("td", {}, String(i), tag),
          h("td", { class: "num-col", "data-col": "m" }),
          h("td", { class: "num-col", "data-col": "ell" }),
          h("td", { "data-col": "o" }),
          h("td", { class: "num-col", "data-col": "lse" }),
        ]
      : [
          h("td", {}, String(i), tag),
          h("td", { class: "num-col", "data-col": "lse" }, num(lse)),
          h("td", { "data-col": "o" }, vec(data.o[i])),
          h("td", { class: "num-col", "data-col": "D" }, num(data.D[i])),
        ];
    const tr = hoverable(h("tr", { "data-row": i }, cells), { row: i });
    statRows.push({ tr, key: null });
    body.append(tr);
  });
  const head = fwd
    ? [["s4.thRow", ""], ["s4.thM", "num-col"], ["s4.thEll", "num-col"], ["s4.thOsoFar", ""], ["s4.thLse", "num-col"]]
    : [["s4.thRow", ""], ["s4.thLse", "num-col"], ["s4.thO", ""], ["s4.thD", "num-col"]];
  fill(document.getElementById("bw-stats"), h("thead", {}, h("tr", {}, head.map(([key, cls]) => h("th", { class: cls }, t(key))))), body);
}

function updateStats(step) {
  const current = step > 0 ? data.steps[step - 1] : null;
  statRows.forEach(({ tr }, i) => tr.classList.toggle("current", Boolean(current) && i >= current.q_range[0] && i < current.q_range[1]));
}

function updateForwardStats(step, prev) {
  const current = step > 0 ? data.forward_steps[step - 1] : null;
  const dash = () => h("span", { class: "muted" }, "\u2014");
  // one step forward changes only the rows of the new tile and of the previous one
  let rows = statRows.map((_x, i) => i);
  if (prev >= 0 && Math.abs(step - prev) === 1) {
    const touched = [step, prev].filter((n) => n > 0).map((n) => data.forward_steps[n - 1]);
    rows = [...new Set(touched.flatMap((st) => Array.from({ length: st.q_range[1] - st.q_range[0] }, (_x, r) => st.q_range[0] + r)))];
  }
  for (const i of rows) {
    const { tr } = statRows[i];
    const state = rowState(i, step);
    const key = state ? `${state.st ? state.st.index : "x"}:${state.finished}` : "none";
    tr.classList.toggle("current", Boolean(current) && i >= current.q_range[0] && i < current.q_range[1]);
    if (statRows[i].key === key) continue;
    statRows[i].key = key;
    const [, mCell, ellCell, oCell, lseCell] = tr.children;
    if (!state || !state.st) {
      fill(mCell, num(-Infinity));
      fill(ellCell, num(0));
      fill(oCell, state?.finished ? vec(data.o[i]) : dash());
      fill(lseCell, state?.finished ? num(data.lse[i]) : dash());
    } else {
      fill(mCell, num(state.st.m[state.r]));
      fill(ellCell, num(state.st.ell[state.r]));
      fill(oCell, vec(state.st.o[state.r]));
      fill(lseCell, state.finished ? num(data.lse[i]) : dash());
    }
    tr.classList.toggle("finished", Boolean(state?.finished));
  }
}

function buildGrads() {
  const body = h("tbody");
  gradRows = {};
  for (const name of ["dq", "dk", "dv"]) {
    data.grads[name].forEach((_row, i) => {
      const accCell = h("td", { "data-col": "acc" });
      const tr = hoverable(
        h("tr", { "data-grad": `${name}${i}` }, h("td", {}, `${NAMES[name]}[${i}]`), accCell, h("td", {}, vec(data.reference[name][i]))),
        name === "dq" ? { row: i } : { key: i },
      );
      gradRows[`${name}${i}`] = { tr, accCell, shown: null };
      body.append(tr);
    });
  }
  fill(
    document.getElementById("bw-grads"),
    h("thead", {}, h("tr", {}, ["s4.thObject", "s4.thAcc", "s4.thRef"].map((key) => h("th", {}, t(key))))),
    body,
  );
}

function updateGrads(step, prev) {
  const current = step > 0 ? data.steps[step - 1] : null;
  const acc = accumulated(step);
  const moving = prev >= 0 && step === prev + 1;
  for (const name of ["dq", "dk", "dv"]) {
    const range = current ? (name === "dq" ? current.q_range : current.k_range) : [0, 0];
    acc[name].forEach((row, i) => {
      const entry = gradRows[`${name}${i}`];
      const touched = i >= range[0] && i < range[1];
      entry.tr.classList.toggle("current", touched);
      if (entry.shown && entry.shown.every((x, c) => x === row[c])) return;
      entry.shown = row;
      const done = maxAbsDiff(row, data.reference[name][i]) < 1e-12;
      entry.accCell.classList.toggle("muted-num", !done);
      fill(entry.accCell, vec(row));
      if (moving && touched) {
        const delay = name === "dq" ? 2 * PHASE : 3 * PHASE;
        animate(entry.accCell, [{ backgroundColor: "rgba(194, 124, 14, 0.35)" }, { backgroundColor: "rgba(194, 124, 14, 0)" }], { duration: 2 * PHASE, delay });
      }
    });
  }
}

// ------------------------------------------------------------------------ the custom mask grid

function renderMaskGrid() {
  const wrap = document.getElementById("mask-grid");
  const { lq, lk } = shapes();
  const key = `${get("mask")}|${get("cm")}|${lq}|${lk}`;
  if (key === maskGridFor) return;
  maskGridFor = key;
  if (get("mask") !== "custom") return fill(wrap);
  if (!lq || !lk) return fill(wrap);
  const dense = customDense(lq, lk);
  const size = lk > 16 ? 12 : 22;
  const grid = h("div", { class: "mask-grid", style: `grid-template-columns: repeat(${lk}, ${size}px)` });
  dense.forEach((row, i) =>
    row.forEach((on, j) => {
      grid.append(
        h("button", {
          type: "button",
          class: on ? "on" : "",
          style: size !== 22 ? `width:${size}px;height:${size}px` : null,
          title: `q${i} \u00d7 k${j}`,
          "data-cell": `${i},${j}`,
          onclick: () => {
            dense[i][j] = !dense[i][j];
            set({ cm: denseText(dense), bstep: "0", fstep: "0" });
          },
        }),
      );
    }),
  );
  fill(wrap, h("div", { class: "table-scroll" }, grid));
}

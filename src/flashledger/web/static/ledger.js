// Section 02: one row of scores read block by block by flashledger.OnlineSoftmax.
// The server computes every step; the page steps through them, draws the row (scores,
// running max, exp(s − m), ℓ and a) and lights the update formula's lines each step uses.

import { latest } from "./api.js";
import { fill, fmtNumber, h, num, parseMatrix, parseVector, vec } from "./fmt.js";
import { lightUp } from "./formula.js";
import { t } from "./i18n.js";
import { dragging, drawRowChart } from "./rowchart.js";
import { get, getDefault, set, subscribe } from "./state.js";
import {
  bindInput,
  computeSection,
  normalizeStep,
  parseIntField,
  readout,
  registerStepper,
  resultShown,
  staleNote,
  stepper,
} from "./widgets.js";

const INPUT_KEYS = ["scores", "values", "bs", "shift"];
const DRAG_SEND_MS = 120;
let section;
let data = null;
let shownBody = null; // the request `data` answers (the note and title describe it)
let seed = null; // the seed page's row (examples.ledger)
let bus;
let stepCtl;
let shownStep = 0;
let dragTimer = null;
let dragScores = null;
const sequence = latest();

export function init(ctx) {
  bus = ctx.bus;
  seed = ctx.examples.ledger;
  section = document.getElementById("sec-ledger");
  document.getElementById("ledger-reset").addEventListener("click", () => {
    const changes = {};
    for (const key of [...INPUT_KEYS, "step"]) changes[key] = getDefault(key);
    set(changes);
  });
  const bindings = [
    bindInput(document.getElementById("f-scores"), "scores"),
    bindInput(document.getElementById("f-values"), "values"),
    bindInput(document.getElementById("f-block"), "bs"),
    bindInput(document.getElementById("f-shift"), "shift"),
    bindInput(document.getElementById("f-avg"), "avg"),
  ];
  stepCtl = stepper(
    document.getElementById("ledger-stepper"),
    "step",
    () => (data ? data.steps.length : 0),
    (step, total) => `${t("s2.blocksRead")}: ${step} / ${total}`,
  );
  registerStepper("ledger", stepCtl);
  registerStepper("running", stepCtl);
  subscribe((changes) => {
    if (INPUT_KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync(changes);
      compute();
    } else if ("step" in changes || "avg" in changes) {
      for (const b of bindings) b.sync(changes);
      render();
    }
  });
  new ResizeObserver(() => data && drawChart(stepCtl.current(), stepCtl.current())).observe(document.getElementById("ledger-chart"));
  render();
  compute();
}

export function shown(sec) {
  if (sec === "ledger" && data) drawChart(stepCtl.current(), stepCtl.current());
}

/** The data of the last successful run and the current step (for section 01). */
export function snapshot() {
  return data ? { data, step: stepCtl.current() } : null;
}

/** The lines of the running-state formula block `step` uses, in computing order. */
export function formulaPhases(step) {
  if (!data || step === 0) return [{ initial: [0] }];
  const st = data.steps[step - 1];
  const phases = [{ running: [0] }];
  if (st.alpha > 0 && st.alpha < 1) phases.push({ running: [1] });
  phases.push({ running: [2, 3] }, { running: [4] });
  if (step === 1) phases.unshift({ initial: [0] });
  return phases;
}

/** Extra marks for the formula: the α line when the old state was rescaled. */
export function formulaMarks(step) {
  if (!data || step === 0) return {};
  const st = data.steps[step - 1];
  return st.alpha > 0 && st.alpha < 1 ? { "lit-strong": { running: [1] } } : {};
}

/**
 * The request for the inputs `read(key)` gives (the fields' state, or the defaults): {body},
 * or {field, error: [i18n key, vars]} for what cannot be sent.
 */
function request(read) {
  const scores = parseVector(read("scores"));
  if (scores.error) return { field: "scores", error: scores.error };
  const values = parseMatrix(read("values"));
  if (values.error) return { field: "values", error: values.error };
  const blockSize = parseIntField(read("bs"));
  if (blockSize === null) return { field: "block_size", error: ["err.integer", {}] };
  // an empty shift is not taken for 0: it is refused with a message that says 0 is no shift
  const shiftText = String(read("shift") ?? "").trim();
  if (!shiftText) return { field: "shift", error: ["err.shiftEmpty", {}] };
  const shift = parseVector(shiftText);
  if (shift.error || shift.values.length !== 1) return { field: "shift", error: ["err.notNumberOne", { token: shiftText }] };
  return { body: { scores: scores.values, values: values.rows, block_size: blockSize, shift: shift.values[0] } };
}

async function compute() {
  return computeSection({
    section,
    request,
    path: "/api/ledger",
    sequence,
    errorBox: document.getElementById("ledger-error"),
    shown: () => data !== null,
    accept,
  });
}

function accept(result, body, isDefault) {
  resultShown(section, { fallback: isDefault });
  data = result;
  shownBody = body;
  normalizeStep("step", data.steps.length);
  render();
}

const sameNumbers = (a, b) => a.length === b.length && a.every((x, i) => (Array.isArray(x) ? sameNumbers(x, b[i]) : x === b[i]));

/** True when the result shown is the seed page's row (any block size and shift). */
function isSeedRow() {
  return Boolean(shownBody) && sameNumbers(shownBody.scores, seed.scores) && sameNumbers(shownBody.values, seed.values);
}

/** The card's title and the note under it describe the row shown, the seed's or another. */
function renderIntro() {
  const title = document.getElementById("ledger-card-title");
  const note = document.getElementById("ledger-note");
  const reset = document.getElementById("ledger-reset");
  const own = data && !isSeedRow();
  title.textContent = own ? t("s2.cardOwn", { n: data.n, d: data.d_v }) : t("s2.card");
  const seedText = `[${seed.scores.map((x) => fmtNumber(x)).join(", ")}]`;
  // the seed's scores with other values are not "your own scores": the note says which changed
  const ownScores = own && !(shownBody && sameNumbers(shownBody.scores, seed.scores));
  const key = !own ? "s2.note" : ownScores ? "s2.noteOwn" : "s2.noteOwnValues";
  fill(note, staleNote(), own ? t(key, { n: data.n, seed: seedText }) : t(key));
  reset.hidden = !own;
}

// ------------------------------------------------------------------------ dragging a score

function scoresText(values) {
  return values.map((x) => String(Math.round(x * 1e6) / 1e6)).join(", ");
}

function onScore(j, shiftedValue) {
  const parsed = parseVector(get("scores"));
  if (parsed.error || !data) return;
  dragScores = parsed.values.slice();
  dragScores[j] = Math.round((shiftedValue - data.shift) * 1e6) / 1e6;
  if (dragTimer === null) {
    dragTimer = setTimeout(() => {
      dragTimer = null;
      if (dragScores) set({ scores: scoresText(dragScores) });
    }, DRAG_SEND_MS);
  }
}

/** An arrow key on score j's handle: that score moves by delta, from the scores as typed. */
function onNudge(j, delta) {
  const parsed = parseVector(get("scores"));
  if (parsed.error || j >= parsed.values.length) return;
  const next = parsed.values.slice();
  next[j] = Math.round((next[j] + delta) * 1e6) / 1e6;
  set({ scores: scoresText(next) });
}

function onDragEnd() {
  clearTimeout(dragTimer);
  dragTimer = null;
  if (dragScores) set({ scores: scoresText(dragScores) });
  dragScores = null;
  if (data) drawChart(stepCtl.current(), stepCtl.current());
}

function drawChart(step, prev) {
  drawRowChart(document.getElementById("ledger-chart"), data, step, prev, { onScore, onNudge, onDragEnd, onHover: (j) => link(j === null ? null : { pos: j }) });
}

// ------------------------------------------------------------------------ hover links

/** Light what belongs together: a block (its band, its positions) or one position. */
function link(target) {
  for (const el of section.querySelectorAll(".linked")) el.classList.remove("linked");
  if (!target || !data) return;
  let block = target.block;
  let positions = [];
  if (target.pos !== undefined) {
    positions = [target.pos];
    block = data.blocks.findIndex(([a, b]) => target.pos >= a && target.pos < b);
  } else {
    const [a, b] = data.blocks[block];
    positions = Array.from({ length: b - a }, (_x, i) => a + i);
  }
  const selectors = [`#ledger-table tr[data-block="${block}"]`, `#ledger-chart [data-band="${block}"]`];
  for (const j of positions) selectors.push(`#ledger-row tr[data-pos="${j}"]`, `#ledger-chart g[data-pos="${j}"]`);
  for (const el of section.querySelectorAll(selectors.join(","))) el.classList.add("linked");
}

function hoverable(el, target) {
  el.addEventListener("pointerenter", () => link(target));
  el.addEventListener("pointerleave", () => link(null));
  return el;
}

// ------------------------------------------------------------------------ render

export function render() {
  stepCtl.render();
  renderIntro();
  const readouts = document.getElementById("ledger-readouts");
  const table = document.getElementById("ledger-table");
  const row = document.getElementById("ledger-row");
  if (!data) {
    for (const el of [readouts, table, row, document.getElementById("ledger-avg-table"), document.getElementById("ledger-avg-readouts")]) fill(el);
    bus.dispatchEvent(new Event("ledger"));
    return;
  }
  const step = stepCtl.current();
  const prev = shownStep;
  shownStep = step;
  const last = step > 0 ? data.steps[step - 1] : null;
  const nothing = () => h("span", { class: "muted" }, t("common.dash"));
  fill(
    readouts,
    readout("blocks-read", "s2.blocksRead", h("span", { class: "num" }, `${step} / ${data.steps.length}`)),
    readout("m", "s2.m", num(last ? last.m : -Infinity)),
    readout("ell", "s2.ell", num(last ? last.ell : 0)),
    readout("diff", "s2.diff", last ? num(last.max_diff) : nothing(), last && step === data.steps.length ? "good" : ""),
    readout("prefix", "s2.prefix", last ? vec(last.o) : nothing(), "wide"),
    readout("reference", "s2.reference", vec(data.o), "wide"),
  );
  renderLedgerTable(table, step);
  renderRowTable(row, last);
  renderAverage();
  if (!dragging()) drawChart(step, prev);
  const formula = document.getElementById("ledger-formula");
  lightUp(formula, formulaPhases(step), formulaMarks(step));
  const note = document.getElementById("ledger-formula-note");
  if (!last) note.textContent = t("s2.formulaStart");
  else if (step === 1) note.textContent = t("s2.formulaFirst");
  else if (last.alpha < 1) note.textContent = t("s2.formulaRescale", { alpha: fmtNumber(last.alpha), before: fmtNumber(last.m_before), after: fmtNumber(last.m) });
  else note.textContent = t("s2.formulaSame", { m: fmtNumber(last.m) });
  bus.dispatchEvent(new Event("ledger"));
}

function renderLedgerTable(table, step) {
  const head = h(
    "thead",
    {},
    h(
      "tr",
      {},
      ["s2.thBlock", "s2.thScores", "s2.thBlockMax", "s2.thRunMax", "s2.thAlpha", "s2.thEll", "s2.thAcc"].map((key, i) =>
        h("th", { class: i >= 2 ? "num-col" : "" }, t(key)),
      ),
    ),
  );
  const body = h("tbody");
  data.steps.forEach((st, i) => {
    const read = i < step;
    const cls = i === step - 1 ? "current" : read ? "" : "future";
    const cells = read
      ? [
          h("td", { class: "num-col" }, num(st.block_max)),
          h("td", { class: "num-col" }, num(st.m)),
          h("td", { class: `num-col${st.alpha > 0 && st.alpha < 1 ? " rescaled" : ""}` }, num(st.alpha)),
          h("td", { class: "num-col" }, num(st.ell)),
          h("td", { class: "num-col" }, vec(st.acc)),
        ]
      : [h("td", { colspan: 5, class: "muted" }, t("s2.unread"))];
    body.append(
      hoverable(
        h(
          "tr",
          { class: cls, "data-block": i },
          h("td", {}, `${i + 1}`, h("span", { class: "muted small" }, ` [${st.start}, ${st.stop})`)),
          h("td", {}, vec(st.scores)),
          cells,
        ),
        { block: i },
      ),
    );
  });
  fill(table, head, body);
}

function renderRowTable(table, last) {
  const stop = last ? last.stop : 0;
  const head = h(
    "thead",
    {},
    h("tr", {}, ["s2.thPos", "s2.thScore", "s2.thV", "s2.thProb", "s2.thRead"].map((key, i) => h("th", { class: i === 3 ? "num-col" : "" }, t(key)))),
  );
  const body = h("tbody");
  data.scores.forEach((score, j) => {
    body.append(
      hoverable(
        h(
          "tr",
          { class: j < stop ? "read" : "future", "data-pos": j },
          h("td", {}, String(j)),
          h("td", {}, num(score)),
          h("td", {}, vec(data.values[j])),
          h("td", { class: "num-col" }, num(data.p[j]), h("span", { class: "pbar", style: `width:${(60 * data.p[j]).toFixed(1)}px` })),
          h("td", {}, j < stop ? "\u2713" : ""),
        ),
        { pos: j },
      ),
    );
  });
  fill(table, head, body);
}

function renderAverage() {
  const show = get("avg") === "1";
  document.getElementById("ledger-avg").hidden = !show;
  if (!show) return;
  const pb = data.per_block;
  const head = h("thead", {}, h("tr", {}, ["s2.thBlock", "s2.thScores", "s2.thSoftmaxIn", "s2.thBlockOut"].map((key) => h("th", {}, t(key)))));
  const body = h("tbody");
  data.steps.forEach((st, i) => {
    body.append(h("tr", {}, h("td", {}, String(i + 1)), h("td", {}, vec(st.scores)), h("td", {}, vec(pb.softmax[i])), h("td", {}, vec(pb.outputs[i]))));
  });
  fill(document.getElementById("ledger-avg-table"), head, body);
  fill(
    document.getElementById("ledger-avg-readouts"),
    readout("avg", "s2.avg", vec(pb.average), "wide"),
    readout("reference-avg", "s2.reference", vec(data.o), "wide"),
    readout("avg-diff", "s2.avgDiff", num(pb.max_diff), "bad"),
  );
}

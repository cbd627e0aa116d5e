// Section 02's picture of one row: the scores as bars (drag one to change it), the running
// max m as a line, and below it exp(s_j − m) of every position read so far, with their sum
// ℓ and the accumulator a beside. When a block brings a larger score, m moves up and the
// old terms shrink by α = exp(m_old − m_new) before the new block's terms are added.
// Every number drawn comes from the engine's answer (data.steps[].weights, m, ℓ, acc).

import { fmtNumber, labelFormat, s } from "./fmt.js";
import { PHASE } from "./formula.js";
import { t } from "./i18n.js";
import { animate } from "./widgets.js";

const T0 = 6; // top of the score panel
const TOP_H = 150; // its height
const LABEL_ROOM = 22; // kept free above the highest bar and under the lowest for their labels
const BOTTOM_H = 104;
const GAP = 60; // index and block labels, then the exp(s − m) title, each on a row of its own
const DIGIT_W = 6.7; // width of one character of the 11 px monospaced labels
const MIN_LEFT = 36;
const SIDE = 92;
const CHAR_W = 7.3; // width of one character of the 12 px monospaced labels

let svg = null;
let drag = null;
let handlers = { onScore: () => {}, onNudge: () => {}, onDragEnd: () => {}, onHover: () => {} };

/** A round step for an axis that spans `span`. */
function niceStep(span) {
  const p = 10 ** Math.floor(Math.log10(span));
  return [1, 2, 5, 10].map((m) => m * p).find((x) => span / x <= 5) ?? 10 * p;
}

/**
 * The score axis: its range and the value the bars stand on. Near zero (or across it) the
 * bars stand on 0, a signed picture; a row far from zero (a large shift) gets a floor just
 * under its smallest value, so the bars stay in their panel and still differ.
 */
function scoreScale(values) {
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  const span = Math.max(hi - lo, 1e-9);
  const nearZero = (lo <= 0 && hi >= 0) || (lo > 0 && lo <= 2 * span) || (hi < 0 && -hi <= 2 * span);
  let base = 0;
  if (nearZero) {
    lo = Math.min(lo, 0);
    hi = Math.max(hi, 0);
  } else if (hi > 0) {
    const step = niceStep(span);
    base = Math.floor((lo - 0.25 * span) / step) * step;
    lo = base;
  } else {
    const step = niceStep(span);
    base = Math.ceil((hi + 0.25 * span) / step) * step;
    hi = base;
  }
  if (hi - lo < 1e-9) (lo -= 1), (hi += 1);
  return { lo, hi, base, broken: !nearZero };
}

/**
 * Draw the row into `holder` at 1:1 scale. `prev` is the step shown before (animate when
 * one block was added). `onScore(j, value)` is called while a bar is dragged (value in
 * the shifted scores the engine saw), `onNudge(j, delta)` when a handle's arrow key moves
 * score j, `onHover(j | null)` when a bar is hovered. The handle that has the keyboard
 * focus keeps it across redraws.
 */
export function drawRowChart(holder, data, step, prev, callbacks) {
  handlers = callbacks;
  const { onNudge, onHover } = callbacks;
  const focused = svg && svg.contains(document.activeElement) ? document.activeElement.getAttribute("data-handle") : null;
  const width = Math.max(300, holder.clientWidth || 600);
  const n = data.scores.length;
  const last = step > 0 ? data.steps[step - 1] : null;
  const stop = last ? last.stop : 0;
  const shown = data.scores.map((x, j) => (drag && drag.j === j ? drag.value : x));
  const mValues = data.steps.map((st) => st.m);
  const scale = scoreScale([...shown, ...mValues]);
  const label = labelFormat([...shown, ...mValues, scale.base]);
  // margins: the axis labels on the left, the m label in a gutter of its own, ℓ and a beside
  const LEFT = Math.max(MIN_LEFT, 10 + CHAR_W * label(scale.base).length);
  const mLabel = last ? `m = ${label(last.m)}` : "";
  const gutter = 14 + CHAR_W * Math.max(5, ...mValues.map((m) => `m = ${label(m)}`.length));
  const sideW = width >= 420 ? SIDE : 74;
  const plotW = Math.max(60, width - LEFT - gutter - sideW - 10);
  const bw = plotW / n;
  const T1 = T0 + TOP_H;
  const by = T1 + GAP; // top of the exp(s − m) panel
  const height = by + BOTTOM_H + 24;
  if (!svg || !holder.contains(svg)) {
    svg = s("svg", { class: "row-chart", role: "img" });
    holder.replaceChildren(svg);
    svg.addEventListener("pointermove", (ev) => drag && moveDrag(ev));
    svg.addEventListener("pointerup", (ev) => drag && endDrag(ev));
    svg.addEventListener("pointercancel", (ev) => drag && endDrag(ev));
  }
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("aria-label", t("s2.chartLabel"));
  const yTop = (v) => T0 + LABEL_ROOM + ((TOP_H - 2 * LABEL_ROOM) * (scale.hi - v)) / (scale.hi - scale.lo);
  const x = (j) => LEFT + j * bw;
  const g = s("g", {});

  // blocks: bands behind the bars, the current one marked
  data.blocks.forEach(([a, b], i) => {
    const cls = i === step - 1 ? "band current" : i < step ? "band read" : "band";
    g.append(
      s("rect", { x: x(a), y: 4, width: (b - a) * bw, height: by + BOTTOM_H + 8 - 4, class: cls, "data-band": i }),
      bw * (b - a) >= 22 ? s("text", { x: x(a) + ((b - a) * bw) / 2, y: T1 + 30, "text-anchor": "middle", class: "band-label" }, `B${i + 1}`) : null,
    );
  });
  // the line the bars stand on: 0, or the floor of a row far from 0 (marked as a broken axis)
  const y0 = yTop(scale.base);
  g.append(
    s("line", { x1: LEFT, x2: LEFT + plotW, y1: y0, y2: y0, class: "axis-line" }),
    s("text", { x: LEFT - 6, y: y0 + 4, "text-anchor": "end", class: "axis-text", "data-axis": "base" }, label(scale.base)),
    s("text", { x: 4, y: 16, class: "axis-title" }, "s"),
  );
  if (scale.broken) {
    g.append(s("path", { d: `M${LEFT - 4} ${y0 - 9} l4 -3 l-4 -3 l4 -3`, class: "axis-break" }));
  }
  // the score bars, draggable; value labels only when every one fits its column
  const r = Math.max(4, Math.min(8, bw * 0.3));
  const valueLabels = Math.max(...shown.map((v) => label(v).length)) * DIGIT_W + 4 <= bw;
  const indexLabels = String(n - 1).length * DIGIT_W + 2 <= bw;
  const valueGroup = s("g", { class: "score-values" }); // drawn over the m line
  shown.forEach((v, j) => {
    const y1 = yTop(v);
    const read = j < stop;
    const inCurrent = last && j >= last.start && j < last.stop;
    const up = v >= scale.base;
    const bar = s("g", { class: `score${read ? " read" : ""}${inCurrent ? " current" : ""}`, "data-pos": j });
    bar.append(
      s("rect", { x: x(j) + bw * 0.18, y: Math.min(y0, y1), width: bw * 0.64, height: Math.max(Math.abs(y1 - y0), 1), class: "score-bar" }),
      s("rect", { x: x(j), y: T0 - 2, width: bw, height: TOP_H + 4, class: "score-hit" }),
    );
    const handle = s("circle", {
      cx: x(j) + bw / 2,
      cy: y1,
      r,
      class: "score-handle",
      tabindex: 0,
      role: "slider",
      "aria-label": t("s2.dragLabel", { pos: j }),
      "aria-valuenow": String(v),
      "aria-valuetext": label(v),
      "data-handle": j,
    });
    bar.append(handle);
    // on a touch screen the page scrolls except from a handle, which drags its bar
    handle.addEventListener("touchstart", (ev) => ev.preventDefault(), { passive: false });
    if (valueLabels) {
      // on a light ground of its own, so that the m line never runs through the digits
      const ty = up ? y1 - r - 4 : y1 + r + 12;
      const tw = label(v).length * DIGIT_W + 4;
      valueGroup.append(
        s("rect", { x: x(j) + bw / 2 - tw / 2, y: ty - 10, width: tw, height: 13, rx: 2, class: "score-text-bg" }),
        s("text", { x: x(j) + bw / 2, y: ty, "text-anchor": "middle", class: "score-text", "data-pos": j }, label(v)),
      );
    }
    if (indexLabels) bar.append(s("text", { x: x(j) + bw / 2, y: T1 + 14, "text-anchor": "middle", class: "pos-text" }, String(j)));
    bar.addEventListener("pointerdown", (ev) => {
      if (ev.pointerType !== "touch" || ev.target === handle) startDrag(ev, j, v, scale);
    });
    bar.addEventListener("pointerenter", () => onHover(j));
    bar.addEventListener("pointerleave", () => onHover(null));
    handle.addEventListener("keydown", (ev) => {
      const delta = ev.key === "ArrowUp" ? 0.1 : ev.key === "ArrowDown" ? -0.1 : 0;
      if (!delta) return;
      ev.preventDefault();
      onNudge(j, (ev.shiftKey ? 10 : 1) * delta);
    });
    g.append(bar);
  });
  // the running max after this step; its label sits in the gutter right of the bars
  let mLine = null;
  if (last) {
    const ym = yTop(last.m);
    mLine = s(
      "g",
      { class: "m-line" },
      s("line", { x1: LEFT, x2: x(stop), y1: ym, y2: ym }),
      stop < n ? s("line", { x1: x(stop), x2: LEFT + plotW + 4, y1: ym, y2: ym, class: "m-leader" }) : null,
      s("text", { x: LEFT + plotW + 8, y: ym + 4, class: "m-text" }, mLabel),
    );
    g.append(mLine);
  }
  g.append(valueGroup);

  // exp(s_j − m) of the positions read, 0..1
  const yBot = (v) => by + BOTTOM_H * (1 - v);
  g.append(
    s("line", { x1: LEFT, x2: LEFT + plotW, y1: yBot(0), y2: yBot(0), class: "axis-line" }),
    s("line", { x1: LEFT, x2: LEFT + plotW, y1: yBot(1), y2: yBot(1), class: "axis-line faint" }),
    s("text", { x: LEFT - 6, y: yBot(1) + 4, "text-anchor": "end", class: "axis-text" }, "1"),
    s("text", { x: LEFT - 6, y: yBot(0) + 4, "text-anchor": "end", class: "axis-text" }, "0"),
    s("text", { x: 4, y: by - 14, class: "axis-title" }, t("s2.chartWeights")),
  );
  const grew = last && prev === step - 1;
  const weights = last ? last.weights : [];
  const oldStop = grew ? last.start : stop;
  const alpha = last ? last.alpha : 1;
  const bars = [];
  weights.forEach((w, j) => {
    const bar = s("rect", {
      x: x(j) + bw * 0.18,
      y: yBot(w),
      width: bw * 0.64,
      height: Math.max(yBot(0) - yBot(w), 0.5),
      class: j >= (last?.start ?? 0) ? "weight grow-up new" : "weight grow-up",
      "data-weight": j,
      "data-value": String(w),
    });
    bar.append(s("title", {}, `exp(s${j} \u2212 m) = ${w}`));
    bars.push(bar);
    g.append(bar);
  });

  // beside: ℓ as the stack of those terms, and the accumulator's components
  const sx = LEFT + plotW + gutter + 4;
  const maxEll = Math.max(...data.steps.map((st) => st.ell), 1);
  const ellTop = 40; // under the ℓ title and its value
  const ellH = yBot(0) - ellTop;
  const yEll = (v) => ellTop + ellH * (1 - v / maxEll);
  g.append(s("text", { x: sx, y: 14, class: "axis-title" }, "\u2113"));
  let acc0 = 0;
  const segs = [];
  weights.forEach((w, j) => {
    const seg = s("rect", { x: sx, y: yEll(acc0 + w), width: 22, height: Math.max(yEll(acc0) - yEll(acc0 + w), 0.5), class: j >= (last?.start ?? 0) ? "ell-seg grow-up new" : "ell-seg grow-up", "data-seg": j });
    acc0 += w;
    segs.push(seg);
    g.append(seg);
  });
  if (last) g.append(s("text", { x: sx, y: 30, class: "ell-text", "data-ell": String(last.ell) }, fmtNumber(last.ell, 4)));
  // a: one signed bar per component (first 4)
  const dv = Math.min(data.d_v, 4);
  const accs = data.steps.flatMap((st) => st.acc.slice(0, dv));
  const accScale = Math.max(1e-9, ...accs.map(Math.abs));
  const ax = sx + 40;
  const aw = Math.max(8, (sideW - 52) / dv - 3);
  const mid = ellTop + ellH / 2;
  g.append(s("text", { x: ax, y: 14, class: "axis-title" }, "a"), s("line", { x1: ax, x2: ax + dv * (aw + 3), y1: mid, y2: mid, class: "axis-line" }));
  const accBars = [];
  for (let c = 0; c < dv; c++) {
    const value = last ? last.acc[c] : 0;
    const hgt = (Math.abs(value) / accScale) * (ellH / 2 - 4);
    const bar = s("rect", { x: ax + c * (aw + 3), y: value >= 0 ? mid - hgt : mid, width: aw, height: Math.max(hgt, 0.5), class: `acc-bar ${value >= 0 ? "grow-up" : "grow-down"}`, "data-acc": c });
    bar.append(s("title", {}, `a${c} = ${value}`));
    accBars.push(bar);
    g.append(bar);
  }
  svg.replaceChildren(g);
  if (focused !== null) svg.querySelector(`[data-handle="${focused}"]`)?.focus({ preventScroll: true });

  // step animation: m moves, the old terms shrink by α, the new block's terms grow
  if (grew && !drag) {
    if (mLine && Number.isFinite(last.m_before)) {
      animate(mLine, [{ transform: `translateY(${yTop(last.m_before) - yTop(last.m)}px)` }, { transform: "none" }], { duration: PHASE });
    }
    const shrink = alpha > 0 && alpha < 1;
    bars.forEach((bar, j) => {
      const isOld = j < oldStop;
      if (isOld && shrink) animate(bar, [{ transform: `scaleY(${1 / alpha})` }, { transform: "none" }], { duration: PHASE, delay: PHASE });
      if (!isOld) animate(bar, [{ transform: "scaleY(0)" }, { transform: "none" }], { duration: PHASE, delay: 2 * PHASE });
    });
    segs.forEach((seg, j) => {
      if (j >= oldStop) animate(seg, [{ opacity: 0 }, { opacity: 1 }], { duration: PHASE, delay: 2 * PHASE });
      else if (shrink) animate(seg, [{ transform: `scaleY(${1 / alpha})` }, { transform: "none" }], { duration: PHASE, delay: PHASE });
    });
    const before = step > 1 ? data.steps[step - 2].acc : null;
    accBars.forEach((bar, c) => {
      if (!before || Math.abs(last.acc[c]) < 1e-300) return;
      const ratio = (before[c] * alpha) / last.acc[c];
      if (Number.isFinite(ratio) && ratio > 0) animate(bar, [{ transform: `scaleY(${before[c] / last.acc[c]})` }, { transform: `scaleY(${ratio})` }, { transform: "none" }], { duration: 2 * PHASE, delay: PHASE });
    });
  }
}

function startDrag(ev, j, v, scale) {
  if (ev.button !== 0) return;
  ev.preventDefault();
  svg.setPointerCapture(ev.pointerId);
  drag = { j, value: v, y0: ev.clientY, v0: v, perPx: (scale.hi - scale.lo) / (TOP_H - 2 * LABEL_ROOM) };
}

function moveDrag(ev) {
  const value = Math.round((drag.v0 + (drag.y0 - ev.clientY) * drag.perPx) * 10) / 10;
  if (value === drag.value) return;
  drag.value = value;
  handlers.onScore(drag.j, value);
}

function endDrag(ev) {
  if (svg.hasPointerCapture?.(ev.pointerId)) svg.releasePointerCapture(ev.pointerId);
  drag = null;
  handlers.onDragEnd();
}

/** True while a score bar is being dragged (the page then keeps the picture it has). */
export function dragging() {
  return drag !== null;
}

// The heat map of section 04: one cell per (query, key), the tile grid over it, and the
// cells filled as the tiles are stepped through. It is built once per answer and then
// changed in place: a step fills (or, going back, empties) only the cells of the tiles
// between the old step and the new one, so a 64 × 64 map in 1 × 1 tiles costs one cell
// per step. One shared tooltip replaces a title per cell, and hovering reports the cell
// so that the section can light the rows it touches.

import { fmtNumber, h, s } from "./fmt.js";
import { PHASE } from "./formula.js";
import { t } from "./i18n.js";
import { animate } from "./widgets.js";

const MAX_TILE_OUTLINES = 400;
const PENDING = "#fbfbfa";

export function heatColor(p) {
  const light = 97 - 66 * Math.pow(Math.min(Math.max(p, 0), 1), 0.6);
  return `hsl(174 55% ${light.toFixed(1)}%)`;
}

export class HeatMap {
  /** `onHover({cell: [i, j]} | null)` is called as the pointer moves over the cells. */
  constructor(holder, { onHover }) {
    this.holder = holder;
    this.onHover = onHover;
    this.tip = h("div", { class: "heat-tip", hidden: true });
    this.data = null;
  }

  /** Build the map for `steps` (each {q_range, k_range, values}); `label(i, j, value, n)` names a cell. */
  build(data, steps, label, width) {
    this.data = data;
    this.steps = steps;
    this.label = label;
    this.shown = 0;
    const { lq, lk } = data;
    const avail = Math.max(120, Math.min(width, 380));
    let cell = Math.floor((avail - 24) / Math.max(lq, lk));
    cell = Math.max(3, Math.min(56, cell));
    const pad = cell >= 14 ? 22 : 4;
    this.cell = cell;
    this.pad = pad;
    const wpx = pad + lk * cell + 2;
    const hpx = pad + lq * cell + 2;
    const svg = s("svg", { width: wpx, height: hpx, viewBox: `0 0 ${wpx} ${hpx}`, class: "heat", role: "img", "aria-label": t("s4.heatLabel") });
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
    const cells = s("g", { class: "cells" });
    this.rects = [];
    this.texts = [];
    this.drops = [];
    const showText = cell >= 36;
    for (let i = 0; i < lq; i++) {
      for (let j = 0; j < lk; j++) {
        const visible = data.mask[i][j];
        const r = s("rect", {
          x: pad + j * cell,
          y: pad + i * cell,
          width: cell,
          height: cell,
          fill: visible ? PENDING : "url(#hatch)",
          class: visible ? "cell" : "cell masked",
          "data-cell": `${i},${j}`,
        });
        cells.append(r);
        this.rects.push(r);
        if (!visible && cell >= 12) {
          cells.append(s("text", { x: pad + j * cell + cell / 2, y: pad + i * cell + cell / 2 + 4, "text-anchor": "middle", class: "heat-x" }, "\u00d7"));
        }
        if (showText && visible) {
          const tx = s("text", { x: pad + j * cell + cell / 2, y: pad + i * cell + cell / 2 + 4, "text-anchor": "middle", class: "heat-num" });
          cells.append(tx);
          this.texts[i * lk + j] = tx;
        }
        if (data.keep && visible && !data.keep[i][j]) {
          const dot = s("circle", { cx: pad + j * cell + cell - 5, cy: pad + i * cell + 5, r: Math.min(2.5, cell / 4), class: "heat-drop", visibility: "hidden" });
          cells.append(dot);
          this.drops[i * lk + j] = dot;
        }
      }
    }
    svg.append(cells);
    // the tile grid: one outline per tile when there are few, else the grid lines
    const tiles = s("g", { class: "tiles" });
    const nt = data.q_tiles.length * data.k_tiles.length;
    if (nt <= MAX_TILE_OUTLINES) {
      data.q_tiles.forEach(([a, b], ti) => {
        data.k_tiles.forEach(([c, d], tj) => {
          const kind = data.tile_kinds[ti][tj];
          tiles.append(
            s("rect", { x: pad + c * cell, y: pad + a * cell, width: (d - c) * cell, height: (b - a) * cell, class: kind === "empty" ? "tile skipped" : "tile", "data-tile": `${ti},${tj}` }),
          );
        });
      });
    } else {
      let d = "";
      for (const [a] of data.q_tiles) d += `M${pad} ${pad + a * cell}H${pad + lk * cell}`;
      for (const [c] of data.k_tiles) d += `M${pad + c * cell} ${pad}V${pad + lq * cell}`;
      d += `M${pad} ${pad + lq * cell}H${pad + lk * cell}M${pad + lk * cell} ${pad}V${pad + lq * cell}`;
      tiles.append(s("path", { d, class: "tile-lines" }));
    }
    svg.append(tiles);
    this.links = s("g", { class: "links" });
    this.current = s("rect", { class: "tile current", visibility: "hidden" });
    svg.append(this.links, this.current);
    if (pad > 4) {
      const axis = s("g", { class: "axes" });
      const every = cell >= 22 ? 1 : Math.ceil(22 / cell);
      for (let j = 0; j < lk; j += every) axis.append(s("text", { x: pad + j * cell + cell / 2, y: 14, "text-anchor": "middle", class: "axis" }, `k${j}`));
      for (let i = 0; i < lq; i += every) axis.append(s("text", { x: pad - 4, y: pad + i * cell + cell / 2 + 4, "text-anchor": "end", class: "axis" }, `q${i}`));
      svg.append(axis);
    }
    svg.addEventListener("pointermove", (ev) => this.pointer(ev));
    svg.addEventListener("pointerleave", () => this.leave());
    this.svg = svg;
    this.holder.replaceChildren(svg, this.tip);
  }

  cellAt(ev) {
    const box = this.svg.getBoundingClientRect();
    const j = Math.floor((ev.clientX - box.left - this.pad) / this.cell);
    const i = Math.floor((ev.clientY - box.top - this.pad) / this.cell);
    return i >= 0 && j >= 0 && i < this.data.lq && j < this.data.lk ? [i, j] : null;
  }

  pointer(ev) {
    const at = this.cellAt(ev);
    if (!at) return this.leave();
    const [i, j] = at;
    if (this.hovered && this.hovered[0] === i && this.hovered[1] === j) return this.placeTip(ev);
    this.hovered = at;
    this.tip.textContent = this.label(i, j, this.value(i, j), this.stepOf(i, j));
    this.tip.hidden = false;
    this.placeTip(ev);
    this.onHover({ cell: at });
  }

  placeTip(ev) {
    const box = this.holder.getBoundingClientRect();
    const x = Math.min(ev.clientX - box.left + 12, Math.max(0, box.width - this.tip.offsetWidth));
    this.tip.style.left = `${x}px`;
    this.tip.style.top = `${ev.clientY - box.top + 14}px`;
  }

  leave() {
    if (!this.hovered) return;
    this.hovered = null;
    this.tip.hidden = true;
    this.onHover(null);
  }

  /** The 1-based step that fills cell (i, j), or 0 when no step does. */
  stepOf(i, j) {
    const n = this.steps.findIndex((st) => i >= st.q_range[0] && i < st.q_range[1] && j >= st.k_range[0] && j < st.k_range[1]);
    return n + 1;
  }

  value(i, j) {
    const n = this.stepOf(i, j);
    if (!n || n > this.shown) return null;
    const st = this.steps[n - 1];
    return st.values[i - st.q_range[0]][j - st.k_range[0]];
  }

  paint(st, on) {
    const { lk } = this.data;
    st.values.forEach((row, r) =>
      row.forEach((x, c) => {
        const i = st.q_range[0] + r;
        const j = st.k_range[0] + c;
        if (!this.data.mask[i][j]) return;
        const idx = i * lk + j;
        const rect = this.rects[idx];
        rect.setAttribute("fill", on ? heatColor(x) : PENDING);
        rect.classList.toggle("filled", on);
        const text = this.texts[idx];
        if (text) {
          text.textContent = on ? x.toFixed(2) : "";
          text.setAttribute("class", on && x > 0.45 ? "heat-num dark" : "heat-num");
        }
        this.drops[idx]?.setAttribute("visibility", on ? "visible" : "hidden");
      }),
    );
  }

  /** Show the first `n` steps filled and step n's tile outlined; animate one step forward. */
  show(n) {
    const before = this.shown;
    if (n > before) for (let k = before; k < n; k++) this.paint(this.steps[k], true);
    else for (let k = before - 1; k >= n; k--) this.paint(this.steps[k], false);
    this.shown = n;
    const st = n > 0 ? this.steps[n - 1] : null;
    if (!st) {
      this.current.setAttribute("visibility", "hidden");
    } else {
      this.outline(this.current, st.q_range, st.k_range);
      this.current.setAttribute("visibility", "visible");
    }
    if (st && n === before + 1) {
      const { lk } = this.data;
      const fresh = [];
      for (let i = st.q_range[0]; i < st.q_range[1]; i++) for (let j = st.k_range[0]; j < st.k_range[1]; j++) fresh.push(this.rects[i * lk + j]);
      for (const rect of fresh) animate(rect, [{ opacity: 0.05 }, { opacity: 1 }], { duration: PHASE, delay: 0 });
      animate(this.current, [{ strokeWidth: 7, opacity: 0.3 }, { strokeWidth: 3.5, opacity: 1 }], { duration: PHASE });
    }
    if (this.hovered) this.tip.textContent = this.label(...this.hovered, this.value(...this.hovered), this.stepOf(...this.hovered));
  }

  outline(rect, [a, b], [c, d]) {
    rect.setAttribute("x", this.pad + c * this.cell);
    rect.setAttribute("y", this.pad + a * this.cell);
    rect.setAttribute("width", (d - c) * this.cell);
    rect.setAttribute("height", (b - a) * this.cell);
  }

  /** Outline what a hovered row, column or tile covers: {rows: [a, b), cols: [c, d)}. */
  highlight(spec) {
    if (!this.links) return;
    this.links.replaceChildren();
    if (!spec || !this.data) return;
    const rows = spec.rows ?? [0, this.data.lq];
    const cols = spec.cols ?? [0, this.data.lk];
    const rect = s("rect", { class: spec.rows && spec.cols ? "link tile-link" : "link band-link", "data-link": `${rows[0]},${rows[1]},${cols[0]},${cols[1]}` });
    this.outline(rect, rows, cols);
    this.links.append(rect);
  }
}

/** A number for the tooltip: 6 significant digits. */
export function tipNumber(x) {
  return fmtNumber(x);
}

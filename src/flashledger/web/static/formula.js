// Formula lines that light up with the step that uses them.
//
// Formulas are MathML rendered on the server; each <math> carries data-formula="name"
// and each line (<mtr>) data-line="n". A step says which lines it uses; they stay lit
// (class "lit") while that step is shown. With motion allowed, the lines first light
// one phase after another (class "lit-now"), in the order the step computes them.

import { reducedMotion } from "./widgets.js";

const PHASE_MS = 380;
const timers = new WeakMap();

function lines(root, name, numbers) {
  const math = root.querySelector(`math[data-formula="${name}"]`);
  if (!math) return [];
  return numbers.map((n) => math.querySelector(`mtr[data-line="${n}"]`)).filter(Boolean);
}

/**
 * Light the lines a step uses under `root`. `phases` is a list of {formula: [line, ...]}
 * maps in computing order; every line named in any phase stays lit, and with motion the
 * phases light in turn. `extra` adds a class to some lines: {cls: {formula: [line, ...]}}.
 */
export function lightUp(root, phases, extra = {}) {
  clearTimeout(timers.get(root));
  for (const el of root.querySelectorAll("mtr.lit, mtr.lit-now, mtr.lit-strong, math.used")) {
    el.classList.remove("lit", "lit-now", "lit-strong");
    if (el.tagName.toLowerCase() === "math") el.classList.remove("used");
  }
  const groups = phases.map((phase) => Object.entries(phase).flatMap(([name, numbers]) => lines(root, name, numbers)));
  for (const group of groups) {
    for (const line of group) {
      line.classList.add("lit");
      line.closest("math")?.classList.add("used");
    }
  }
  for (const [cls, spec] of Object.entries(extra)) {
    for (const [name, numbers] of Object.entries(spec)) for (const line of lines(root, name, numbers)) line.classList.add(cls);
  }
  if (reducedMotion() || groups.length < 2) return;
  let n = 0;
  const next = () => {
    for (const line of root.querySelectorAll("mtr.lit-now")) line.classList.remove("lit-now");
    if (n >= groups.length) return;
    for (const line of groups[n]) line.classList.add("lit-now");
    n += 1;
    timers.set(root, setTimeout(next, PHASE_MS));
  };
  next();
}

/** Milliseconds one phase of a step lasts (animations of the pictures follow the same beat). */
export const PHASE = PHASE_MS;

// Section 01: the update formulas, and what each symbol holds at the ledger's current step.

import { fill, h, num, vec } from "./fmt.js";
import { lightUp } from "./formula.js";
import { t } from "./i18n.js";
import * as ledger from "./ledger.js";
import { set } from "./state.js";

export function init(ctx) {
  ctx.bus.addEventListener("ledger", render);
  document.getElementById("s1-open-ledger").addEventListener("click", (event) => {
    event.preventDefault();
    set({ sec: "ledger" });
  });
}

export function shown() {}

export function render() {
  const snap = ledger.snapshot();
  const title = document.getElementById("s1-live-title");
  const table = document.getElementById("s1-live");
  if (!snap) {
    fill(title);
    fill(table);
    return;
  }
  const { data, step } = snap;
  lightUp(document.getElementById("sec-running"), ledger.formulaPhases(step), ledger.formulaMarks(step));
  const last = step > 0 ? data.steps[step - 1] : null;
  title.textContent = last ? t("s1.liveTitle", { step }) : t("s1.liveEmpty");
  const dash = () => h("span", { class: "muted" }, "\u2014");
  const rows = [
    ["m", "s1.m", num(last ? last.m : -Infinity)],
    ["\u2113", "s1.ell", num(last ? last.ell : 0)],
    ["a", "s1.acc", last ? vec(last.acc) : vec(new Array(data.d_v).fill(0))],
    ["\u03b1", "s1.alpha", last ? num(last.alpha) : dash()],
    ["o", "s1.o", last ? vec(last.o) : dash()],
  ];
  fill(
    table,
    h("thead", {}, h("tr", {}, h("th", {}, t("s1.symbol")), h("th", {}, t("s1.meaningCol")), h("th", {}, t("s1.value")))),
    h(
      "tbody",
      {},
      rows.map(([sym, key, value]) => h("tr", {}, h("td", { class: "sym" }, sym), h("td", { class: "small" }, t(key)), h("td", {}, value))),
    ),
  );
}

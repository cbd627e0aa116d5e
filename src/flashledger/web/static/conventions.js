// Section 06: the seed's queries under every conventions preset; how each reports a
// fully-masked row and aligns a causal mask when Lq != Lk.

import { latest, post } from "./api.js";
import { fill, h, num, vec } from "./fmt.js";
import { t } from "./i18n.js";
import { get, subscribe } from "./state.js";
import { bindInput, clearErrors, parseIntField, showErrors, showFieldError } from "./widgets.js";

let section;
let examples;
let data = null;
const sequence = latest();

export function init(ctx) {
  examples = ctx.examples.backward;
  section = document.getElementById("sec-conventions");
  const lk = document.getElementById("f-c-lk");
  lk.max = String(examples.k.length);
  const bindings = [bindInput(lk, "clk"), bindInput(document.getElementById("f-c-mask"), "cmask", { event: "change" })];
  subscribe((changes) => {
    if ("clk" in changes || "cmask" in changes) {
      for (const b of bindings) b.sync(changes);
      compute();
    }
  });
  compute();
}

export function shown() {}

function maskSpec(lq, lk) {
  const kind = get("cmask");
  if (kind !== "masked_row") return { kind };
  const row = Math.min(2, lq - 1);
  const dense = Array.from({ length: lq }, (_r, i) => Array.from({ length: lk }, (_c, j) => i !== row && j <= i));
  return { kind: "custom", dense };
}

async function compute() {
  const lk = parseIntField(get("clk"));
  const most = examples.k.length;
  if (lk === null || lk < 1 || lk > most) return showFieldError(section, "k", "err.range", { min: 1, max: most });
  const lq = examples.q.length;
  const body = {
    q: examples.q,
    k: examples.k.slice(0, lk),
    v: examples.v.slice(0, lk),
    mask: maskSpec(lq, lk),
    block_q: Math.min(2, lq),
    block_k: Math.min(2, lk),
  };
  const answer = await sequence(post("/api/conventions", body));
  if (answer === null) return;
  if (!answer.ok) {
    return showErrors(section, document.getElementById("conv-error"), answer);
  }
  clearErrors(section);
  data = answer.data;
  render();
}

export function render() {
  const table = document.getElementById("conv-table");
  if (!data) return fill(table);
  const rows = data.presets[0].rows.length;
  const head = h(
    "thead",
    {},
    h(
      "tr",
      {},
      h("th", {}, t("s6.thPreset")),
      h("th", { class: "num-col" }, t("s6.thMaskedLse")),
      Array.from({ length: rows }, (_x, i) => h("th", {}, t("s6.thRow", { row: i }))),
      h("th", { class: "num-col" }, t("s6.diff")),
    ),
  );
  const body = h("tbody");
  for (const preset of data.presets) {
    body.append(
      h(
        "tr",
        { "data-preset": preset.name },
        h(
          "td",
          { title: preset.description },
          h("code", {}, preset.name),
          h("div", { class: "muted small" }, `${t("s6.thAlign")}: ${preset.causal_align.replace("_", "-")}`),
        ),
        h("td", { class: "num-col" }, num(preset.masked_row_lse)),
        preset.rows.map((row) =>
          h(
            "td",
            { class: `conv-cell ${row.fully_masked ? "masked-cell" : ""}`, "data-row": row.row, title: row.fully_masked ? t("s6.empty") : null },
            h("div", { "data-col": "lse" }, h("span", { class: "muted small" }, `${t("s6.lse")} `), num(row.lse)),
            h("div", { "data-col": "o" }, h("span", { class: "muted small" }, `${t("s6.o")} `), vec(row.o)),
          ),
        ),
        h("td", { class: "num-col" }, num(Math.max(...preset.rows.map((r) => r.max_diff)))),
      ),
    );
  }
  fill(table, head, body);
}

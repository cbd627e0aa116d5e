// Section 06: the seed's queries under every conventions preset; how each reports a
// fully-masked row and aligns a causal mask when Lq != Lk.

import { latest, post } from "./api.js";
import { fill, h, num, vec } from "./fmt.js";
import { t } from "./i18n.js";
import { get, getDefault, subscribe } from "./state.js";
import { alignText, bindInput, keepToOptions, parseIntField, presetText, resultShown, showErrors, showFieldError, staleNote } from "./widgets.js";

let section;
let examples;
let data = null;
let shownReq = null; // {lk, mask} of the result shown
const sequence = latest();

export function init(ctx) {
  examples = ctx.examples.backward;
  section = document.getElementById("sec-conventions");
  const lk = document.getElementById("f-c-lk");
  lk.max = String(examples.k.length);
  keepToOptions(document.getElementById("f-c-mask"), "cmask");
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

function maskSpec(lq, lk, kind) {
  if (kind !== "masked_row") return { kind };
  const row = Math.min(2, lq - 1);
  const dense = Array.from({ length: lq }, (_r, i) => Array.from({ length: lk }, (_c, j) => i !== row && j <= i));
  return { kind: "custom", dense };
}

/** The request for `read(key)` (the fields' state, or the defaults): {body, lk, mask} or {error}. */
function request(read) {
  const lk = parseIntField(read("clk"));
  const most = examples.k.length;
  if (lk === null || lk < 1 || lk > most) return { field: "k", error: ["err.range", { min: 1, max: most }] };
  const lq = examples.q.length;
  const body = {
    q: examples.q,
    k: examples.k.slice(0, lk),
    v: examples.v.slice(0, lk),
    mask: maskSpec(lq, lk, read("cmask")),
    block_q: Math.min(2, lq),
    block_k: Math.min(2, lk),
  };
  return { body, lk, mask: read("cmask") };
}

async function compute() {
  const req = request(get);
  if (req.error) {
    showFieldError(section, req.field, ...req.error);
    return fallback();
  }
  const answer = await sequence(post("/api/conventions", req.body));
  if (answer === null) return;
  if (!answer.ok) {
    showErrors(section, document.getElementById("conv-error"), answer);
    return fallback();
  }
  accept(answer.data, req, false);
}

/** Inputs refused before anything was shown: the default table, the errors beside the fields. */
async function fallback() {
  if (data) return;
  const req = request(getDefault);
  const answer = await sequence(post("/api/conventions", req.body));
  if (answer?.ok) accept(answer.data, req, true);
}

function accept(result, req, isDefault) {
  resultShown(section, { fallback: isDefault });
  data = result;
  shownReq = { lk: req.lk, mask: req.mask };
  render();
}

export function render() {
  const table = document.getElementById("conv-table");
  const config = document.getElementById("conv-config");
  if (!data) return fill(table), fill(config);
  const maskName = document.querySelector(`#f-c-mask option[value="${CSS.escape(shownReq.mask)}"]`)?.textContent ?? shownReq.mask;
  fill(config, staleNote(), `Lk = ${shownReq.lk} \u00b7 ${maskName}`);
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
          { title: presetText(preset) },
          h("code", {}, preset.name),
          h("div", { class: "muted small" }, t("s6.alignLine", { causal: t("s6.thAlign"), align: alignText(preset.causal_align) })),
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

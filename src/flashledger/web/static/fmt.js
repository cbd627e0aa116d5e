// Number formatting and small DOM utilities shared by every section.
//
// Numbers arrive as float64 (JSON numbers; ±Infinity as the strings
// "Infinity"/"-Infinity", decoded in api.js). They are shown with 6
// significant digits; the full value is in the title attribute and in
// data-value, so nothing is lost by rounding for display.

const MINUS = "\u2212";

/** Display text of one float64: 6 significant digits, ±∞ as symbols, proper minus sign. */
export function fmtNumber(x, digits = 6) {
  if (x === Infinity) return "+\u221e";
  if (x === -Infinity) return MINUS + "\u221e";
  if (typeof x !== "number" || Number.isNaN(x)) return "\u2014";
  if (x === 0) return "0";
  const ax = Math.abs(x);
  let s;
  if (ax < 1e-4 || ax >= 1e6) {
    const [mant, exp] = x.toExponential(digits - 1).split("e");
    s = `${trimZeros(mant)}e${exp.replace("+", "")}`;
  } else {
    s = trimZeros(x.toPrecision(digits));
  }
  return s.replace("-", MINUS);
}

/**
 * A formatter for numbers shown side by side (the bars and axis of a chart): plain decimals,
 * never an exponent (1000, 1001 and 1002.5 stay three different labels), with as many
 * decimals as the values need to be told apart and written exactly, up to `most`
 * (more only where two different values would read the same).
 */
export function labelFormat(values, most = 3) {
  const distinct = [...new Set(values.filter(Number.isFinite))];
  const exact = (x, n) => Math.abs(Number(x.toFixed(n)) - x) <= 1e-9 * Math.max(1, Math.abs(x));
  const apart = (n) => new Set(distinct.map((x) => x.toFixed(n))).size === distinct.length;
  let decimals = 0;
  while (decimals < most && !distinct.every((x) => exact(x, decimals))) decimals += 1;
  while (decimals < 8 && !apart(decimals)) decimals += 1;
  return (x) => {
    if (!Number.isFinite(x)) return fmtNumber(x);
    const text = trimZeros(x.toFixed(decimals));
    return (text === "-0" ? "0" : text).replace("-", MINUS);
  };
}

function trimZeros(s) {
  return s.includes(".") ? s.replace(/\.?0+$/, "") : s;
}

/** Full-precision text of one float64 (shortest round-trip form). */
export function fullNumber(x) {
  if (x === Infinity) return "+inf";
  if (x === -Infinity) return "-inf";
  return String(x);
}

/** Create an element: h("td", {class: "num"}, child, ...). Strings become text nodes. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  append(el, children);
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";

/** Create an SVG element with attributes and children. */
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    el.setAttribute(key, value);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** A number as <span class="num" title="full value" data-value="full value">6 digits</span>. */
export function num(x, cls = "") {
  return h(
    "span",
    { class: `num ${cls}`.trim(), title: fullNumber(x), dataset: { value: fullNumber(x) } },
    fmtNumber(x),
  );
}

/** A vector as [a, b, ...] with each entry a num(). */
export function vec(xs) {
  const parts = [];
  xs.forEach((x, i) => {
    if (i) parts.push(", ");
    parts.push(num(x));
  });
  return h("span", { class: "vec" }, "[", parts, "]");
}

/** Replace the children of el. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** Largest |a - b| over two equally shaped nested arrays. */
export function maxAbsDiff(a, b) {
  if (Array.isArray(a)) return a.reduce((m, x, i) => Math.max(m, maxAbsDiff(x, b[i])), 0);
  if (a === b) return 0;
  return Math.abs(a - b);
}

/** Separators people type in either language: U+2212 minus, full-width commas and semicolons. */
function normalise(text) {
  return String(text)
    .replace(/[\u2212\u2012\u2013\uFE63\uFF0D]/g, "-")
    .replace(/[\uFF0C\u3001]/g, ",")
    .replace(/\uFF1B/g, ";")
    .replace(/\uFF0B/g, "+");
}

/**
 * Parse a matrix typed by a person: one row per line ("0.2, -0.3") or the
 * bracket form "[[.2,-.3],[.5,.1]]". Blank lines are skipped. Returns {rows}
 * or {error}: an i18n key plus the values it names. Rows (the lines that hold numbers)
 * and entries count from 1, as the server's errors do; every row needs as many entries
 * as the first.
 */
export function parseMatrix(text) {
  const trimmed = normalise(text).trim();
  if (!trimmed) return { error: ["err.empty", {}] };
  const bracketed = trimmed.startsWith("[");
  const lines = bracketed ? trimmed.replace(/^\[\s*\[/, "[").replace(/\[/g, "").split("]") : trimmed.split(/\n|;/);
  const rows = [];
  for (const line of lines) {
    const body = bracketed ? line.replace(/^[\s,]+|[\s,]+$/g, "") : line.trim();
    if (!body) continue;
    const parsed = parseVector(body);
    const row = rows.length + 1;
    if (parsed.error) {
      const [key, vars] = parsed.error;
      return { error: [`${key}Row`, { ...vars, row }] };
    }
    if (rows.length && parsed.values.length !== rows[0].length) {
      return { error: ["err.k.ragged", { row, got: parsed.values.length, expected: rows[0].length }] };
    }
    rows.push(parsed.values);
  }
  if (!rows.length) return { error: ["err.empty", {}] };
  return { rows };
}

const NUMBER_RE = /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i;

/**
 * Parse "1, 2, -1" (commas, spaces or both; U+2212 minus and full-width commas too) into
 * numbers, or {error}. An empty entry between two commas is an error that says where;
 * one trailing comma is allowed.
 */
export function parseVector(text) {
  const body = normalise(text).trim().replace(/^\[/, "").replace(/\]$/, "").trim();
  if (!body) return { error: ["err.empty", {}] };
  const pieces = body.split(",");
  if (pieces.length > 1 && !pieces[pieces.length - 1].trim()) pieces.pop();
  const values = [];
  for (const piece of pieces) {
    const tokens = piece.trim().split(/\s+/).filter((tok) => tok.length);
    if (!tokens.length) return { error: ["err.emptyEntry", { index: values.length + 1 }] };
    for (const tok of tokens) {
      const index = values.length + 1;
      if (!NUMBER_RE.test(tok)) return { error: ["err.notNumber", { token: tok, index }] };
      const x = Number(tok);
      if (!Number.isFinite(x)) return { error: ["err.notFinite", { token: tok, index }] };
      values.push(x);
    }
  }
  return { values };
}

/** Text of a matrix for a textarea: one row per line. */
export function matrixText(rows) {
  return rows.map((row) => row.map((x) => String(x)).join(", ")).join("\n");
}

/** An integer count with thin-space thousands separators; full value in the title. */
export function count(n) {
  const text = Math.round(n)
    .toString()
    .replace(/\B(?=(\d{3})+(?!\d))/g, "\u2009");
  return h("span", { class: "num", title: String(n), dataset: { value: String(n) } }, text);
}

// Widgets shared by the sections: the stepper, readout cards, errors, typed fields, scroll cues.

import { post } from "./api.js";
import { fill, fmtNumber, h } from "./fmt.js";
import { currentLanguage, has, hasOwn, t } from "./i18n.js";
import { get, getDefault, set } from "./state.js";

const PLAY_INTERVAL_MS = 900;
const steppers = new Map();

/**
 * A stepper bound to the integer state key `key`, running 0..max().
 * `label(step, max)` gives the progress text. Returns {render, current, stop, go, play}.
 */
export function stepper(el, key, max, label) {
  let timer = null;
  const current = () => Math.min(Math.max(parseInt(get(key), 10) || 0, 0), max());
  const go = (step) => set({ [key]: String(Math.min(Math.max(step, 0), max())) });
  const stop = () => {
    if (timer !== null) clearInterval(timer);
    timer = null;
    render();
  };
  const play = () => {
    if (timer !== null) return stop();
    if (current() >= max()) go(0);
    timer = setInterval(() => {
      if (current() >= max()) stop();
      else go(current() + 1);
    }, PLAY_INTERVAL_MS);
    render();
  };
  const buttons = {
    reset: h("button", { type: "button", class: "btn ghost", "data-action": "reset", onclick: () => (stop(), go(0)) }),
    back: h("button", { type: "button", class: "btn ghost", "data-action": "back", onclick: () => (stop(), go(current() - 1)) }),
    forward: h("button", { type: "button", class: "btn", "data-action": "forward", onclick: () => (stop(), go(current() + 1)) }),
    play: h("button", { type: "button", class: "btn ghost", "data-action": "play", onclick: play }),
    end: h("button", { type: "button", class: "btn ghost", "data-action": "end", onclick: () => (stop(), go(max())) }),
  };
  const progress = h("span", { class: "progress-text", "aria-live": "polite" });
  const bar = h("span", { class: "progress-bar" }, h("span", { class: "progress-fill" }));
  const hint = h("span", { class: "key-hint" });
  fill(el, Object.values(buttons), h("span", { class: "progress" }, progress, bar), hint);

  function render() {
    const step = current();
    const total = max();
    buttons.reset.textContent = `\u21e4 ${t("btn.reset")}`;
    buttons.back.textContent = `\u25c0 ${t("btn.back")}`;
    buttons.forward.textContent = `${t("btn.forward")} \u25b6`;
    buttons.play.textContent = timer === null ? `\u25b7 ${t("btn.play")}` : `\u2016 ${t("btn.pause")}`;
    buttons.end.textContent = `${t("btn.end")} \u21e5`;
    buttons.reset.disabled = step === 0;
    buttons.back.disabled = step === 0;
    buttons.forward.disabled = step >= total;
    buttons.end.disabled = step >= total;
    buttons.play.disabled = total === 0;
    buttons.play.setAttribute("aria-pressed", String(timer !== null));
    progress.textContent = label(step, total);
    bar.firstChild.style.width = `${total ? (100 * step) / total : 0}%`;
    hint.textContent = t("btn.keys");
  }
  return { render, current, stop, play, go, playing: () => timer !== null, key };
}

/** Make `ctl` the stepper that ←/→/space drive while section `sec` is shown (a function: chosen late). */
export function registerStepper(sec, ctl) {
  steppers.set(sec, ctl);
}

/** The stepper the keys drive in section `sec`, or null. */
/**
 * The step in state `key` as the stepper shows it (a whole number in 0..total): a link's
 * step past the end, negative or not a number is rewritten to it, so that the URL says
 * what the page shows.
 */
export function normalizeStep(key, total) {
  const shown = String(Math.min(Math.max(parseInt(get(key), 10) || 0, 0), total));
  if (get(key) !== shown) set({ [key]: shown });
}

export function stepperFor(sec) {
  const entry = steppers.get(sec);
  return typeof entry === "function" ? entry() : (entry ?? null);
}

/** A readout card: label on top, value below. `id` names it for tests and links. */
export function readout(id, labelKey, value, extraClass = "") {
  return h(
    "div",
    { class: `readout ${extraClass}`.trim(), "data-readout": id },
    h("span", { class: "readout-label" }, t(labelKey)),
    h("span", { class: "readout-value" }, value),
  );
}

/**
 * The mark that starts a summary line describing a section's result. CSS shows it only while
 * the section is stale (inputs refused, last result kept and dimmed), so that the line never
 * reads as a description of inputs that were not computed. It says which result is shown:
 * the previous one, or (class "fallback" on the section: the inputs of a link or a reload were
 * refused before anything was shown) the section's default example.
 */
export function staleNote() {
  return h(
    "span",
    { class: "stale-note" },
    h("span", { class: "stale-previous" }, t("common.previousResult")),
    h("span", { class: "stale-default" }, t("common.defaultResult")),
  );
}

/**
 * A section shows a new result: current (its errors cleared) or, with `fallback`, the
 * default example computed because the inputs were refused (their errors stay, dimmed result).
 */
export function resultShown(section, { fallback = false } = {}) {
  if (fallback) {
    section.classList.add("stale", "fallback");
    return;
  }
  clearErrors(section);
  section.classList.remove("fallback");
}

/**
 * What a conventions preset does, in the page's language: the server's description in English;
 * in another language the page's own words for the presets it knows, else words made from
 * the preset's fields.
 */
export function presetText(preset) {
  if (currentLanguage() === "en") return preset.description;
  const key = `preset.${preset.name}`;
  if (hasOwn(key)) return t(key);
  return t("preset.generic", { name: preset.name, lse: fmtNumber(preset.masked_row_lse), align: alignText(preset.causal_align) });
}

/** A causal alignment ("top_left", "bottom_right") in the page's language. */
export function alignText(align) {
  return t(align === "bottom_right" ? "s6.alignBR" : "s6.alignTL");
}

/**
 * A select's state key holds one of its options, or goes back to its default (a link may
 * carry any text); returns true when it was changed.
 */
export function keepToOptions(select, key) {
  if ([...select.options].some((o) => o.value === get(key))) return false;
  set({ [key]: getDefault(key) });
  return true;
}

// ------------------------------------------------------------------------ motion

const reduce = window.matchMedia("(prefers-reduced-motion: reduce)");

/** True when the reader asked for reduced motion (no step animations then). */
export function reducedMotion() {
  return reduce.matches;
}

/** el.animate(frames, options) unless reduced motion is asked for; returns the animation or null. */
export function animate(el, frames, options) {
  if (reducedMotion() || !el || typeof el.animate !== "function") return null;
  return el.animate(frames, { fill: "backwards", easing: "ease-in-out", ...options });
}

// ------------------------------------------------------------------------ errors

// API names of choices, shown as the page names them in its selects
const CHOICE_KEYS = {
  none: "s4.maskNone",
  causal: "s7.maskCausal",
  causal_top_left: "s4.maskTL",
  causal_bottom_right: "s4.maskBR",
  sliding_window: "s4.maskWindow",
  custom: "s4.maskCustomShort",
  contiguous: "s7.layout_contiguous",
  zigzag: "s7.layout_zigzag",
  random: "s7.dataRandom",
  example: "s7.dataExample",
};

/**
 * A list of allowed values as the server writes it ("'a', 'b' or 'c'", "a, b, c") in the
 * page's language: each choice by the name the page gives it (code names such as presets
 * and dtypes as they are), quoted, joined as that language joins a list.
 */
export function allowedText(allowed) {
  const items = String(allowed ?? "")
    .replace(/\s+or\s+/g, ", ")
    .split(",")
    .map((x) => x.trim().replace(/^['"]|['"]$/g, ""))
    .filter(Boolean)
    .map((x) => t("common.quoted", { text: CHOICE_KEYS[x] ? t(CHOICE_KEYS[x]) : x }));
  if (items.length < 2) return items.join("");
  return t("common.listOr", { items: items.slice(0, -1).join(t("common.listSep")), last: items[items.length - 1] });
}

// API fields that are lists of rows, one per position (a row of Q is d numbers): a limit on
// their length counts rows, not the entries the same kind counts in a list of numbers
const ROW_LISTS = new Set(["q", "k", "v", "g", "values", "mask.dense"]);

/** An API error item in the page's language: its kind and limits when the page knows the kind. */
export function errorText(err) {
  const rows = ROW_LISTS.has(err.path) && has(`err.rows.${err.kind}`);
  const key = rows ? `err.rows.${err.kind}` : `err.k.${err.kind}`;
  if (!err.kind || !has(key)) return err.message ?? "";
  const limits = { ...(err.limits ?? {}) };
  if ("allowed" in limits) limits.allowed = allowedText(limits.allowed);
  return t(key, limits);
}

// Each error shown on the page keeps how to state it (a function of the page's language),
// so that a language switch restates every message at once (renderErrors).
const errorTexts = new WeakMap();

/** Show text() in an error slot and remember text for renderErrors. */
function putError(slot, text) {
  errorTexts.set(slot, text);
  slot.textContent = text();
}

/** Clear the error texts of a section (its results are current again). */
export function clearErrors(section) {
  for (const el of section.querySelectorAll(".field-error, .section-error")) {
    errorTexts.delete(el);
    el.textContent = "";
  }
  for (const el of section.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  section.classList.remove("stale");
}

/** Restate every error shown under root in the page's current language (after a switch). */
export function renderErrors(root = document) {
  for (const el of root.querySelectorAll(".field-error, .section-error")) {
    const text = errorTexts.get(el);
    if (!text || !el.textContent) continue;
    el.textContent = text();
  }
}

/** The error slot for an API error: the most specific of its path, last path name, field. */
function errorSlot(section, field, path) {
  const names = [path, (path || "").split(".").pop().replace(/\[\d+\]/g, ""), field];
  for (const name of names) {
    if (!name) continue;
    const slot = section.querySelector(`[data-error-for="${CSS.escape(name)}"]`);
    if (slot) return slot;
  }
  return null;
}

/** Show text() next to a field and mark the field invalid. */
function markField(slot, text) {
  putError(slot, text);
  slot.closest(".field")?.querySelector("input, textarea, select")?.setAttribute("aria-invalid", "true");
}

/**
 * Show an API error in a section: each {field, path, kind, limits, message} goes next to
 * the matching field (data-error-for), in the page's language; anything else goes to the
 * section banner. The section's last results stay visible, dimmed, until the input is valid.
 */
export function showErrors(section, banner, answer) {
  clearErrors(section);
  section.classList.add("stale");
  const errors = answer.errors?.length ? answer.errors : [{ field: "", message: answer.detail }];
  const unplaced = [];
  for (const err of errors) {
    const slot = errorSlot(section, err.field, err.path);
    if (slot) markField(slot, () => errorText(err));
    else unplaced.push(err);
  }
  if (unplaced.length) putError(banner, () => t("err.server", { detail: unplaced.map(errorText).join("; ") }));
}

/**
 * Show a client-side parse error next to one field: the UI string `key` with its `vars`
 * (kept, so that a language switch restates it). The last results stay, dimmed.
 */
export function showFieldError(section, field, key, vars = {}) {
  clearErrors(section);
  section.classList.add("stale");
  markField(section.querySelector(`[data-error-for="${CSS.escape(field)}"]`), () => t(key, vars));
}

// ------------------------------------------------------------------------ typed fields

/**
 * Commit what a person types in `el` through `commit(value)`: after `delay` ms without a
 * key, at once on leaving the field (Tab) or on Enter. Returns {pending}: true while
 * typed text has not been committed yet, so that a refresh never overwrites it.
 */
export function typedField(el, commit, { event = "input", delay = 350 } = {}) {
  let timer = null;
  let pending = false;
  const read = () => (el.type === "checkbox" ? (el.checked ? "1" : "0") : el.value);
  const flush = () => {
    clearTimeout(timer);
    timer = null;
    if (!pending) return;
    pending = false;
    commit(read());
  };
  const immediate = el.type === "checkbox" || el.tagName === "SELECT";
  el.addEventListener(event, () => {
    pending = true;
    clearTimeout(timer);
    timer = setTimeout(flush, immediate ? 0 : delay);
  });
  el.addEventListener("blur", flush);
  el.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && el.tagName !== "TEXTAREA") flush();
  });
  return { pending: () => pending };
}

/**
 * Bind an input to a state key: value from state, typed text written back (see typedField).
 * sync(changes) rewrites the field only when its key changed and nothing typed there is
 * waiting: a refresh caused by another field never touches text being typed.
 */
export function bindInput(el, key, options = {}) {
  // a checkbox's key holds "1" or "0": other text (a link may carry any) goes back to the
  // key's default, as a select's does (keepToOptions), so that box, URL and request agree
  if (el.type === "checkbox" && get(key) !== "1" && get(key) !== "0") set({ [key]: getDefault(key) });
  const write = (value) => {
    if (el.type === "checkbox") el.checked = value === "1";
    else if (el.value !== value) {
      el.value = value;
      // a number field shows nothing for text it cannot hold ("+3", " 2", "−1" from a link) while
      // the section computes with that number: show the number the section reads
      if (el.type === "number" && el.value === "" && value.trim() !== "") {
        el.value = value.trim().replace(/^\+/, "").replace(/^\u2212/, "-");
      }
    }
  };
  write(get(key));
  const typed = typedField(el, (value) => set({ [key]: value }), options);
  return {
    sync: (changes) => {
      if (changes && !(key in changes)) return;
      if (!typed.pending()) write(get(key));
    },
  };
}

/** Parse an integer field; returns the number or null. */
export function parseIntField(text) {
  const trimmed = String(text).trim().replace(/^\u2212/, "-");
  if (/^[+-]?\d+$/.test(trimmed)) return Number(trimmed);
  // a whole number written with an exponent or a zero fraction (1e3, 2.0) is one: the
  // server then says whether it is in range, as it does for 1000
  if (!/^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(trimmed)) return null;
  const x = Number(trimmed);
  return Number.isSafeInteger(x) ? x : null;
}

// ------------------------------------------------------------------------ scroll cues

/**
 * A box that scrolls sideways inside its card says so: classes scroll-left / scroll-right
 * on the box (and its frame, which draws edge shadows) while there is more to see on that
 * side, and a small cue under it. Kept current on scroll and on any resize of box or content.
 */
export function watchScroll(box) {
  if (box.dataset.scrollWatched) return;
  box.dataset.scrollWatched = "1";
  let frame = box.parentElement;
  if (!frame.classList.contains("scroll-frame")) {
    frame = h("div", { class: "scroll-frame" });
    box.replaceWith(frame);
    frame.append(box);
  }
  const cue = h("div", { class: "scroll-cue", "aria-hidden": "true" });
  frame.append(cue);
  const update = () => {
    const more = box.scrollWidth - box.clientWidth;
    const left = more > 1 && box.scrollLeft > 1;
    const right = more > 1 && box.scrollLeft < more - 1;
    for (const el of [box, frame]) {
      el.classList.toggle("scroll-left", left);
      el.classList.toggle("scroll-right", right);
    }
    cue.hidden = more <= 1;
    cue.textContent = t("common.scrollCue");
  };
  box.addEventListener("scroll", update, { passive: true });
  const observer = new ResizeObserver(update);
  const watch = () => {
    observer.disconnect(); // let go of children that were replaced
    observer.observe(box);
    for (const child of box.children) observer.observe(child);
  };
  watch();
  new MutationObserver(() => {
    watch();
    update();
  }).observe(box, { childList: true });
  update();
  box.refreshCue = update;
}

/** Watch every .table-scroll and .svg-scroll box under root. */
export function watchAllScrolls(root = document) {
  for (const box of root.querySelectorAll(".table-scroll, .svg-scroll")) watchScroll(box);
}

/** Render width (CSS px) available inside el, for pictures drawn at 1:1 scale. */
export function widthOf(el, fallback = 600) {
  const w = el.clientWidth;
  return w > 0 ? w : fallback;
}

/**
 * One computation of a section: the request `request(get)` builds from the state, posted
 * to `path` through the section's `sequence` (its `latest()`); a field error goes to
 * `fieldError(field, key, vars)` (default: beside the field), a refused request's errors to
 * `errorBox` (after `onRefused()`), a result to `accept(data, body, false)`. `skip(body)`:
 * true when that body's result is already shown (nothing posted). Inputs refused before
 * anything was `shown()` (a link, a reload): the default inputs' result is shown instead,
 * `accept(data, body, true)`, the errors kept beside the fields, so that the section is
 * never blank.
 */
export async function computeSection({
  section, request, path, sequence, errorBox, shown, accept, fieldError, onRefused, skip,
}) {
  const fallback = async () => {
    if (shown()) return;
    const req = request(getDefault);
    const answer = await sequence(post(path, req.body));
    if (answer?.ok) accept(answer.data, req.body, true);
  };
  const req = request(get);
  if (req.error) {
    if (fieldError) fieldError(req.field, ...req.error);
    else showFieldError(section, req.field, ...req.error);
    return fallback();
  }
  if (skip?.(req.body)) return;
  const answer = await sequence(post(path, req.body));
  if (answer === null) return;
  if (!answer.ok) {
    onRefused?.();
    showErrors(section, errorBox, answer);
    return fallback();
  }
  accept(answer.data, req.body, false);
}

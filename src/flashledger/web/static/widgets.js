// Widgets shared by the sections: the stepper, readout cards, error display.

import { fill, h } from "./fmt.js";
import { t } from "./i18n.js";
import { get, set } from "./state.js";

const PLAY_INTERVAL_MS = 900;

/**
 * A stepper bound to the integer state key `key`, running 0..max().
 * `label(step, max)` gives the progress text. Returns {render}.
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
  const progress = h("span", { class: "progress-text" });
  const bar = h("span", { class: "progress-bar" }, h("span", { class: "progress-fill" }));
  fill(el, Object.values(buttons), h("span", { class: "progress" }, progress, bar));

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
    progress.textContent = label(step, total);
    bar.firstChild.style.width = `${total ? (100 * step) / total : 0}%`;
  }
  return { render, current, stop };
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

/** Clear the error texts of a section (its results are current again). */
export function clearErrors(section) {
  for (const el of section.querySelectorAll(".field-error, .section-error")) el.textContent = "";
  for (const el of section.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  section.classList.remove("stale");
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

/**
 * Show an API error in a section: each {field, path, message} goes next to the
 * matching field (data-error-for); anything else goes to the section banner.
 * The section's last results stay visible, dimmed, until the input is valid.
 */
export function showErrors(section, banner, answer) {
  clearErrors(section);
  section.classList.add("stale");
  const errors = answer.errors?.length ? answer.errors : [{ field: "", message: answer.detail }];
  const unplaced = [];
  for (const { field, path, message } of errors) {
    const slot = errorSlot(section, field, path);
    if (slot) {
      slot.textContent = message;
      slot.closest(".field")?.querySelector("input, textarea, select")?.setAttribute("aria-invalid", "true");
    } else {
      unplaced.push(message);
    }
  }
  if (unplaced.length) banner.textContent = t("err.server", { detail: unplaced.join("; ") });
}

/** Show a client-side parse error next to one field; the last results stay, dimmed. */
export function showFieldError(section, field, message) {
  clearErrors(section);
  section.classList.add("stale");
  const slot = section.querySelector(`[data-error-for="${CSS.escape(field)}"]`);
  slot.textContent = message;
  slot.closest(".field")?.querySelector("input, textarea, select")?.setAttribute("aria-invalid", "true");
}

/** Bind an input to a state key: value from state, writes back on change (debounced). */
export function bindInput(el, key, { event = "input", delay = 350 } = {}) {
  const read = () => (el.type === "checkbox" ? (el.checked ? "1" : "0") : el.value);
  const write = (value) => {
    if (el.type === "checkbox") el.checked = value === "1";
    else if (el.value !== value) el.value = value;
  };
  write(get(key));
  let timer = null;
  el.addEventListener(event, () => {
    clearTimeout(timer);
    timer = setTimeout(() => set({ [key]: read() }), el.type === "checkbox" || el.tagName === "SELECT" ? 0 : delay);
  });
  return { sync: () => write(get(key)) };
}

/** Parse an integer field; returns the number or null. */
export function parseIntField(text) {
  const trimmed = String(text).trim();
  return /^[+-]?\d+$/.test(trimmed) ? Number(trimmed) : null;
}

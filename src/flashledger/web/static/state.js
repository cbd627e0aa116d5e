// Page state in the URL query string, so that a view can be shared and reloaded.
//
// Every key has a default; only keys that differ from their default are
// written to the URL. Values are strings (what a person typed), parsed by the
// section that owns them.

const listeners = new Set();
let defaults = {};
let current = {};

/** Set the defaults (some come from /api/examples) and read the URL over them. */
export function initState(initialDefaults) {
  defaults = { ...initialDefaults };
  current = { ...defaults };
  const params = new URLSearchParams(window.location.search);
  for (const [key, value] of params) {
    if (key in defaults) current[key] = value;
  }
}

/** The current value of key (a string). */
export function get(key) {
  return current[key];
}

/** The default value of key. */
export function getDefault(key) {
  return defaults[key];
}

/** Update some keys, rewrite the URL (replaceState) and tell the listeners. */
export function set(changes) {
  let changed = false;
  for (const [key, value] of Object.entries(changes)) {
    const text = String(value);
    if (!(key in defaults)) throw new Error(`unknown state key ${key}`);
    if (current[key] !== text) {
      current[key] = text;
      changed = true;
    }
  }
  if (!changed) return;
  writeUrl();
  for (const fn of listeners) fn(changes);
}

/** Call fn(changes) after every set(). */
export function subscribe(fn) {
  listeners.add(fn);
}

function writeUrl() {
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(current)) {
    if (value !== defaults[key]) params.set(key, value);
  }
  const query = params.toString();
  const url = `${window.location.pathname}${query ? `?${query}` : ""}`;
  window.history.replaceState(null, "", url);
}

// Page state in the URL query string, so that a view can be shared and reloaded.
//
// Every key has a default; only keys that differ from their default are
// written to the URL. Values are strings (what a person typed), parsed by the
// section that owns them. Moving to another section adds a history entry
// (pushState), so Back returns to the previous section; every other change
// rewrites the current entry (replaceState). Back and Forward restore the
// state of their entry and tell the listeners what changed.

const listeners = new Set();
const PUSH_KEYS = new Set(["sec"]);
let defaults = {};
let current = {};

function readUrl() {
  const out = { ...defaults };
  const params = new URLSearchParams(window.location.search);
  for (const [key, value] of params) {
    if (key in defaults) out[key] = value;
  }
  return out;
}

/** Set the defaults (some come from /api/examples) and read the URL over them. */
export function initState(initialDefaults) {
  defaults = { ...initialDefaults };
  current = readUrl();
  window.addEventListener("popstate", () => {
    const next = readUrl();
    const changes = {};
    for (const [key, value] of Object.entries(next)) {
      if (current[key] !== value) changes[key] = value;
    }
    current = next;
    if (Object.keys(changes).length) notify(changes);
  });
}

/** The current value of key (a string). */
export function get(key) {
  return current[key];
}

/** The default value of key. */
export function getDefault(key) {
  return defaults[key];
}

/**
 * Update some keys, rewrite the URL and tell the listeners. A change of section
 * adds a history entry; anything else replaces the current one.
 */
export function set(changes) {
  update(changes, (keys) => keys.some((key) => PUSH_KEYS.has(key)));
}

/**
 * Correct keys a link got wrong (a language or a section the page does not have) to what the
 * page shows: the current history entry is rewritten, never a new one added, so that Back
 * still leaves the page in one step.
 */
export function correct(changes) {
  update(changes, () => false);
}

/** Set the changed keys, write the URL (a new entry when push(keys)) and tell the listeners. */
function update(changes, push) {
  const changed = {};
  for (const [key, value] of Object.entries(changes)) {
    const text = String(value);
    if (!(key in defaults)) throw new Error(`unknown state key ${key}`);
    if (current[key] !== text) {
      current[key] = text;
      changed[key] = text;
    }
  }
  if (!Object.keys(changed).length) return;
  writeUrl(push(Object.keys(changed)));
  notify(changed);
}

/** Call fn(changes) after every change of state: changes maps each changed key to its value. */
export function subscribe(fn) {
  listeners.add(fn);
}

function notify(changes) {
  for (const fn of listeners) fn(changes);
}

function writeUrl(push) {
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(current)) {
    if (value !== defaults[key]) params.set(key, value);
  }
  const query = params.toString();
  const url = `${window.location.pathname}${query ? `?${query}` : ""}`;
  if (push) window.history.pushState(null, "", url);
  else window.history.replaceState(null, "", url);
}

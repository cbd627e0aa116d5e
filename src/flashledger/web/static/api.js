// The explorer's JSON API, seen from the page.
//
// Responses encode ±∞ as the strings "Infinity"/"-Infinity"; they are
// decoded back to numbers here. Errors come back as {detail: "one line",
// errors: [{field, path, message, kind, limits}]}: widgets.errorText states
// an error's kind and limits in the page's language.

function revive(_key, value) {
  if (value === "Infinity") return Infinity;
  if (value === "-Infinity") return -Infinity;
  if (value === "NaN") return NaN;
  return value;
}

async function request(method, path, body) {
  const init = { method, headers: { Accept: "application/json" } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    return { ok: false, detail: String(err), errors: [] };
  }
  const text = await response.text();
  let data;
  try {
    data = JSON.parse(text, revive);
  } catch {
    return { ok: false, detail: `HTTP ${response.status}`, errors: [] };
  }
  if (!response.ok) {
    return { ok: false, detail: data.detail ?? `HTTP ${response.status}`, errors: data.errors ?? [] };
  }
  return { ok: true, data };
}

/** POST a JSON body; resolves to {ok: true, data} or {ok: false, detail, errors}. */
export function post(path, body) {
  return request("POST", path, body);
}

/** GET a JSON document; same result shape as post(). */
export function getJson(path) {
  return request("GET", path);
}

/**
 * A sequencer for one kind of request: only the latest call's answer is
 * delivered, so quick edits never show a stale result.
 */
export function latest() {
  let ticket = 0;
  return async (promise) => {
    const mine = ++ticket;
    const result = await promise;
    return mine === ticket ? result : null;
  };
}

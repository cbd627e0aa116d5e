// Renders /openapi.json as a list of endpoints with their request fields (no external assets).

import { fill, h } from "./fmt.js";

function resolve(spec, schema) {
  if (schema && schema.$ref) return resolve(spec, spec.components.schemas[schema.$ref.split("/").pop()]);
  return schema ?? {};
}

function typeText(spec, schema) {
  const s = resolve(spec, schema);
  if (schema && schema.$ref) return schema.$ref.split("/").pop();
  if (s.anyOf) return s.anyOf.map((x) => typeText(spec, x)).join(" | ");
  if (s.enum) return s.enum.map((x) => JSON.stringify(x)).join(" | ");
  if (s.type === "array") return `${typeText(spec, s.items)}[]`;
  return s.type ?? "any";
}

function limits(schema) {
  const parts = [];
  for (const [key, label] of [["minimum", "≥"], ["exclusiveMinimum", ">"], ["maximum", "≤"], ["exclusiveMaximum", "<"], ["minItems", "items ≥"], ["maxItems", "items ≤"]]) {
    if (schema[key] !== undefined) parts.push(`${label} ${schema[key]}`);
  }
  return parts.join(", ");
}

function fieldsTable(spec, schema) {
  const s = resolve(spec, schema);
  if (!s.properties) return null;
  const required = new Set(s.required ?? []);
  return h(
    "table",
    { class: "data compact" },
    h("thead", {}, h("tr", {}, ["field", "type", "default", "limits", "description"].map((x) => h("th", {}, x)))),
    h(
      "tbody",
      {},
      Object.entries(s.properties).map(([name, prop]) =>
        h(
          "tr",
          {},
          h("td", {}, h("code", {}, name), required.has(name) ? " *" : ""),
          h("td", {}, typeText(spec, prop)),
          h("td", {}, prop.default === undefined ? "" : JSON.stringify(prop.default)),
          h("td", {}, limits(prop)),
          h("td", { class: "small" }, prop.description ?? ""),
        ),
      ),
    ),
  );
}

async function main() {
  const spec = await (await fetch("/openapi.json")).json();
  const out = [];
  for (const [path, ops] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(ops)) {
      const body = op.requestBody?.content?.["application/json"]?.schema;
      const answer = op.responses?.["200"]?.content?.["application/json"]?.schema;
      out.push(
        h(
          "section",
          { class: "card" },
          h("h3", {}, h("span", { class: "method" }, method.toUpperCase()), " ", h("code", {}, path), " — ", op.summary ?? ""),
          h("p", {}, op.description ?? ""),
          body ? [h("h4", {}, `request: ${typeText(spec, body)}`), fieldsTable(spec, body)] : null,
          answer ? [h("h4", {}, `response: ${typeText(spec, answer)}`), fieldsTable(spec, answer)] : null,
        ),
      );
    }
  }
  fill(document.getElementById("endpoints"), out);
}

main();

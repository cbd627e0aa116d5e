// Section 07: ring attention (context parallelism) on W simulated ranks. The server runs
// flashledger.ring.simulate_ring forward and backward, with every hop and chunk pair booked
// in its RingLedger; the page steps through the ring: which shards each rank holds, the
// hops of the step, each rank's running state, the travelling dK/dV accumulators.

import { latest, post } from "./api.js";
import { count, fill, h, num, s } from "./fmt.js";
import { t } from "./i18n.js";
import { get, set, subscribe } from "./state.js";
import {
  bindInput,
  computeSection,
  keepToOptions,
  normalizeStep,
  parseIntField,
  readout,
  registerStepper,
  resultShown,
  showFieldError,
  staleNote,
  stepper,
  widthOf,
} from "./widgets.js";

const INPUT_KEYS = ["rw", "rlay", "rl", "rd", "rb", "rmask", "rwl", "rwr", "rdata", "rseed"];
const INTS = { world_size: "rw", length: "rl", d: "rd", block: "rb", seed: "rseed" };
const HUES = [174, 212, 32, 268, 4, 96, 326, 190];
const PAYLOAD = { kv: "K/V", dkv: "dK/dV" };

let section;
let data = null;
let shownBody = null; // the request `data` answers (the line above the stepper states it)
let example = { length: 5, d: 2 }; // the seed page's five positions
let stepCtl;
let bindings = [];
let visible = false;
let computedFor = null;
let labelLimits = { world: 8, length: 64, d: 16 };
const sequence = latest();

/** Colours of rank r's chunks: fill, stroke, ink. */
function hue(r) {
  const x = HUES[r % HUES.length];
  return { fill: `hsl(${x} 52% 90%)`, stroke: `hsl(${x} 45% 42%)`, ink: `hsl(${x} 50% 24%)`, solid: `hsl(${x} 45% 48%)` };
}

export function init(ctx) {
  section = document.getElementById("sec-ring");
  const limits = ctx.examples.limits;
  document.getElementById("f-r-world").max = String(limits.max_ring_world);
  document.getElementById("f-r-length").max = String(limits.max_trace_len);
  document.getElementById("f-r-d").max = String(limits.max_head_dim);
  labelLimits = { world: limits.max_ring_world, length: limits.max_trace_len, d: limits.max_head_dim };
  example = { length: ctx.examples.backward.q.length, d: ctx.examples.backward.q[0].length };
  // a link may carry any text for a choice; the seed's example fixes L and d (and so W)
  keepToOptions(document.getElementById("f-r-layout"), "rlay");
  keepToOptions(document.getElementById("f-r-mask"), "rmask");
  keepToOptions(document.getElementById("f-r-data"), "rdata");
  if (get("rdata") === "example") chooseData("example");
  const ids = { rw: "f-r-world", rl: "f-r-length", rd: "f-r-d", rb: "f-r-block", rwl: "f-r-wl", rwr: "f-r-wr", rseed: "f-r-seed" };
  bindings = Object.entries(ids).map(([key, id]) => bindInput(document.getElementById(id), key));
  bindings.push(bindInput(document.getElementById("f-r-layout"), "rlay", { event: "change" }));
  bindings.push(bindInput(document.getElementById("f-r-mask"), "rmask", { event: "change" }));
  const dataSelect = document.getElementById("f-r-data");
  dataSelect.value = get("rdata");
  dataSelect.addEventListener("change", () => chooseData(dataSelect.value));
  bindings.push({ sync: () => (dataSelect.value = get("rdata")) });
  for (const btn of section.querySelectorAll("#ring-pass button")) {
    btn.addEventListener("click", () => {
      if (btn.dataset.pass !== pass()) set({ rpass: btn.dataset.pass, rstep: "0" });
    });
  }
  stepCtl = stepper(
    document.getElementById("ring-stepper"),
    "rstep",
    () => (data ? data.world_size : 0),
    (step, total) => `${t("s7.progress")}: ${step} / ${total}`,
  );
  registerStepper("ring", stepCtl);
  new ResizeObserver(() => visible && data && renderBars(pass())).observe(document.getElementById("ring-bars"));
  subscribe((changes) => {
    if (INPUT_KEYS.some((key) => key in changes)) {
      for (const b of bindings) b.sync(changes);
      if (visible) compute();
    } else if ("rstep" in changes || "rpass" in changes || "rrank" in changes) {
      render();
    }
  });
  render();
}

export function shown(sec) {
  visible = sec === "ring";
  if (visible) compute();
}

/**
 * The seed page's five positions fix L = 5 and d = 2 (and so at most 2 zigzag ranks): choosing
 * them (or a link that names them) sets those fields.
 */
function chooseData(kind) {
  if (kind !== "example") return set({ rdata: kind, rstep: "0" });
  const w = parseIntField(get("rw")) ?? 1;
  const most = get("rlay") === "zigzag" ? Math.floor(example.length / 2) : example.length;
  const changes = { rdata: kind, rl: String(example.length), rd: String(example.d), rw: String(Math.min(Math.max(w, 1), most)) };
  if (get("rdata") !== kind) changes.rstep = "0";
  set(changes);
}

/** The request for `read(key)` (the fields' state, or the defaults): {body} or {field, error}. */
function request(read) {
  const body = {};
  for (const [field, key] of Object.entries(INTS)) {
    if (field === "seed" && read("rdata") === "example") continue; // no effect there
    body[field] = parseIntField(read(key));
    if (body[field] === null) return { field, error: ["err.integer", {}] };
  }
  body.layout = read("rlay");
  body.data = read("rdata");
  if (body.data === "example") Object.assign(body, example); // its L and d, whatever the fields say
  body.mask = { kind: read("rmask") };
  if (read("rmask") === "sliding_window") {
    body.mask.left = parseIntField(read("rwl"));
    body.mask.right = parseIntField(read("rwr"));
    if (body.mask.left === null) return { field: "left", error: ["err.integer", {}] };
    if (body.mask.right === null) return { field: "right", error: ["err.integer", {}] };
  }
  return { body };
}

async function compute() {
  for (const el of section.querySelectorAll(".r-window-only")) el.hidden = get("rmask") !== "sliding_window";
  const isExample = get("rdata") === "example";
  document.getElementById("f-r-length").disabled = isExample;
  document.getElementById("f-r-d").disabled = isExample;
  document.getElementById("f-r-seed").disabled = isExample;
  return computeSection({
    section,
    request,
    path: "/api/ring",
    sequence,
    errorBox: document.getElementById("ring-error"),
    shown: () => data !== null,
    accept,
    fieldError: (field, ...error) => {
      computedFor = null;
      showFieldError(section, field, ...error);
    },
    onRefused: () => {
      computedFor = null;
    },
    skip: (body) => {
      // the same inputs as the ring shown (a step or a language change): nothing to post
      const key = JSON.stringify(body);
      if (key === computedFor && data) return true;
      computedFor = key;
      return false;
    },
  });
}

function accept(result, body, isDefault) {
  resultShown(section, { fallback: isDefault });
  data = result;
  shownBody = body;
  normalizeStep("rstep", data.world_size);
  if ((parseIntField(get("rrank")) ?? 0) >= data.world_size) set({ rrank: "0" });
  render();
}

/** One line: the settings of the ring shown (and, while stale, that it is an older one). */
function renderConfig() {
  const el = document.getElementById("ring-config");
  if (!data || !shownBody) return fill(el);
  const b = shownBody;
  const name = (id, value) => document.querySelector(`#${id} option[value="${CSS.escape(value)}"]`)?.textContent ?? value;
  let mask = name("f-r-mask", b.mask.kind);
  if (b.mask.kind === "sliding_window") mask += ` (${b.mask.left}, ${b.mask.right})`;
  const inputs = b.data === "example" ? name("f-r-data", "example") : t("s7.randomSeed", { seed: b.seed });
  fill(el, staleNote(), [`W = ${b.world_size}`, name("f-r-layout", b.layout), `L = ${b.length}`, `d = ${b.d}`, tileText(b.block), mask, inputs].join(" \u00b7 "));
}

/**
 * The tile the ring runs: tiles are cut inside each (query chunk, key chunk) pair, so a tile
 * larger than every chunk runs as the chunk (in zigzag, W = 4, L = 16, tile 4 runs 2 × 2 tiles,
 * and tiles 2 to 16 book the same work): say so rather than a size nothing used.
 */
function tileText(block) {
  const sizes = data.bounds.slice(1).map((x, i) => x - data.bounds[i]);
  const most = Math.max(...sizes);
  return block > most ? t("s7.tileClipped", { n: block, eff: most }) : t("common.tileN", { n: block });
}

function pass() {
  return get("rpass") === "backward" ? "backward" : "forward";
}

function selectedRank() {
  const r = parseIntField(get("rrank")) ?? 0;
  return data && r >= 0 && r < data.world_size ? r : 0;
}

/** The field labels that state a limit take it from the server's limits. */
function renderLabels() {
  const put = (id, key, max) => {
    const span = document.getElementById(id)?.closest(".field")?.querySelector("span");
    if (span) span.textContent = t(key, { max });
  };
  put("f-r-world", "s7.world", labelLimits.world);
  put("f-r-length", "s7.length", labelLimits.length);
  put("f-r-d", "s7.d", labelLimits.d);
}

export function render() {
  renderLabels();
  renderConfig();
  stepCtl.render();
  for (const btn of section.querySelectorAll("#ring-pass button")) {
    const on = btn.dataset.pass === pass();
    btn.classList.toggle("active", on);
    btn.setAttribute("aria-pressed", String(on));
  }
  const ids = ["ring-readouts", "ring-diagram", "ring-ranks", "ring-rows", "ring-hops", "ring-comm", "ring-checks", "ring-bars", "ring-grid"];
  if (!data) {
    for (const id of ids) fill(document.getElementById(id));
    return;
  }
  const n = stepCtl.current();
  const p = pass();
  renderReadouts(n, p);
  fill(document.getElementById("ring-diagram"), diagram(n, p));
  renderRanks(n, p);
  renderRows(n, p);
  renderHops(n, p);
  renderComm();
  renderChecks();
  renderBars(p);
  renderGrid(n, p);
}

// ------------------------------------------------------------------------ readouts

function stepHops(n, p) {
  return data.hops.filter((x) => x.pass_name === p && x.step === n - 1);
}

function renderReadouts(n, p) {
  const hops = stepHops(n, p);
  const sent = data.hops.filter((x) => x.pass_name === p && x.step < n).reduce((a, x) => a + x.nbytes, 0);
  const now = data[p][n].max_diff;
  fill(
    document.getElementById("ring-readouts"),
    readout("ring-hops", "s7.hopsStep", h("span", {}, count(hops.length), h("span", { class: "muted small" }, ` \u00b7 ${hops.reduce((a, x) => a + x.nbytes, 0)} B`))),
    readout("ring-bytes", "s7.bytesSoFar", count(sent)),
    readout("ring-now", p === "forward" ? "s7.nowFwd" : "s7.nowBwd", num(now), `${now <= data.tolerance ? "good" : ""} wide`),
  );
}

// ------------------------------------------------------------------------ the ring diagram

const VW = 660;
const STRIP_Y = 26;
const STRIP_H = 26;
const RX = 246;
const RY = 218;
const NODE_W = 132;
const NODE_H = 78;

/** Centre and size of the ring for W ranks: an ellipse of radii RX, RY (one node for W = 1). */
function layoutFor(w) {
  const top = STRIP_Y + STRIP_H + 34;
  const cy = w === 1 ? top + NODE_H / 2 : top + RY + NODE_H / 2;
  return { cx: VW / 2, cy, height: w === 1 ? cy + NODE_H / 2 + 52 : cy + RY + NODE_H / 2 + 12 };
}

function rowsText(a, b) {
  return b - a === 1 ? `q${a}` : `q${a}\u2013${b - 1}`;
}

function chunkTitle(c) {
  return `${t("s7.chunk")} ${c}: ${rowsText(data.bounds[c], data.bounds[c + 1])}`;
}

function angle(r, w) {
  return -Math.PI / 2 + (2 * Math.PI * r) / w;
}

/** The point at angle `a` on the ellipse `inset` inside the ring. */
function onRing(geo, a, inset = 0) {
  return [geo.cx + (RX - inset) * Math.cos(a), geo.cy + (RY - inset) * Math.sin(a)];
}

function nodeCenter(geo, r, w) {
  return w === 1 ? [geo.cx, geo.cy] : onRing(geo, angle(r, w));
}

/** How far (radians) a ring arc `inset` inside must run before it leaves node r's box. */
function clearance(geo, r, w, inset, dir) {
  const [nx, ny] = nodeCenter(geo, r, w);
  const a0 = angle(r, w);
  for (let phi = 0; phi < Math.PI; phi += 0.004) {
    const [x, y] = onRing(geo, a0 + dir * phi, inset);
    if (Math.abs(x - nx) > NODE_W / 2 + 7 || Math.abs(y - ny) > NODE_H / 2 + 7) return phi;
  }
  return Math.PI;
}

/** An arrow along the ring (`inset` inside it) from rank r to rank r + 1, with a label. */
function hopArc(geo, r, w, inset, cls, label, labelInset) {
  const a0 = angle(r, w) + clearance(geo, r, w, inset, 1);
  const a1 = angle(r + 1, w) - clearance(geo, (r + 1) % w, w, inset, -1);
  if (a1 <= a0) return null;
  const [x0, y0] = onRing(geo, a0, inset);
  const [x1, y1] = onRing(geo, a1, inset);
  const [lx, ly] = onRing(geo, (a0 + a1) / 2, labelInset);
  const large = a1 - a0 > Math.PI ? 1 : 0;
  const d = `M ${x0.toFixed(1)} ${y0.toFixed(1)} A ${RX - inset} ${RY - inset} 0 ${large} 1 ${x1.toFixed(1)} ${y1.toFixed(1)}`;
  return s(
    "g",
    { class: `hop ${cls}` },
    s("path", { d, "marker-end": `url(#arrow-${cls})` }),
    s("text", { x: lx.toFixed(1), y: (ly + 4).toFixed(1), "text-anchor": "middle", class: "hop-label" }, label),
  );
}

function chips(chunks, owner, x, y) {
  const c = hue(owner);
  return chunks.map((ch, i) =>
    s(
      "g",
      { class: "chip-chunk" },
      s("rect", { x: x + i * 36, y, width: 32, height: 16, rx: 3, fill: c.fill, stroke: c.stroke }),
      s("text", { x: x + i * 36 + 16, y: y + 12, "text-anchor": "middle", fill: c.ink, class: "chip-text" }, `c${ch}`),
      s("title", {}, chunkTitle(ch)),
    ),
  );
}

const TOKEN_W = 80;
const TOKEN_H = 34;

/** Where rank r's dK/dV token sits: just inside its node, towards the ring's centre. */
function tokenCenter(geo, r, w) {
  const [nx, ny] = nodeCenter(geo, r, w);
  const dx = geo.cx - nx;
  const dy = geo.cy - ny;
  const len = Math.hypot(dx, dy);
  const ux = dx / len;
  const uy = dy / len;
  const gap = 8;
  const along = Math.min(
    Math.abs(ux) > 1e-9 ? (NODE_W / 2 + TOKEN_W / 2 + gap) / Math.abs(ux) : Infinity,
    Math.abs(uy) > 1e-9 ? (NODE_H / 2 + TOKEN_H / 2 + gap) / Math.abs(uy) : Infinity,
  );
  return [nx + ux * along, ny + uy * along];
}

function diagram(n, p) {
  const w = data.world_size;
  const geo = layoutFor(w);
  const svg = s("svg", { viewBox: `0 0 ${VW} ${geo.height}`, width: "100%", class: "ring-diagram", role: "img", "aria-label": t("s7.diagramLabel") });
  svg.append(
    s(
      "defs",
      {},
      ["kv", "dkv"].map((cls) =>
        s("marker", { id: `arrow-${cls}`, viewBox: "0 0 10 10", refX: 8, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, s("path", { d: "M 0 0 L 10 5 L 0 10 z", class: `arrow-head ${cls}` })),
      ),
    ),
  );
  svg.append(sequenceStrip());
  const sel = selectedRank();
  const states = data[p][n].ranks;
  if (w > 1) svg.append(s("ellipse", { cx: geo.cx, cy: geo.cy, rx: RX, ry: RY, class: "ring-track" }));
  for (const hop of stepHops(n, p)) {
    const arc =
      hop.payload === "kv"
        ? hopArc(geo, hop.sender, w, 0, "kv", `K/V ${hop.shard}`, -22)
        : hopArc(geo, hop.sender, w, 34, "dkv", `dK/dV ${hop.shard}`, 54);
    if (arc) svg.append(arc);
  }
  // the dK/dV accumulators, where they are after the step
  if (p === "backward" && w > 1) {
    for (const st of states) {
      if (st.acc_shard === null) continue;
      const [tx, ty] = tokenCenter(geo, st.rank, w);
      const home = st.acc_shard === st.rank && st.acc_count === w;
      svg.append(
        s(
          "g",
          { class: `acc-token${home ? " home" : ""}`, "data-acc": String(st.acc_shard) },
          s("rect", { x: tx - TOKEN_W / 2, y: ty - TOKEN_H / 2, width: TOKEN_W, height: TOKEN_H, rx: 8 }),
          s("text", { x: tx, y: ty - 3, "text-anchor": "middle", class: "acc-title" }, `dK/dV ${st.acc_shard}`),
          s("text", { x: tx, y: ty + 11, "text-anchor": "middle", class: "acc-sub" }, home ? t("s7.home") : `${st.acc_count} / ${w}`),
          s("title", {}, t("s7.accTitle", { shard: st.acc_shard, count: st.acc_count, w })),
        ),
      );
    }
  }
  for (const st of states) svg.append(rankNode(geo, st, n, p, st.rank === sel));
  const [cx, cy] = w === 1 ? [geo.cx, geo.cy + NODE_H / 2 + 22] : [geo.cx, geo.cy - 4];
  svg.append(
    s("text", { x: cx, y: cy, "text-anchor": "middle", class: "ring-center" }, n === 0 ? t("s7.centerStart") : t("s7.centerStep", { step: n })),
    s("text", { x: cx, y: cy + 19, "text-anchor": "middle", class: "ring-center-sub" }, centerLine(n, p)),
  );
  return svg;
}

function centerLine(n, p) {
  const w = data.world_size;
  if (w === 1) return t("s7.oneRank");
  if (n === 0) return t(p === "forward" ? "s7.centerFwd0" : "s7.centerBwd0");
  if (p === "forward") return n < w ? t("s7.centerFwd") : t("s7.centerFwdEnd");
  return n < w ? t("s7.centerBwd") : t("s7.centerBwdEnd");
}

function rankNode(geo, st, n, p, selected) {
  const w = data.world_size;
  const [cx, cy] = nodeCenter(geo, st.rank, w);
  const x = cx - NODE_W / 2;
  const y = cy - NODE_H / 2;
  const c = hue(st.rank);
  const info = data.ranks[st.rank];
  const shardChunks = data.ranks[st.shard].chunks;
  const g = s("g", { class: `rank-node${selected ? " selected" : ""}`, "data-rank": String(st.rank), tabindex: 0, role: "button" });
  g.addEventListener("click", () => set({ rrank: String(st.rank) }));
  g.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" || ev.key === " ") set({ rrank: String(st.rank) });
  });
  g.append(
    s("rect", { x, y, width: NODE_W, height: NODE_H, rx: 9, class: "rank-box", stroke: c.stroke }),
    s("rect", { x, y, width: 6, height: NODE_H, rx: 3, fill: c.solid }),
    s("text", { x: x + 14, y: y + 17, class: "rank-title" }, `${t("s7.rank")} ${st.rank}`),
    s("text", { x: x + NODE_W - 8, y: y + 17, "text-anchor": "end", class: "rank-tiles" }, t("s7.tilesShort", { run: st.tiles_run })),
    s("text", { x: x + 14, y: y + 38, class: "rank-label" }, "Q"),
    ...chips(info.chunks, st.rank, x + 46, y + 26),
    s("text", { x: x + 14, y: y + 60, class: "rank-label" }, "K/V"),
    ...chips(shardChunks, st.shard, x + 46, y + 48),
  );
  // how much of the pass this rank has done: n of W steps
  const frac = n / w;
  g.append(
    s("rect", { x: x + 14, y: y + NODE_H - 10, width: NODE_W - 24, height: 4, rx: 2, class: "rank-progress-bg" }),
    s("rect", { x: x + 14, y: y + NODE_H - 10, width: (NODE_W - 24) * frac, height: 4, rx: 2, fill: c.solid }),
    s("title", {}, n === 0 ? t("s7.nodeTitle0", { rank: st.rank, shard: st.shard }) : t(p === "forward" ? "s7.nodeTitleFwd" : "s7.nodeTitleBwd", { rank: st.rank, shard: st.shard, n, w })),
  );
  return g;
}

/** The sequence cut into chunks, each coloured by the rank that holds it. */
function sequenceStrip() {
  const g = s("g", { class: "seq-strip" });
  const L = data.length;
  const x0 = 20;
  const width = VW - 40;
  const sel = selectedRank();
  g.append(s("text", { x: x0, y: STRIP_Y - 8, class: "strip-label" }, t("s7.strip", { L, n: data.owners.length, layout: t(`s7.layout_${data.layout}`) })));
  data.owners.forEach((owner, c) => {
    const a = data.bounds[c];
    const b = data.bounds[c + 1];
    const col = hue(owner);
    const x = x0 + (width * a) / L;
    const cw = (width * (b - a)) / L;
    g.append(
      s(
        "g",
        { "data-chunk": String(c) },
        s("rect", { x: x + 0.5, y: STRIP_Y, width: Math.max(cw - 1, 1), height: STRIP_H, fill: col.fill, stroke: owner === sel ? col.ink : col.stroke, "stroke-width": owner === sel ? 2.2 : 1 }),
        cw >= 22 ? s("text", { x: x + cw / 2, y: STRIP_Y + 17, "text-anchor": "middle", fill: col.ink, class: "chip-text" }, `c${c}`) : null,
        cw >= 22 ? s("text", { x: x + cw / 2, y: STRIP_Y + STRIP_H + 13, "text-anchor": "middle", class: "strip-owner" }, `r${owner}`) : null,
        s("title", {}, `${chunkTitle(c)} \u2192 ${t("s7.rank")} ${owner}`),
      ),
    );
  });
  g.append(
    s("text", { x: x0, y: STRIP_Y + STRIP_H + 13, class: "strip-owner" }, "0"),
    s("text", { x: x0 + width, y: STRIP_Y + STRIP_H + 13, "text-anchor": "end", class: "strip-owner" }, String(L - 1)),
  );
  return g;
}

// ------------------------------------------------------------------------ per-rank state

function chunkChips(chunks, owner) {
  const c = hue(owner);
  return h(
    "span",
    { class: "chunk-chips" },
    chunks.map((ch) => h("span", { class: "chunk-chip", style: `background:${c.fill};border-color:${c.stroke};color:${c.ink}`, title: chunkTitle(ch) }, `c${ch}`)),
  );
}

function renderRanks(n, p) {
  const w = data.world_size;
  const sel = selectedRank();
  const head =
    p === "forward"
      ? ["s7.thRank", "s7.thQ", "s7.thKV", "s7.thTiles", "s7.thOdiff"]
      : ["s7.thRank", "s7.thQ", "s7.thKV", "s7.thTiles", "s7.thDqDiff", "s7.thAcc", "s7.thAccDiff"];
  const body = h("tbody");
  for (const st of data[p][n].ranks) {
    const cells = [
      h("td", {}, h("span", { class: "rank-dot", style: `background:${hue(st.rank).solid}` }), String(st.rank)),
      h("td", {}, chunkChips(data.ranks[st.rank].chunks, st.rank)),
      h("td", { title: t("s7.ofRank", { rank: st.shard }) }, chunkChips(data.ranks[st.shard].chunks, st.shard)),
      h("td", { class: "num-col", "data-col": "tiles" }, h("span", { class: "num" }, `${st.tiles_run} / ${st.tiles_skipped}`)),
    ];
    if (p === "forward") {
      cells.push(h("td", { class: "num-col", "data-col": "o-diff" }, num(st.o_max_diff)));
    } else {
      const acc =
        st.acc_shard === null
          ? h("span", { class: "muted" }, "\u2014")
          : h("span", { class: "nowrap" }, `dK/dV ${st.acc_shard} `, h("span", { class: "muted small" }, st.acc_shard === st.rank && st.acc_count === w ? t("s7.home") : `${st.acc_count}/${w}`));
      cells.push(
        h("td", { class: "num-col", "data-col": "dq-diff" }, num(st.dq_max_diff)),
        h("td", { "data-col": "acc" }, acc),
        h("td", { class: "num-col", "data-col": "acc-diff" }, st.acc_shard === null ? h("span", { class: "muted" }, "\u2014") : num(st.acc_max_diff)),
      );
    }
    body.append(h("tr", { class: st.rank === sel ? "selected" : "", "data-rank": String(st.rank), onclick: () => set({ rrank: String(st.rank) }) }, cells));
  }
  fill(
    document.getElementById("ring-ranks"),
    h("thead", {}, h("tr", {}, head.map((key, i) => h("th", { class: `${i >= 3 && key !== "s7.thAcc" ? "num-col" : ""}${key === "s7.thAccDiff" ? " tight" : ""}`, title: key === "s7.thAccDiff" ? t("s7.accDiffTitle") : null }, t(key))))),
    body,
  );
  fill(document.getElementById("ring-ranks-note"), t(p === "forward" ? "s7.ranksNoteFwd" : "s7.ranksNoteBwd", { w }));
}

function renderRows(n, p) {
  const r = selectedRank();
  const info = data.ranks[r];
  const lse = data.forward[p === "forward" ? n : data.world_size].ranks[r].lse;
  const title = p === "backward" ? "s7.rowsTitleBwd" : n === 0 ? "s7.rowsTitleFwd0" : "s7.rowsTitleFwd";
  fill(document.getElementById("ring-rows-title"), t(title, { rank: r, n }));
  const body = h("tbody");
  info.rows.forEach((row, i) => {
    const final = data.lse[row];
    const done = lse[i] === final;
    body.append(
      h(
        "tr",
        { "data-row": String(row) },
        h("td", {}, `q${row}`),
        h("td", { class: `num-col${done ? "" : " muted-num"}`, "data-col": "lse" }, num(lse[i])),
        h("td", { class: "num-col", "data-col": "final" }, num(final)),
      ),
    );
  });
  fill(
    document.getElementById("ring-rows"),
    h("thead", {}, h("tr", {}, h("th", {}, t("s4.thRow")), h("th", { class: "num-col" }, t(p === "forward" ? "s7.thLseNow" : "s7.thLseSaved")), h("th", { class: "num-col" }, t("s7.thLseFinal")))),
    body,
  );
}

// ------------------------------------------------------------------------ hop ledger

function renderHops(n, p) {
  const holder = document.getElementById("ring-hops");
  const hops = data.hops.filter((x) => x.pass_name === p);
  if (!hops.length) {
    fill(holder, h("p", { class: "muted small" }, t("s7.noHops")));
    return;
  }
  const body = h("tbody");
  let first = null;
  for (const hop of hops) {
    const number = hop.step + 1; // ring steps count from 1 on the page, as the stepper does
    const cls = number === n ? "current" : number > n ? "future" : "";
    const row = h(
      "tr",
      { class: cls, "data-step": String(number) },
      h("td", { class: "num-col" }, String(number)),
      h("td", {}, `${hop.sender} \u2192 ${hop.receiver}`),
      h("td", {}, h("span", { class: `payload ${hop.payload}` }, PAYLOAD[hop.payload])),
      h("td", { class: "num-col" }, String(hop.shard)),
      h("td", { class: "num-col" }, count(hop.nbytes)),
    );
    if (cls === "current" && first === null) first = row;
    body.append(row);
  }
  const table = h(
    "table",
    { class: "data compact", id: "ring-hop-table" },
    h("thead", {}, h("tr", {}, ["s7.thStep", "s7.thRoute", "s7.thPayload", "s7.thShard", "s7.thBytes"].map((key, i) => h("th", { class: i === 1 || i === 2 ? "" : "num-col" }, t(key))))),
    body,
  );
  const scroller = h("div", { class: "hop-scroll" }, table);
  fill(holder, scroller);
  if (first) scroller.scrollTop = Math.max(0, first.offsetTop - 34);
}

function renderComm() {
  const body = h("tbody");
  for (const row of data.comm) {
    if (!data.passes[row.pass_name]) continue;
    body.append(
      h(
        "tr",
        { "data-comm": `${row.pass_name}-${row.payload}` },
        h("td", {}, t(`s7.${row.pass_name}`)),
        h("td", {}, h("span", { class: `payload ${row.payload}` }, PAYLOAD[row.payload])),
        h("td", { class: "num-col" }, count(row.hops)),
        h("td", { class: "num-col" }, count(row.nbytes)),
        h("td", { class: "num-col" }, count(row.closed_form_hops)),
        h("td", { class: "num-col" }, count(row.closed_form_nbytes)),
        h("td", {}, h("span", { class: `badge ${row.ok ? "ok" : "fail"}` }, row.ok ? "\u2713" : "\u2717")),
      ),
    );
  }
  fill(
    document.getElementById("ring-comm"),
    h("thead", {}, h("tr", {}, ["s7.thPass", "s7.thPayload", "s7.thHops", "s7.thBytes", "s7.thCfHops", "s7.thCfBytes", ""].map((key, i) => h("th", { class: i >= 2 && i <= 5 ? "num-col" : "" }, key ? t(key) : "")))),
    body,
  );
  const kv = data.length * 2 * data.d;
  fill(document.getElementById("ring-comm-note"), t("s7.commNote", { kv, L: data.length, d: data.d, w: data.world_size }));
}

function renderChecks() {
  const names = { o: "O", lse: "LSE", dq: "dQ", dk: "dK", dv: "dV" };
  const cards = data.checks.map((c) =>
    h(
      "div",
      { class: `readout ${c.ok ? "good" : "bad"}`, "data-readout": `ring-${c.name}`, title: t("s7.worstAt", { index: c.index.join(", ") }) },
      h("span", { class: "readout-label" }, t("s7.checkLabel", { name: names[c.name] })),
      h("span", { class: "readout-value" }, num(c.max_diff)),
    ),
  );
  cards.push(
    readout("ring-comm-ok", "s7.commMatch", h("span", { class: `badge ${data.comm_match ? "ok" : "fail"}` }, `${data.comm_match ? "\u2713" : "\u2717"} ${t(data.comm_match ? "common.yes" : "common.no")}`)),
    readout("ring-replay", "s7.replay", num(data.final_state_max_diff), data.final_state_max_diff === 0 ? "good" : "bad"),
  );
  fill(document.getElementById("ring-checks"), cards);
}

// ------------------------------------------------------------------------ balance

function renderBars(p) {
  const summary = data.passes[p];
  const rows = summary.work;
  const most = Math.max(...rows.map((x) => x.tiles_run + x.tiles_skipped), 1);
  const labelW = 70;
  const W = Math.max(280, Math.min(widthOf(document.getElementById("ring-bars"), 540), 560));
  const barW = W - labelW - 90;
  const rowH = 24;
  const height = rows.length * rowH + 8;
  const svg = s("svg", { viewBox: `0 0 ${W} ${height}`, width: W, height, class: "ring-bars", role: "img" });
  svg.append(
    s(
      "defs",
      {},
      s("pattern", { id: "ring-hatch", width: 5, height: 5, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" }, s("rect", { width: 5, height: 5, fill: "#f3f4f6" }), s("line", { x1: 0, y1: 0, x2: 0, y2: 5, stroke: "#cfd5da", "stroke-width": 2 })),
    ),
  );
  rows.forEach((x, i) => {
    const y = i * rowH + 4;
    const wr = (barW * x.tiles_run) / most;
    const ws = (barW * x.tiles_skipped) / most;
    svg.append(
      s(
        "g",
        { "data-rank": String(x.rank) },
        s("text", { x: 0, y: y + 13, class: "bar-label" }, `${t("s7.rank")} ${x.rank}`),
        s("rect", { x: labelW, y, width: wr, height: 16, rx: 2, fill: hue(x.rank).solid }, s("title", {}, t("s7.barRun", { n: x.tiles_run }))),
        s("rect", { x: labelW + wr, y, width: ws, height: 16, rx: 2, fill: "url(#ring-hatch)", stroke: "#d5dadf" }, s("title", {}, t("s7.barSkipped", { n: x.tiles_skipped }))),
        s("text", { x: labelW + wr + ws + 6, y: y + 13, class: "bar-value" }, `${x.tiles_run} / ${x.tiles_skipped}`),
      ),
    );
  });
  fill(
    document.getElementById("ring-bars"),
    svg,
    h(
      "div",
      { class: "readouts" },
      readout("ring-balance", "s7.balance", num(summary.balance), summary.balance <= 1.0001 ? "good" : ""),
      readout("ring-critical", "s7.critical", h("span", { class: "num" }, t("s7.criticalValue", { path: summary.critical_path, ideal: Number(summary.ideal.toFixed(2)) }))),
    ),
  );
}

function renderGrid(n, p) {
  const w = data.world_size;
  const grid = data.passes[p].grid;
  const most = Math.max(...grid.flat().map((c) => c.tiles_run), 1);
  const head = h("tr", {}, h("th", {}, t("s7.thRank")), Array.from({ length: w }, (_x, k) => h("th", { class: `num-col${k === n - 1 ? " current-col" : ""}` }, t("s7.stepN", { step: k + 1 }))));
  const body = h("tbody");
  grid.forEach((row, r) => {
    body.append(
      h(
        "tr",
        { "data-rank": String(r) },
        h("td", {}, h("span", { class: "rank-dot", style: `background:${hue(r).solid}` }), String(r)),
        row.map((cell, k) => {
          const level = cell.tiles_run / most;
          const done = k < n;
          return h(
            "td",
            {
              class: `num-col grid-cell${k === n - 1 ? " current-col" : ""}${done ? "" : " future"}`,
              style: done ? `background: hsl(174 50% ${(97 - 40 * level).toFixed(1)}%)` : null,
              title: t("s7.gridTitle", { rank: r, step: k + 1, shard: cell.shard, run: cell.tiles_run, skipped: cell.tiles_skipped }),
            },
            h("span", { class: "num" }, String(cell.tiles_run)),
            h("span", { class: "grid-shard" }, ` K/V ${cell.shard}`),
          );
        }),
      ),
    );
  });
  fill(document.getElementById("ring-grid"), h("thead", {}, head), body);
}

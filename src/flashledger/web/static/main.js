// Entry point: state from the URL, the tabs, the language switch, the keys that step,
// and the eight sections.

import { getJson } from "./api.js";
import * as backward from "./backward.js";
import * as conventions from "./conventions.js";
import { matrixText } from "./fmt.js";
import * as gpu from "./gpu.js";
import { LANGUAGES, setLanguage } from "./i18n.js";
import * as ledger from "./ledger.js";
import * as running from "./running.js";
import { correct, get, getDefault, initState, set, subscribe } from "./state.js";
import * as ring from "./ring.js";
import * as storage from "./storage.js";
import { renderErrors, stepperFor, watchAllScrolls } from "./widgets.js";

const SECTIONS = ["running", "ledger", "gpu", "backward", "storage", "conventions", "ring", "sources"];
const MODULES = [running, ledger, gpu, backward, storage, conventions, ring];

/** Defaults of every URL key; the seed's data comes from /api/examples. */
function defaultsFrom(examples) {
  const lg = examples.ledger;
  const bw = examples.backward;
  return {
    lang: "en",
    sec: "running",
    // section 02
    scores: lg.scores.map(String).join(", "),
    values: matrixText(lg.values),
    bs: String(lg.block_size),
    shift: "0",
    step: "0",
    avg: "0",
    // sections 03 and 04
    q: matrixText(bw.q),
    k: matrixText(bw.k),
    v: matrixText(bw.v),
    g: matrixText(bw.g),
    bq: String(bw.block_q),
    bk: String(bw.block_k),
    mask: bw.mask,
    wl: "1",
    wr: "0",
    cm: "",
    conv: bw.conventions,
    p: "0",
    seed: "0",
    cap: "",
    alibi: "0",
    slope: "0.5",
    bstep: "0",
    fstep: "0",
    bpass: "backward",
    ml: "128",
    md: "16",
    mb: "32",
    mdt: "float64",
    mc: "1",
    // section 05
    slq: "5",
    slk: "5",
    sd: "2",
    sdv: "",
    sbq: "2",
    sbk: "2",
    smask: "causal_top_left",
    swl: "1",
    swr: "0",
    scm: "",
    sdt: "float64",
    // section 06
    clk: "3",
    cmask: "causal",
    // section 07
    rw: "4",
    rlay: "zigzag",
    rl: "16",
    rd: "4",
    rb: "4",
    rmask: "causal",
    rwl: "3",
    rwr: "0",
    rdata: "random",
    rseed: "0",
    rpass: "forward",
    rstep: "0",
    rrank: "0",
  };
}

function currentSection() {
  return SECTIONS.includes(get("sec")) ? get("sec") : "running";
}

function showSection(name) {
  const sec = SECTIONS.includes(name) ? name : "running";
  for (const el of document.querySelectorAll("main > section")) {
    el.hidden = el.dataset.section !== sec;
  }
  const tabs = document.getElementById("tabs");
  for (const btn of tabs.querySelectorAll("button")) {
    const on = btn.dataset.sec === sec;
    btn.classList.toggle("active", on);
    btn.setAttribute("aria-current", on ? "page" : "false");
    if (on) {
      // bring the active tab into the (sideways scrolling) tab bar, without moving the page
      const left = btn.offsetLeft - tabs.offsetLeft;
      if (left < tabs.scrollLeft || left + btn.offsetWidth > tabs.scrollLeft + tabs.clientWidth) {
        tabs.scrollLeft = left - (tabs.clientWidth - btn.offsetWidth) / 2;
      }
    }
  }
  for (const mod of MODULES) mod.shown?.(sec);
}

/** Tab bar edges: a fade on the side where more tabs are hidden. */
function watchTabs() {
  const tabs = document.getElementById("tabs");
  const update = () => {
    const more = tabs.scrollWidth - tabs.clientWidth;
    tabs.classList.toggle("more-left", more > 1 && tabs.scrollLeft > 1);
    tabs.classList.toggle("more-right", more > 1 && tabs.scrollLeft < more - 1);
  };
  tabs.addEventListener("scroll", update, { passive: true });
  new ResizeObserver(update).observe(tabs);
  update();
}

/** ←/→ step, space plays or pauses, Home/End jump: the stepper of the section shown. */
function onKey(event) {
  if (event.defaultPrevented || event.altKey || event.ctrlKey || event.metaKey) return;
  const target = event.target;
  if (target.closest?.("input, textarea, select, [contenteditable], [role='slider']")) return;
  const ctl = stepperFor(currentSection());
  if (!ctl) return;
  const onButton = target.closest?.("button, a, [role='button']");
  if (event.key === "ArrowRight") ctl.stop(), ctl.go(ctl.current() + 1);
  else if (event.key === "ArrowLeft") ctl.stop(), ctl.go(ctl.current() - 1);
  else if (event.key === "Home" && !onButton) ctl.stop(), ctl.go(0);
  else if (event.key === "End" && !onButton) ctl.stop(), ctl.go(Number.MAX_SAFE_INTEGER);
  else if (event.key === " " && !onButton) ctl.play();
  else return;
  event.preventDefault();
}

/**
 * A link's language or section the page does not have (lang=fr, sec=nonsense) is shown as the
 * default one: the URL is rewritten to say so, in place (no new history entry).
 */
function correctLink() {
  const fixes = {};
  if (!LANGUAGES.includes(get("lang"))) fixes.lang = getDefault("lang");
  if (!SECTIONS.includes(get("sec"))) fixes.sec = getDefault("sec");
  correct(fixes);
}

async function boot() {
  const answer = await getJson("/api/examples");
  if (!answer.ok) {
    document.getElementById("main").textContent = answer.detail;
    return;
  }
  const examples = answer.data;
  initState(defaultsFrom(examples));
  correctLink();
  setLanguage(get("lang"));

  const bus = new EventTarget();
  const ctx = { examples, bus };
  for (const mod of MODULES) mod.init(ctx);

  for (const btn of document.querySelectorAll("#tabs button")) {
    btn.addEventListener("click", () => set({ sec: btn.dataset.sec }));
  }
  document.addEventListener("keydown", onKey);
  watchTabs();
  watchAllScrolls();
  for (const btn of document.querySelectorAll("#lang-switch button")) {
    btn.addEventListener("click", () => set({ lang: btn.dataset.lang }));
  }
  const markLanguage = () => {
    for (const btn of document.querySelectorAll("#lang-switch button")) {
      btn.classList.toggle("active", btn.dataset.lang === get("lang"));
      btn.setAttribute("aria-pressed", String(btn.dataset.lang === get("lang")));
    }
  };
  markLanguage();
  subscribe((changes) => {
    if ("lang" in changes) {
      setLanguage(get("lang"));
      markLanguage();
      for (const mod of MODULES) mod.render();
      renderErrors(); // errors on screen too: field messages and banners, from their kind and limits
      for (const box of document.querySelectorAll(".table-scroll, .svg-scroll")) box.refreshCue?.();
    }
    if ("sec" in changes) {
      showSection(get("sec"));
      window.scrollTo({ top: 0 });
    }
  });
  showSection(get("sec"));
  document.body.dataset.ready = "1";
}

boot();

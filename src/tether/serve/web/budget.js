// Budget bars (semantics §16.2): on every session that has a budget or sits under one, the
// tightest limit as spent / limit, amber at soft and red once exhausted.
//
// What a bar shows comes from subagent.budget of the budgeted sessions only: a session
// without a budget of its own shows its ancestors' (what their trees have spent), so it
// needs no read of its own once it is known to have none. Usage arrives with no event of
// its own, so the budgeted sessions are read again on turn events and, while something in
// the tree runs, on a timer; every session is read again now and then (a budget set since).

import { h, setText } from "./dom.js";
import { call } from "./rpc.js";
import { label, store } from "./state.js";

const LIMITS = ["tokens", "cost_usd", "turn_seconds", "turns"];
const UNITS = { tokens: " tokens", cost_usd: "", turn_seconds: " turn seconds", turns: " turns" };
const RANK = { ok: 0, soft: 1, exhausted: 2 };
const MAX_DEPTH = 64; // as the runtime's lineage walk
const DEBOUNCE_MS = 150;

let onChange = () => {};
let timer = null;
let pendingAll = false;
let busy = null;

/** changed(ids): called with the sessions whose budget was read. */
export function initBudgets(changed) {
  onChange = changed;
}

function amount(key, value) {
  const en = (v, digits) => v.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  if (key === "cost_usd") return value >= 0.01 || value === 0 ? `$${en(value, 2)}` : `$${value.toFixed(6)}`;
  if (key === "turn_seconds") return value >= 10 ? en(value, 0) : value.toFixed(1);
  return en(Math.trunc(value), 0);
}

/** "1,240 of 2,000 tokens", "$0.42 of $1.00", as `tether budget` says it. */
export function spentText(key, spent, limit) {
  return `${amount(key, spent)} of ${amount(key, limit)}${UNITS[key]}`;
}

/**
 * The bar of a session, or null when no budget governs it: the state (the tightest of its
 * own budget and its ancestors'), and the limit shown: the one of the budget that set that
 * state, else the fullest of them all.
 */
export function gauge(id) {
  const chain = []; // the session and its ancestors that have a budget of their own
  let info = store.sessions.get(id);
  for (let depth = 0; info && depth <= MAX_DEPTH; depth++) {
    if (info.budget && info.budget.budget) chain.push(info);
    info = info.parent ? store.sessions.get(info.parent) : null;
  }
  if (!chain.length) return null;
  let state = "ok";
  let decidedBy = null;
  for (const owner of chain) {
    const s = owner.budget.state;
    if (RANK[s] > RANK[state]) [state, decidedBy] = [s, owner.budget.decided_by];
  }
  const decider = chain.find((owner) => owner.id === decidedBy);
  let best = null;
  for (const owner of decider ? [decider] : chain) {
    const status = owner.budget;
    for (const key of LIMITS) {
      const limit = status.limits[key];
      if (limit === undefined) continue;
      const spent = status.spent[key] || 0;
      const fraction = spent / limit;
      if (!best || fraction > best.fraction) best = { owner, key, spent, limit, fraction };
    }
  }
  if (!best) return null;
  return { ...best, state, own: best.owner.id === id };
}

/** A new, empty bar (hidden until it has something to show). */
export function barElement() {
  const fill = h("span", { class: "budget-fill" });
  const text = h("span", { class: "budget-text" });
  const bar = h(
    "div",
    { class: "budget", role: "meter", "aria-label": "Budget", "aria-valuemin": "0", hidden: true },
    h("span", { class: "budget-track" }, fill),
    text,
  );
  bar.parts = { fill, text };
  return bar;
}

/** Show session ``id``'s budget on ``bar``; false (and hidden) when none governs it. */
export function renderBar(bar, id) {
  const g = gauge(id);
  bar.hidden = !g;
  if (!g) return false;
  let text = spentText(g.key, g.spent, g.limit);
  if (!g.own) text += ` (${label(g.owner)}'s tree)`;
  if (g.state !== "ok") text += ` · ${g.state}`;
  setText(bar.parts.text, text);
  bar.parts.fill.style.width = `${Math.min(100, g.fraction * 100).toFixed(1)}%`;
  bar.dataset.level = g.state;
  bar.setAttribute("aria-valuemax", String(g.limit));
  bar.setAttribute("aria-valuenow", String(Math.min(g.spent, g.limit)));
  bar.setAttribute("aria-valuetext", text);
  bar.title = `${text}: the ${g.own ? "budget of this session" : `budget of ${label(g.owner)}`} and its subtree`;
  return true;
}

/** Whether anything in the tree on screen has a budget and runs (spending now). */
export function spending() {
  if (store.root === null) return false;
  let running = false;
  let budgeted = false;
  for (const id of [store.root, ...store.order]) {
    const info = store.sessions.get(id);
    if (!info) continue;
    if (info.state === "running") running = true;
    if (info.budget && info.budget.budget) budgeted = true;
  }
  return running && budgeted;
}

/**
 * Read budgets soon: those of the sessions known to have one and of those never read;
 * with ``all``, of every session in the tree on screen.
 */
export function scheduleBudgets({ all = false } = {}) {
  pendingAll = pendingAll || all;
  if (timer !== null) return;
  timer = setTimeout(() => {
    timer = null;
    const wantAll = pendingAll;
    pendingAll = false;
    readBudgets(wantAll).catch(() => {});
  }, DEBOUNCE_MS);
}

async function readBudgets(all) {
  if (busy) {
    // One pass at a time: ask again once this one is done.
    await busy;
    scheduleBudgets({ all });
    return;
  }
  const root = store.root;
  if (root === null) return;
  const ids = [root, ...store.order].filter((id) => {
    const info = store.sessions.get(id);
    return info && (all || info.budget === undefined || (info.budget && info.budget.budget));
  });
  if (!ids.length) return;
  busy = Promise.all(
    ids.map((id) =>
      call("subagent.budget", { session: id })
        .then((got) => {
          store.sessions.get(id).budget = got.budget;
        })
        .catch(() => {}), // gone, or not readable: keep what was known
    ),
  );
  try {
    await busy;
  } finally {
    busy = null;
  }
  if (store.root === root) onChange([root, ...store.order]);
}

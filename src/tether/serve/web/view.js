// The session view: facts (State, pending, turn), the transcript (paged, following
// live), the turns and the pending inbox. Everything shown is text, never HTML.

import { barElement, renderBar } from "./budget.js";
import { $, fill, h, setText } from "./dom.js";
import { call } from "./rpc.js";
import { applySnapshot, label, store } from "./state.js";

const PAGE = 500;
const FIRST_PAGES = 4; // read at once on opening a session; "Load more" reads on

const VERBS = {
  steered: ["↪", "Steered"], // guidance the turn goes on with: not a stop's ⊘
  cancelled: ["⊘", "Cancelled"],
  aborted: ["⊘", "Aborted"],
  preempted: ["⊘", "Preempted"],
  // U+2016, not U+23F8 (⏸): that one is drawn only where a symbol font is installed.
  paused: ["‖", "Paused"],
  resumed: ["▶", "Resumed"],
};

/**
 * Who acted, as the server's markers say it: `user alice`, `user` (a person who gave no
 * name), `parent (s_…)`, `watchdog`, `budget`, `system (…)`. `short` (the tree) leaves
 * out an agent's id: the session view has it.
 */
export function who(origin, by, { short = false } = {}) {
  if (origin === "watchdog" || origin === "budget") return origin;
  if (origin === "user") return !by || by === "user" ? "user" : `user ${by}`;
  return by && !short ? `${origin} (${by})` : origin;
}

/**
 * A marker as a person reads it, from its fields: `⊘ Cancelled by user alice: reason`.
 * The stored `text` is escaped for models (&lt;…); the raw reason is shown as text.
 */
export function markerText(entry, { short = false } = {}) {
  if (entry.action === "discarded") {
    // A steer no boundary took: the stop that discarded it, or the turn's end, came first.
    const stop = entry.data && entry.data.stop;
    const why = stop ? `the ${stop} came first` : "the turn ended first";
    return `⊘ Discarded steer by ${who(entry.origin, entry.by, { short })} (${why}): ${entry.reason || ""}`;
  }
  const known = VERBS[entry.action];
  if (!known && !entry.action) return entry.text;
  const [mark, verb] = known || ["⊘", entry.action.charAt(0).toUpperCase() + entry.action.slice(1)];
  const by = known && entry.origin ? ` by ${who(entry.origin, entry.by, { short })}` : "";
  return `${mark} ${verb}${by}${entry.reason ? `: ${entry.reason}` : ""}`;
}

let view = null; // {id, lastSeq, more, busy, again}
let budgetBar = null; // the view's budget bar, made on first use

export function openView(id) {
  view = { id, lastSeq: 0, more: false, busy: null, again: false };
  $("view").hidden = false;
  $("transcript").replaceChildren();
  $("turns").replaceChildren();
  $("inbox").replaceChildren();
  $("more").hidden = true;
  setText($("outcome"), "");
  $("outcome").className = "outcome";
  renderFacts();
  return refresh({ pages: FIRST_PAGES });
}

export function closeView() {
  view = null;
  $("view").hidden = true;
}

export function viewing() {
  return view ? view.id : null;
}

/** The facts at the top, from the store (kept live by the event stream). */
export function renderFacts() {
  if (!view) return;
  const info = store.sessions.get(view.id);
  if (!info) return;
  setText($("view-title"), label(info));
  setText($("state"), info.state);
  $("state").dataset.state = info.state;
  // State already reads "paused": the badge is only for a stop under way.
  const badge = info.stopping ? `stopping: ${info.stopping}` : "";
  setText($("badge"), badge);
  $("badge").hidden = !badge;
  setText($("pending"), String(info.pending));
  const waiting = info.state === "running" && info.dispatched === false ? " (waiting for a worker)" : "";
  setText($("turn"), info.turn ? info.turn + waiting : "—");
  setText($("mode"), info.mode);
  setText($("session-id"), info.id);
  setText($("parent"), info.parent || "— (a root)");
  if (!budgetBar) $("budget-slot").append((budgetBar = barElement()));
  $("budget-fact").hidden = !renderBar(budgetBar, info.id);
}

/**
 * Re-read what changed. Calls are serialized per view: a refresh asked for while one
 * runs is folded into one more pass afterwards, so nothing is appended twice.
 */
export function refresh({ pages = 1 } = {}) {
  if (!view) return Promise.resolve();
  const v = view;
  if (v.busy) {
    v.again = true;
    return v.busy;
  }
  v.busy = (async () => {
    try {
      do {
        v.again = false;
        await load(v, pages);
        pages = 1;
      } while (v.again && view === v);
    } finally {
      v.busy = null;
    }
  })();
  return v.busy;
}

async function load(v, pages) {
  const id = v.id;
  // The status for what events do not carry (whether a worker has the turn); a state
  // the event stream has already given is kept (see state.js).
  const [info, turns, inbox] = await Promise.all([
    call("subagent.status", { session: id }),
    call("subagent.turns", { session: id }),
    call("subagent.inbox", { session: id }),
  ]);
  if (view !== v) return;
  applySnapshot(info);
  for (let page = 0; page < pages; page++) {
    const got = await call("subagent.transcript", { session: id, after: v.lastSeq, limit: PAGE });
    if (view !== v) return;
    appendEntries(v, got.entries);
    v.more = got.more;
    if (!got.more) break;
  }
  $("more").hidden = !v.more;
  renderTurns(turns.turns);
  renderInbox(inbox.messages);
  renderFacts();
}

/** "Load more": the next page of the transcript. */
export function loadMore() {
  return refresh({ pages: 1 });
}

function appendEntries(v, entries) {
  const list = $("transcript");
  const pane = list.parentElement;
  const atBottom = pane.scrollHeight - pane.scrollTop - pane.clientHeight < 40;
  for (const entry of entries) {
    if (entry.seq <= v.lastSeq) continue;
    v.lastSeq = entry.seq;
    list.append(renderEntry(entry));
  }
  if (atBottom) pane.scrollTop = pane.scrollHeight;
}

// Markers of a stop that may have a report (semantics §15.6): expanding one shows it.
const STOPS = new Set(["cancelled", "aborted", "preempted", "forced", "escalated"]);

function renderEntry(entry) {
  const kind = entry.kind;
  const text = kind === "marker" ? markerText(entry) : entry.text;
  const classes = ["entry", kind];
  if (kind === "marker" && entry.action) classes.push(`action-${entry.action}`);
  const body =
    kind === "marker" && STOPS.has(entry.action) && entry.turn
      ? stopMarker(entry, text)
      : h("span", { class: "text" }, text);
  return h(
    "li",
    { class: classes.join(" "), "data-seq": entry.seq, "data-turn": entry.turn || "" },
    h("span", { class: "kind" }, kind),
    body,
  );
}

/** A stop marker that opens to its turn's stop report, read when it is opened (so a
 * report completed since, once the turn ended, shows as it is now). */
function stopMarker(entry, text) {
  const report = h("div", { class: "report", role: "region", "aria-label": `Stop report of ${entry.turn}` });
  const details = h("details", { class: "text stop-marker" }, h("summary", {}, text), report);
  details.addEventListener("toggle", () => {
    if (!details.open) return;
    fill(report, h("p", { class: "quiet" }, "reading the stop report…"));
    call("subagent.stopReport", { turn: entry.turn })
      .then((got) => fill(report, reportBody(got.report)))
      .catch((err) => fill(report, h("p", { class: "error" }, String(err))));
  });
  return details;
}

function when(ts) {
  return ts === null || ts === undefined ? "—" : new Date(ts * 1000).toISOString().replace("T", " ").replace("Z", " UTC");
}

function reportBody(r) {
  if (!r) return h("p", { class: "quiet" }, "No stop report: no stop took effect on this turn.");
  const rows = [
    ["Stop", `${r.kind} by ${who(r.origin, r.by)}${r.reason ? `: ${r.reason}` : ""}`],
    ["Requested", when(r.requested_at)],
    [
      "Effective",
      r.effective_at === null || r.effective_at === undefined
        ? "not yet: the turn is still ending"
        : `${when(r.effective_at)} (${r.latency_ms.toFixed(1)} ms, via ${r.via || "unknown"})`,
    ],
    ["Outcome", [r.outcome || "running", r.forced ? "forced" : "", r.escalated ? "escalated" : ""].filter(Boolean).join(" · ")],
  ];
  const dl = h("dl", { class: "report-fields" });
  for (const [name, value] of rows) dl.append(h("dt", {}, name), h("dd", {}, value));
  const procs = r.processes || [];
  const tools = r.tools || [];
  return [
    dl,
    h("h4", {}, `Processes (${procs.length})`),
    procs.length
      ? h("ul", { class: "report-processes" }, ...procs.map((p) => h("li", {}, `pid ${p.pid} · ${p.signal} · ${p.fate} · ${(p.argv || []).join(" ")}`)))
      : h("p", { class: "quiet" }, "none listed"),
    h("h4", {}, `Tool calls (${tools.length})`),
    tools.length
      ? h("ul", { class: "report-tools" }, ...tools.map((t) => h("li", {}, `${t.name} · ${t.fate}${t.call ? ` · ${t.call}` : ""}`)))
      : h("p", { class: "quiet" }, "none open"),
    r.partial ? h("p", { class: "report-partial" }, `Partial: ${r.partial}`) : "",
  ];
}

function renderTurns(turns) {
  const items = [...turns].reverse().map((t) => {
    const outcome = t.outcome || "running";
    const bits = [];
    if (t.cause) bits.push(`cause ${t.cause}`);
    if (t.by) bits.push(`by ${t.by}`);
    if (t.forced) bits.push("forced");
    if (t.escalated) bits.push("escalated");
    if (t.error) bits.push(`error ${t.error}`);
    return h(
      "li",
      { class: `turn outcome-${outcome}`, "data-turn": t.id },
      h("code", {}, t.id),
      " ",
      h("strong", {}, outcome),
      bits.length ? ` · ${bits.join(" · ")}` : "",
      t.message ? h("span", { class: "quiet" }, ` · ${t.message}`) : "",
      t.reason ? h("div", { class: "reason" }, t.reason) : "",
    );
  });
  fill($("turns"), items);
}

function renderInbox(messages) {
  const items = messages.map((m) =>
    h(
      "li",
      { class: `pending kind-${m.kind}`, "data-message": m.id },
      h("code", {}, m.id),
      ` ${m.kind}${m.sender ? ` from ${m.sender}` : ""}: `,
      h("span", { class: "preview" }, m.preview),
    ),
  );
  fill($("inbox"), items);
  $("inbox-empty").hidden = messages.length > 0;
}

// The Tether console: a root's session tree, live from GET /events, and one session's
// view with Send and Stop. It uses only the public JSON-RPC and /events.
//
//   app.js      start-up, auth, the root picker, events -> store -> screen
//   state.js    what the console knows (sessions by id, the root, the selection)
//   tree.js     the tree (role="tree")
//   view.js     the session view: facts, transcript, turns, inbox
//   budget.js   budget bars: the tightest limit over each session, read with subagent.budget
//   composer.js Send, Stop and its menu, the reason dialog
//   events.js   server-sent events read with fetch (so the token goes in a header)
//   rpc.js      JSON-RPC calls and the token in sessionStorage
//   dom.js      element helpers that only ever create text nodes

import { $, h, setText } from "./dom.js";
import { EventStream } from "./events.js";
import { initBudgets, scheduleBudgets, spending } from "./budget.js";
import { call, getToken, onUnauthorized, probe, setToken } from "./rpc.js";
import { applySnapshot, forgetEventState, markerStands, session, STATE_FIELDS, store } from "./state.js";
import { initComposer, resetComposer, updateComposer } from "./composer.js";
import { initTree, markSelected, renderTree, updateRow } from "./tree.js";
import { closeView, loadMore, openView, refresh, renderFacts, viewing } from "./view.js";

const RESYNC_MS = 10000; // a spawn with no prompt emits no event: re-list now and then
const SPENDING_MS = 2000; // usage has no event: budgets are read this often while a turn runs
// Events after which a tree may have spent (a turn ended or started, a budget's marker),
// or a budget's state changed (`budget`: a crossing, a budget set).
const BUDGET_EVENTS = new Set(["turn.started", "turn.ended", "marker", "budget"]);

const stream = new EventStream({ onEvent, onStatus, onGap });
let treeTimer = null;
let viewTimer = null;
let picks = 0; // sessions selected so far: a root's load keeps one picked while it ran

// ---- start-up and auth --------------------------------------------------------------

async function start() {
  takeTokenFromLink();
  initTree(selectSession);
  initBudgets((ids) => {
    for (const id of ids) updateRow(id);
    renderFacts();
  });
  initComposer(() => scheduleView());
  $("more").addEventListener("click", () => loadMore().catch(showError));
  $("root-picker").addEventListener("change", (ev) => {
    if (ev.target.value) selectRoot(ev.target.value);
  });
  $("root-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = $("root-id").value.trim();
    if (id) openAny(id);
  });
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setToken($("token").value.trim());
    $("token").value = "";
    $("token-dialog").close();
    connect();
  });
  $("token-dialog").addEventListener("cancel", (ev) => ev.preventDefault());
  onUnauthorized(() => askToken(getToken() ? "The server refused that token." : null));
  window.addEventListener("hashchange", fromHash);
  setInterval(() => {
    if (store.root && !document.hidden) {
      scheduleTree();
      scheduleBudgets({ all: true });
    }
  }, RESYNC_MS);
  setInterval(() => {
    if (!document.hidden && spending()) scheduleBudgets();
  }, SPENDING_MS);
  await connect();
}

async function connect() {
  try {
    if (!(await probe())) {
      askToken(getToken() ? "The server refused that token." : null);
      return;
    }
  } catch (err) {
    onStatus(String(err));
    setTimeout(connect, 2000);
    return;
  }
  stream.start();
  await fromHash();
}

// `tether console` prints a link whose fragment holds the token (a fragment never
// reaches a server): kept like a typed one, then taken out of the address bar and history.
function takeTokenFromLink() {
  const params = hashParams();
  const token = params.get("token");
  if (!token) return;
  setToken(token.trim());
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
}

function askToken(error) {
  stream.stop();
  setToken(null);
  const box = $("token-error");
  setText(box, error || "");
  box.hidden = !error;
  onStatus("needs a token");
  if (!$("token-dialog").open) $("token-dialog").showModal();
  $("token").focus();
}

function onStatus(text) {
  setText($("link"), text);
  $("link").dataset.status = text;
}

function showError(err) {
  const out = $("outcome");
  out.className = "outcome error";
  setText(out, String(err));
}

// ---- navigation: #root=ID&session=ID ---------------------------------------------------

function hashParams() {
  return new URLSearchParams(location.hash.slice(1));
}

async function fromHash() {
  const params = hashParams();
  const root = params.get("root");
  if (root && root !== store.root) await selectRoot(root, params.get("session"));
  else if (root && params.get("session") && params.get("session") !== store.selected) selectSession(params.get("session"));
}

function writeHash() {
  const params = new URLSearchParams();
  if (store.root) params.set("root", store.root);
  if (store.selected && store.selected !== store.root) params.set("session", store.selected);
  const hash = `#${params}`;
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

/** Open a session typed in by id: its root's tree, with it selected. */
async function openAny(id) {
  try {
    let info = await call("subagent.status", { session: id });
    let root = info.id;
    while (info.parent) {
      info = await call("subagent.status", { session: info.parent });
      root = info.id;
    }
    await selectRoot(root, id);
    $("root-id").value = "";
  } catch (err) {
    treeNote(`${id}: ${err}`);
  }
}

// ---- roots -------------------------------------------------------------------------

function addRoot(id) {
  if (store.roots.has(id)) return;
  store.roots.set(id, { id, slug: null });
  renderPicker();
  call("subagent.status", { session: id })
    .then((info) => {
      store.roots.get(id).slug = info.slug;
      applySnapshot(info);
      renderPicker();
    })
    .catch(() => {});
  if (store.root === null && !hashParams().get("root")) selectRoot(id);
}

function renderPicker() {
  const picker = $("root-picker");
  const options = [...store.roots.values()].map((r) =>
    h("option", { value: r.id }, r.slug ? `${r.slug} · ${r.id}` : r.id),
  );
  if (options.length === 0) options.push(h("option", { value: "" }, "(no root yet)"));
  picker.replaceChildren(...options);
  picker.value = store.root || "";
}

async function selectRoot(id, sessionId = null) {
  store.root = id;
  store.order = [];
  addRoot(id);
  const picked = picks;
  const tree = $("tree");
  tree.setAttribute("aria-busy", "true");
  try {
    await loadTree();
  } catch (err) {
    if (store.root === id) {
      store.root = null;
      store.roots.delete(id);
      renderPicker();
      tree.removeAttribute("aria-busy");
    }
    treeNote(`${id}: ${err}`);
    return;
  }
  if (store.root !== id) return; // another root was chosen while this one loaded
  // The event stream can draw the tree (a re-list) before this first load answers: a
  // session picked in it meanwhile stays picked, the load's answer does not undo a click.
  const kept = picks !== picked && (store.selected === id || store.order.includes(store.selected));
  if (!kept) selectSession(sessionId && store.sessions.has(sessionId) ? sessionId : id);
  tree.removeAttribute("aria-busy");
}

async function loadTree() {
  const root = store.root;
  if (root === null) return;
  const [info, list] = await Promise.all([
    call("subagent.status", { session: root }),
    call("subagent.list", { root, scope: "descendants" }),
  ]);
  if (store.root !== root) return;
  applySnapshot(info);
  if (store.roots.has(root)) store.roots.get(root).slug = info.slug;
  for (const agent of list.agents) applySnapshot(agent);
  store.order = list.agents.map((a) => a.id);
  scheduleBudgets(); // sessions new to the console, and those with a budget
  renderPicker();
  renderTree();
  updateComposer();
  renderFacts();
}

function treeNote(text) {
  renderTree();
  setText($("tree-empty"), text);
  $("tree-empty").hidden = false;
}

function scheduleTree() {
  if (treeTimer !== null) return;
  treeTimer = setTimeout(() => {
    treeTimer = null;
    loadTree().catch((err) => onStatus(String(err)));
  }, 50);
}

function scheduleView() {
  if (viewTimer !== null) return;
  viewTimer = setTimeout(() => {
    viewTimer = null;
    refresh().catch(showError);
  }, 30);
}

function selectSession(id) {
  if (!store.sessions.has(id)) return;
  picks += 1;
  const changed = viewing() !== id;
  store.selected = id;
  markSelected();
  writeHash();
  if (changed) {
    resetComposer();
    openView(id).catch(showError);
  }
  updateComposer();
}

// ---- the event stream ----------------------------------------------------------------

function onEvent(ev) {
  const root = ev.lineage.length ? ev.lineage[0] : ev.session;
  addRoot(root);
  const known = store.sessions.has(ev.session);
  const info = session(ev.session);
  if (ev.event === "state") {
    const turn = info.turn;
    for (const field of STATE_FIELDS) info[field] = ev.data[field];
    info.fromEvents = true;
    if (info.turn !== turn) info.dispatched = undefined; // unknown until re-listed
  } else if (ev.event === "marker") {
    info.marker = ev.data.entry;
  } else if (ev.event === "budget" && !(info.budget && info.budget.budget)) {
    info.budget = undefined; // a budget set where none was: read it with the others
  }
  // The tree shows a marker while its turn runs, or a stop until the next turn starts.
  if (info.marker && !markerStands(info.marker, ev)) info.marker = null;
  if (root === store.root) {
    const inTree = ev.session === root || store.order.includes(ev.session);
    // No event says a worker took a turn: while that is unknown or not yet so, re-list.
    const unsure = info.state === "running" && info.dispatched !== true;
    if (!known || !inTree || unsure || (ev.event === "entry" && ev.data.entry.kind === "tool")) scheduleTree();
    updateRow(ev.session);
    if (BUDGET_EVENTS.has(ev.event)) scheduleBudgets();
  }
  if (ev.session === store.selected) {
    renderFacts();
    scheduleView();
  }
  // The selected session, its parent (Send needs it live) and the sessions below it
  // (Stop subtree is offered while any of them runs).
  const sel = store.selected;
  if (sel && (ev.session === sel || ev.session === session(sel).parent || ev.lineage.includes(sel))) {
    updateComposer();
  }
}

function onGap() {
  forgetEventState();
  scheduleTree();
  scheduleBudgets({ all: true });
  scheduleView();
}

start();

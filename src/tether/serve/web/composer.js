// The composer: a message box with Send, and Stop with its menu. They are independent:
// while a turn runs both are usable. A parent-offline child keeps Stop and loses Send
// (with a note why); a one-shot child shows no Stop.
//
// Stop is bound to the turn on screen when it is clicked: the call carries `turn=`, so a
// stale click can never stop a later turn, and a no-op answer says "already finished".

import { $, h, setText } from "./dom.js";
import { call } from "./rpc.js";
import { hasStop, label, sendBlocked, store } from "./state.js";

// The Stop menu. Each item says what its dialog asks for and what it calls: an item with
// its own `run` calls that instead of subagent.interrupt, one with `shown` is offered only
// for the sessions it accepts, and one with `noDialog` acts at once (there is nothing to
// ask). Pause carries the turn guard like the interrupts; Resume acts on whatever is paused.
export const STOP_ITEMS = [
  {
    name: "Steer",
    kind: "steer",
    done: "steered",
    needsText: true,
    hint: "Steer requires text: the agent reads it at its next boundary and goes on.",
  },
  {
    name: "Cancel",
    kind: "cancel",
    done: "cancelled",
    timing: true,
    hint: "The agent wraps up at its next boundary; after the grace it is killed. With a deadline, no boundary in time escalates to an abort.",
  },
  {
    name: "Abort",
    kind: "abort",
    done: "aborted",
    hint: "Kills the turn's whole process tree now.",
  },
  {
    name: "Preempt",
    kind: "preempt",
    done: "preempted",
    hint: "Kills only the running command; the turn goes on.",
  },
  {
    name: "Stop subtree…",
    kind: "subtree",
    done: "stopped",
    subtree: true,
    hint: "Stops this session's running turn and the running turn of every session below it, each on its own turn. Cancel lets each wrap up (killed after the grace); Abort kills every tree now.",
    run: (params) =>
      call("subagent.interrupt", {
        address: params.address,
        kind: $("subtree-abort").checked ? "abort" : "cancel",
        reason: params.reason,
        turn: params.turn,
        scope: "subtree",
        name: params.name,
      }),
  },
  {
    name: "Pause",
    kind: "pause",
    done: "paused",
    shown: (info) => info.state !== "paused",
    hint: "Freezes the turn in place, its commands too, keeping everything until Resume. Messages queue meanwhile; a steer or a cancel takes effect after Resume; Abort still stops it at once.",
    run: (params) =>
      call("subagent.pause", { address: params.address, reason: params.reason, turn: params.turn, name: params.name }),
  },
  {
    name: "Resume",
    kind: "resume",
    done: "resumed",
    noDialog: true,
    shown: (info) => info.state === "paused",
    run: (params) => call("subagent.resume", { address: params.address, name: params.name }),
  },
];

// Who the person is, kept in this browser (not per tab, unlike the token: a name is no
// secret): sent as `name` with every stop and send, so markers read "by user NAME" rather
// than "by user". Left empty: "by user".
const NAME_KEY = "tether.name";

function myName() {
  const name = $("me").value.trim();
  return name || undefined;
}

function initName() {
  const input = $("me");
  try {
    input.value = localStorage.getItem(NAME_KEY) || "";
  } catch {
    input.value = ""; // storage refused (a private window's policy): a name for this page only
  }
  const keep = () => {
    try {
      if (input.value.trim()) localStorage.setItem(NAME_KEY, input.value.trim());
      else localStorage.removeItem(NAME_KEY);
    } catch {
      // not kept across loads; it still applies to this page
    }
  };
  input.addEventListener("change", keep);
  $("me-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    keep();
    input.blur();
  });
}

let target = null; // what Stop was clicked for: {id, parent, turn, name}
let chosen = null; // the STOP_ITEMS entry whose dialog is open
let refreshView = () => {};

export function initComposer(onChanged) {
  refreshView = onChanged;
  initName();
  const menu = $("stop-menu");
  for (const item of STOP_ITEMS) {
    const button = h("button", { type: "button", role: "menuitem", tabindex: "-1", "data-kind": item.kind }, item.name);
    button.addEventListener("click", () => choose(item));
    menu.append(h("li", { role: "none" }, button));
  }
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  $("message").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
      ev.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", toggleMenu);
  menu.addEventListener("keydown", menuKeys);
  document.addEventListener("click", (ev) => {
    if (!menu.hidden && !ev.target.closest(".stop")) closeMenu(false);
  });
  $("reason-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    confirm();
  });
  $("reason-back").addEventListener("click", () => $("reason-dialog").close());
  $("reason").addEventListener("input", updateConfirm);
}

/** Enable, disable or hide the controls for the session on screen. */
export function updateComposer() {
  const info = store.selected ? store.sessions.get(store.selected) : null;
  if (!info) return;
  const blocked = sendBlocked(info);
  $("message").disabled = blocked !== null;
  $("send").disabled = blocked !== null;
  $("no-wake").disabled = blocked !== null;
  setText($("send-note"), blocked || "");
  $("send-note").hidden = blocked === null;
  const stop = $("stop");
  stop.hidden = !hasStop(info);
  const running = Boolean(info.turn) && info.state !== "settled";
  const below = runningBelow(info.id);
  stop.disabled = !running && !below;
  stop.title = running ? `stop turn ${info.turn}` : below ? "sessions below are running" : "nothing is running";
  showItems(info);
  if (stop.hidden || stop.disabled) closeMenu(false);
}

/** Whether a session below `id` (as far as the console knows) has a turn running. */
function runningBelow(id) {
  for (const other of store.sessions.values()) {
    if (!other.turn || other.mode === "one-shot" || other.state === "settled") continue;
    const seen = new Set();
    for (let up = other.parent; up && !seen.has(up); up = store.sessions.get(up)?.parent) {
      if (up === id) return true;
      seen.add(up);
    }
  }
  return false;
}

/** Offer only the items that apply to the session as it is now (Pause, or Resume; with
 * only its descendants running, Stop subtree alone). */
function showItems(info) {
  const running = Boolean(info.turn) && info.state !== "settled";
  for (const item of STOP_ITEMS) {
    const button = $("stop-menu").querySelector(`[data-kind="${item.kind}"]`);
    const shown = (!item.shown || item.shown(info)) && (running || Boolean(item.subtree));
    button.parentElement.hidden = !shown;
    button.disabled = !shown;
  }
}

export function resetComposer() {
  $("message").value = "";
  $("no-wake").checked = false;
  closeMenu(false);
  if ($("reason-dialog").open) $("reason-dialog").close();
}

function say(text, { error = false } = {}) {
  const out = $("outcome");
  out.className = error ? "outcome error" : "outcome";
  out.setAttribute("role", error ? "alert" : "status");
  setText(out, text);
}

function address(info) {
  // The RPC caller acts as User(parent=…); a root's owner is addressed by its own id.
  return { session: info.id, parent: info.parent || info.id, mode: "continuable" };
}

async function send() {
  const info = store.sessions.get(store.selected);
  if (!info || $("send").disabled) return;
  const content = $("message").value;
  if (!content.trim()) {
    $("message").focus();
    return;
  }
  const wake = !$("no-wake").checked;
  $("send").disabled = true;
  try {
    const answer = await call("subagent.send", { address: address(info), content, wake, name: myName() });
    $("message").value = "";
    $("no-wake").checked = false; // a per-message choice: the next send wakes again
    say(`Sent ${answer.message}${wake ? "" : " (not waking)"} to ${label(info)}.`);
    refreshView();
  } catch (err) {
    say(String(err), { error: true });
  } finally {
    updateComposer();
  }
}

// ---- Stop and its menu -------------------------------------------------------------

function items() {
  return [...$("stop-menu").querySelectorAll('[role="menuitem"]')].filter((b) => !b.parentElement.hidden);
}

function toggleMenu() {
  if (!$("stop-menu").hidden) {
    closeMenu(true);
    return;
  }
  const info = store.sessions.get(store.selected);
  if (!info || (!info.turn && !runningBelow(info.id))) return;
  // The turn on screen now is the one this Stop is for, whatever runs later.
  target = { id: info.id, parent: info.parent, turn: info.turn, name: label(info), info };
  showItems(info);
  $("stop-menu").hidden = false;
  $("stop").setAttribute("aria-expanded", "true");
  items()[0].focus();
}

function closeMenu(refocus) {
  const menu = $("stop-menu");
  if (menu.hidden) return;
  menu.hidden = true;
  $("stop").setAttribute("aria-expanded", "false");
  if (refocus) $("stop").focus();
}

function menuKeys(ev) {
  const all = items();
  const at = all.indexOf(document.activeElement);
  if (ev.key === "ArrowDown") all[(at + 1) % all.length].focus();
  else if (ev.key === "ArrowUp") all[(at - 1 + all.length) % all.length].focus();
  else if (ev.key === "Home") all[0].focus();
  else if (ev.key === "End") all[all.length - 1].focus();
  else if (ev.key === "Escape" || ev.key === "Tab") closeMenu(true);
  else return;
  ev.preventDefault();
}

function choose(item) {
  closeMenu(false);
  if (!target) return;
  if (item.noDialog) {
    act(item, target, { address: address(target.info), turn: target.turn, name: myName() });
    return;
  }
  chosen = item;
  const turn = target.turn ? `, turn ${target.turn}` : ", its running descendants";
  setText($("reason-title"), `${item.name.replace("…", "")} ${target.name}${turn}`);
  setText($("reason-hint"), item.hint);
  $("reason").value = "";
  $("reason").required = Boolean(item.needsText);
  $("subtree-fields").hidden = !item.subtree;
  $("subtree-cancel").checked = true;
  $("cancel-fields").hidden = !item.timing && !item.subtree;
  $("grace").value = "";
  $("deadline").value = "";
  updateConfirm();
  $("reason-dialog").showModal();
  $("reason").focus();
}

function updateConfirm() {
  $("confirm").disabled = Boolean(chosen && chosen.needsText && !$("reason").value.trim());
}

function number(input) {
  // Whatever the person typed goes to the server, which validates it (and says why not).
  return input.value === "" || Number.isNaN(input.valueAsNumber) ? undefined : input.valueAsNumber;
}

async function confirm() {
  if (!chosen || !target || $("confirm").disabled) return;
  const item = chosen;
  const stopped = target;
  const params = {
    address: address(stopped.info),
    kind: item.kind,
    reason: $("reason").value,
    turn: stopped.turn || undefined,
    name: myName(),
  };
  if (item.timing || item.subtree) {
    const grace = number($("grace"));
    const deadline = number($("deadline"));
    if (grace !== undefined) params.grace = grace;
    if (deadline !== undefined) params.deadline = deadline;
  }
  $("reason-dialog").close();
  await act(item, stopped, params);
}

async function act(item, stopped, params) {
  try {
    const answer = item.run ? await item.run(params) : await call("subagent.interrupt", params);
    // An interrupt names its turn; a pause or a resume lists the turns it acted on.
    const turns = answer.turns || (answer.turn ? [answer.turn] : []);
    const what = item.name.replace("…", "");
    if (turns.length) say(`${what}: issued to turn ${turns.join(", ")} of ${stopped.name}${item.subtree ? " and below" : ""}.`);
    else if (item.kind === "resume") say(`nothing to resume: ${stopped.name} is not paused.`);
    else if (item.subtree) say(`nothing was running in the subtree of ${stopped.name}, so nothing was stopped.`);
    else say(`already finished: turn ${stopped.turn} of ${stopped.name} is no longer running, so nothing was ${item.done}.`);
    refreshView();
  } catch (err) {
    say(String(err), { error: true });
  }
}

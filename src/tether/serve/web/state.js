// What the console knows, in one place. Sessions are kept by id across roots.
//
// A session's state comes from the `state` events once one has been seen for it (the
// stream is in order, and every transition emits one, so the last event applied is the
// truth as of its time); a snapshot from subagent.list/status fills only sessions the
// stream has not spoken of yet. A `gap` on the stream clears that and re-reads.

export const STATE_FIELDS = ["state", "pending", "stopping", "turn"];
export const OFFLINE = new Set(["dormant", "settled", "disposing"]);

export const store = {
  roots: new Map(), // id -> {id, slug}
  root: null, // the root on screen
  order: [], // the root's descendants, pre-order, as subagent.list gave them
  sessions: new Map(), // id -> info (AgentInfo fields + marker + fromEvents)
  selected: null, // the session on screen
};

export function session(id) {
  let info = store.sessions.get(id);
  if (!info) {
    info = { id, slug: null, parent: undefined, depth: 0, mode: "continuable", state: "?", pending: 0, stopping: null, turn: null, marker: null, fromEvents: false };
    store.sessions.set(id, info);
  }
  return info;
}

/** Merge a snapshot (AgentInfo) into what the console knows. */
export function applySnapshot(agent) {
  const info = session(agent.id);
  info.slug = agent.slug;
  info.parent = agent.parent;
  info.depth = agent.depth;
  info.mode = agent.mode;
  info.dispatched = agent.dispatched;
  if (!info.fromEvents) for (const field of STATE_FIELDS) info[field] = agent[field];
  return info;
}

export function forgetEventState() {
  for (const info of store.sessions.values()) info.fromEvents = false;
}

// Stops that end their turn: the marker says why the session is parked, until a later
// turn starts. Any other marker (a steer, a preempt, a pause) speaks of its running turn.
const ENDS_TURN = new Set(["cancelled", "aborted", "forced", "escalated"]);

/** Whether a session's last marker still describes it after `ev`, one of its events. */
export function markerStands(marker, ev) {
  const turn = ev.data && ev.data.turn;
  if (ev.event === "turn.started") return turn === marker.turn;
  if (ev.event === "turn.ended") return turn !== marker.turn || ENDS_TURN.has(marker.action);
  return true;
}

/** The name a person reads: the slug, else the id. */
export function label(info) {
  return info.slug || info.id;
}

/** Why a person cannot send to this session, or null when they can. */
export function sendBlocked(info) {
  if (info.mode === "one-shot") return "A one-shot subagent belongs to the holder of its handle: it takes no messages from here.";
  if (info.state === "settled" || info.state === "disposing") return `This session is ${info.state}: it takes no more messages.`;
  if (info.parent) {
    const parent = store.sessions.get(info.parent);
    if (parent && OFFLINE.has(parent.state)) {
      return `Send is off: its parent ${label(parent)} is ${parent.state} (offline), and a message to a subagent needs a live parent. Stop still works.`;
    }
  }
  return null;
}

/** Whether the console offers Stop at all: a one-shot child has none. */
export function hasStop(info) {
  return info.mode !== "one-shot";
}

// The session tree (role="tree"): one treeitem per session, named by its slug (or id),
// with its state, pending count, a stopping badge, its budget bar and its last marker
// while that describes it (state.js, markerStands).
// Rows are kept by id and updated in place, so a live update never steals focus.

import { $, h, setText } from "./dom.js";
import { barElement, renderBar } from "./budget.js";
import { label, store } from "./state.js";
import { markerText } from "./view.js";

const rows = new Map(); // id -> {li, name, state, pending, badge, budget, marker, group}
let onSelect = () => {};

export function initTree(select) {
  onSelect = select;
  $("tree").addEventListener("keydown", keyboard);
}

function row(id) {
  let r = rows.get(id);
  if (r) return r;
  const name = h("span", { class: "name" });
  const state = h("span", { class: "state" });
  const pending = h("span", { class: "pending" });
  const badge = h("span", { class: "badge", hidden: true });
  const budget = barElement();
  const marker = h("span", { class: "marker-line" });
  const describe = `row-${id}`;
  const line = h("div", { class: "row", id: describe }, name, state, badge, pending, budget, marker);
  const li = h("li", { role: "treeitem", "data-id": id, tabindex: "-1", "aria-describedby": describe }, line);
  line.addEventListener("click", (ev) => {
    ev.stopPropagation();
    onSelect(id);
  });
  r = { li, name, state, pending, badge, budget, marker, group: null };
  rows.set(id, r);
  return r;
}

/** Redraw the structure (after a snapshot) and every row. */
export function renderTree() {
  const tree = $("tree");
  const root = store.root;
  $("tree-empty").hidden = root !== null;
  if (root === null) {
    tree.replaceChildren();
    return;
  }
  const children = new Map(); // parent id -> [ids]
  for (const id of store.order) {
    const parent = store.sessions.get(id).parent;
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(id);
  }
  const place = (id, level) => {
    const r = row(id);
    r.li.setAttribute("aria-level", String(level));
    const kids = children.get(id) || [];
    if (kids.length) {
      if (!r.group) {
        r.group = h("ul", { role: "group" });
        r.li.append(r.group);
      }
      r.group.replaceChildren(...kids.map((kid) => place(kid, level + 1)));
      r.li.setAttribute("aria-expanded", "true");
    } else {
      if (r.group) r.group.remove();
      r.group = null;
      r.li.removeAttribute("aria-expanded");
    }
    updateRow(id);
    return r.li;
  };
  const top = place(root, 1);
  if (tree.firstChild !== top || tree.childNodes.length !== 1) tree.replaceChildren(top);
  updateFocus();
}

/** Refresh one row's text from the store. */
export function updateRow(id) {
  const r = rows.get(id);
  const info = store.sessions.get(id);
  if (!r || !info) return;
  r.li.setAttribute("aria-label", label(info));
  r.li.dataset.state = info.state;
  r.li.setAttribute("aria-selected", String(store.selected === id));
  setText(r.name, label(info));
  // As `tether tree` says it: a claimed turn no worker has taken yet is not running.
  setText(r.state, info.state === "running" && info.dispatched === false ? "waiting for a worker" : info.state);
  setText(r.pending, info.pending ? `${info.pending} pending` : "");
  const badge = info.stopping ? `stopping: ${info.stopping}` : "";
  setText(r.badge, badge);
  r.badge.hidden = !badge;
  renderBar(r.budget, id);
  setText(r.marker, info.marker ? markerText(info.marker, { short: true }) : "");
  r.marker.title = info.marker ? markerText(info.marker) : "";
  r.marker.dataset.action = info.marker ? info.marker.action || "" : "";
}

function updateFocus() {
  const items = visibleItems();
  const current = items.find((li) => li.dataset.id === store.selected) || items[0];
  for (const li of items) li.tabIndex = li === current ? 0 : -1;
}

export function markSelected() {
  for (const [id, r] of rows) r.li.setAttribute("aria-selected", String(store.selected === id));
  updateFocus();
}

function visibleItems() {
  return [...$("tree").querySelectorAll('[role="treeitem"]')];
}

function keyboard(ev) {
  const items = visibleItems();
  const at = items.indexOf(document.activeElement);
  if (at < 0) return;
  let next = null;
  if (ev.key === "ArrowDown") next = items[at + 1];
  else if (ev.key === "ArrowUp") next = items[at - 1];
  else if (ev.key === "Home") next = items[0];
  else if (ev.key === "End") next = items[items.length - 1];
  else if (ev.key === "Enter" || ev.key === " ") {
    onSelect(items[at].dataset.id);
    ev.preventDefault();
    return;
  } else return;
  ev.preventDefault();
  if (next) {
    for (const li of items) li.tabIndex = li === next ? 0 : -1;
    next.focus();
  }
}

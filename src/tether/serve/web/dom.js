// DOM helpers. Text goes in through text nodes only: nothing in the console ever
// parses a string as HTML, so a reason like <img src=x onerror=…> shows as written.

/** h("li", {class: "x", "aria-label": "y"}, "text", child) */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

/** Append children: Nodes as they are, anything else as text. */
export function append(el, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replace every child of el. */
export function fill(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

export const $ = (id) => document.getElementById(id);

export function setText(el, text) {
  const value = text === null || text === undefined ? "" : String(text);
  if (el.textContent !== value) el.textContent = value;
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// GET /events read with fetch() and a stream reader. EventSource cannot send an
// Authorization header, and the token must not go into the URL, so this small reader
// parses server-sent events itself and resumes with Last-Event-ID after a disconnection.

import { authHeaders, unauthorized } from "./rpc.js";
import { sleep } from "./dom.js";

export class EventStream {
  /**
   * onEvent({id, event, session, lineage, data, ts}); onStatus("live"|"reconnecting"|…);
   * onGap(): events were lost, re-read state. lastId 0 replays what the server retains.
   */
  constructor({ onEvent, onStatus, onGap }) {
    this.onEvent = onEvent;
    this.onStatus = onStatus;
    this.onGap = onGap;
    this.lastId = 0;
    this.controller = null;
    this.stopped = true;
  }

  start() {
    if (!this.stopped) return;
    this.stopped = false;
    this.run();
  }

  stop() {
    this.stopped = true;
    if (this.controller) this.controller.abort();
  }

  async run() {
    let backoff = 250;
    while (!this.stopped) {
      this.controller = new AbortController();
      let reason = "reconnecting";
      try {
        const headers = { Accept: "text/event-stream", ...authHeaders() };
        if (this.lastId !== null) headers["Last-Event-ID"] = String(this.lastId);
        const res = await fetch("/events", {
          headers,
          signal: this.controller.signal,
          credentials: "omit",
          cache: "no-store",
        });
        if (res.status === 401) {
          this.stopped = true;
          unauthorized();
          return;
        }
        if (!res.ok) throw new Error(`HTTP ${res.status}`);
        this.onStatus("live");
        backoff = 250;
        reason = await this.read(res.body);
      } catch {
        if (this.stopped) return;
      }
      if (this.stopped) return;
      this.onStatus(reason === "shutdown" ? "server stopped" : "reconnecting");
      if (reason !== "slow-consumer") {
        await sleep(backoff);
        backoff = Math.min(backoff * 2, 5000);
      }
    }
  }

  /** Reads until the stream ends; the reason of its final `closed` event, if any. */
  async read(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let closed = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return closed;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const ev = parse(block);
        if (ev === null) continue;
        if (ev.id !== null) this.lastId = ev.id;
        if (ev.event === "closed") {
          closed = ev.data.reason;
          if (typeof ev.data.last_id === "number") this.lastId = ev.data.last_id;
        } else if (ev.event === "gap") {
          this.onGap();
        } else {
          this.onEvent(ev.data);
        }
      }
    }
  }
}

function parse(block) {
  let id = null;
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "id" && /^\d+$/.test(value)) id = Number(value);
    else if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (data.length === 0) return null;
  try {
    return { id, event, data: JSON.parse(data.join("\n")) };
  } catch {
    return null;
  }
}

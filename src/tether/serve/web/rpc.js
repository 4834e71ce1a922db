// JSON-RPC 2.0 over POST /rpc, with the bearer token when the server has one.
// The token lives in this tab's sessionStorage and travels only in the Authorization
// header: never in a URL, never in a cookie (fetch is told to send no credentials).

const TOKEN_KEY = "tether.token";

export class RpcError extends Error {
  /** code: the Tether code (error.data.code), e.g. "parent-offline"; or "http-413". */
  constructor(code, message) {
    super(message);
    this.code = code;
  }
  toString() {
    return `${this.code}: ${this.message}`;
  }
}

export class Unauthorized extends RpcError {
  constructor() {
    super("unauthorized", "the server refused the token");
  }
}

export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export function authHeaders() {
  const token = getToken();
  return token ? { Authorization: `Bearer ${token}` } : {};
}

let unauthorizedHandler = () => {};

/** Called (once per refusal) when the server answers 401. */
export function onUnauthorized(handler) {
  unauthorizedHandler = handler;
}

export function unauthorized() {
  unauthorizedHandler();
  return new Unauthorized();
}

async function httpError(res) {
  let message = `HTTP ${res.status}`;
  try {
    const body = await res.json();
    if (body && typeof body.error === "string") message = body.error;
  } catch {
    // not JSON: keep the status line
  }
  return new RpcError(`http-${res.status}`, message);
}

/** 200 from GET /health with the current token: false on 401. */
export async function probe() {
  const res = await fetch("/health", { headers: authHeaders(), credentials: "omit", cache: "no-store" });
  if (res.status === 401) return false;
  if (!res.ok) throw await httpError(res);
  return true;
}

let nextId = 1;

/** One call; its result, or an RpcError with the server's code and message. */
export async function call(method, params = {}) {
  let res;
  try {
    res = await fetch("/rpc", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ jsonrpc: "2.0", id: nextId++, method, params }),
      credentials: "omit",
      cache: "no-store",
    });
  } catch {
    throw new RpcError("unreachable", "the server cannot be reached");
  }
  if (res.status === 401) throw unauthorized();
  if (!res.ok) throw await httpError(res);
  const doc = await res.json();
  if (doc.error) {
    const code = doc.error.data && doc.error.data.code ? doc.error.data.code : String(doc.error.code);
    throw new RpcError(code, String(doc.error.message));
  }
  return doc.result;
}

// Talking to the Tandem API: the token, JSON requests, and Server-Sent Events read with fetch().
//
// The token lives in sessionStorage (this tab only) and travels only in the Authorization header.
// EventSource cannot send headers, so streams are read from fetch()'s body and parsed here.

const TOKEN_KEY = "tandem.token";

export class ApiError extends Error {
  constructor(status, message, param = null, code = null) {
    super(message);
    this.status = status;
    this.param = param;
    this.code = code;
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

// Called with the ApiError when the API rejects the stored token (set by main.js).
let onUnauthorized = () => {};
export function whenUnauthorized(handler) {
  onUnauthorized = handler;
}

function headers(extra = {}) {
  return { Authorization: `Bearer ${token.get() || ""}`, Accept: "application/json", ...extra };
}

// The API's error shape is {"error": {"message", "type", "param", "code"}}; anything else
// (a proxy's HTML page, say) becomes a message naming the status.
async function errorFrom(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    /* not JSON */
  }
  const err = body && body.error;
  if (err && err.message) return new ApiError(response.status, err.message, err.param, err.code);
  return new ApiError(response.status, `the API answered ${response.status} ${response.statusText}`);
}

export async function request(method, path, body = undefined, tokenOverride = undefined) {
  const init = { method, headers: headers(), cache: "no-store" };
  if (tokenOverride !== undefined) init.headers.Authorization = `Bearer ${tokenOverride}`;
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (cause) {
    throw new ApiError(0, `cannot reach the API (${cause.message})`);
  }
  if (!response.ok) {
    const err = await errorFrom(response);
    if (response.status === 401 && tokenOverride === undefined) onUnauthorized(err);
    throw err;
  }
  return response.json();
}

export const get = (path) => request("GET", path);
export const post = (path, body) => request("POST", path, body);
export const patch = (path, body) => request("PATCH", path, body);

export function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    for (const item of [].concat(value)) {
      if (item !== undefined && item !== null && item !== "") search.append(key, item);
    }
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

// One SSE frame ("id: 7\nevent: metrics\ndata: {...}") as {id, event, data}; null for a comment.
function parseFrame(frame) {
  let id = null;
  let event = "message";
  const data = [];
  for (const line of frame.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") id = Number(value);
    else if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  return { id, event, data: parseData(data.join("\n")) };
}

// Python's json writes a diverged metric as a bare NaN or Infinity, which JSON.parse refuses;
// such a value becomes null (a gap in a chart) rather than a stream stuck on one frame.
function parseData(text) {
  try {
    return JSON.parse(text);
  } catch (err) {
    return JSON.parse(text.replace(/-?\bInfinity\b|\bNaN\b/g, "null"));
  }
}

// Reads an SSE endpoint until its `end` event or until `signal` aborts, reconnecting after a
// dropped connection with Last-Event-ID so nothing is missed or repeated. `onStatus` hears
// "live", "retrying" and "ended".
export async function stream(path, { onEvent, onStatus = () => {}, onError = () => {}, signal }) {
  let lastId = 0;
  while (!signal.aborted) {
    try {
      const extra = lastId ? { "Last-Event-ID": String(lastId), Accept: "text/event-stream" } : { Accept: "text/event-stream" };
      const response = await fetch(path, { headers: headers(extra), signal, cache: "no-store" });
      if (!response.ok) {
        const err = await errorFrom(response);
        if (response.status === 401) onUnauthorized(err);
        onError(err);
        if (response.status < 500) return; // a 401 or 404 will not heal by retrying
      } else {
        onStatus("live");
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value.replace(/\r\n?/g, "\n");
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const frame = parseFrame(buffer.slice(0, cut));
            buffer = buffer.slice(cut + 2);
            if (!frame) continue;
            if (frame.event === "end") {
              onStatus("ended");
              return;
            }
            if (frame.id !== null) lastId = frame.id;
            onEvent(frame);
          }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      onError(new ApiError(0, `stream interrupted (${err.message})`));
    }
    onStatus("retrying");
    await sleep(2000, signal);
  }
}

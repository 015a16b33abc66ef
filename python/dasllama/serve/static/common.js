// Shared by the chat and status pages: the API key (kept in this browser only) and error text.
"use strict";

const KEY_STORE = "dasllama.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The server answers errors in OpenAI's shape; say what it said, else the HTTP status.
async function apiError(resp) {
  let msg = resp.status + " " + resp.statusText;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) msg = body.error.message;
  } catch (e) {
    // not JSON: keep the status line
  }
  if (resp.status === 401) msg += " (enter the server's API key in the API key field)";
  return msg;
}

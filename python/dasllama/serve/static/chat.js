// The chat page: streams replies from /v1/chat/completions (SSE), shows reasoning apart from the
// answer, and keeps the conversation and settings in localStorage.
"use strict";

const CONV_STORE = "dasllama.conversations";
const CURRENT_STORE = "dasllama.currentConversation";
const SETTINGS_STORE = "dasllama.settings";
const MAX_CONVERSATIONS = 50; // the oldest go first: localStorage holds a few MB
const $ = (id) => document.getElementById(id);

// convs: [{id, title, messages, updated}], newest first; messages: the current one's messages,
// each {role, content, images (a user's: data URLs), reasoning, state: "streaming"|"done"|"stopped"|"error", error, finish, usage, chunks, tokPerS}
// attached: the pictures (data URLs) the next message takes; vision: the models that take them.
const state = { convs: [], current: null, messages: [], controller: null, attached: [], vision: {} };
window.chatState = state; // for the browser tests and for a curious user's console

function readJSON(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v === null ? fallback : v;
  } catch (e) {
    return fallback;
  }
}

function load() {
  state.convs = readJSON(CONV_STORE, []).filter((c) => c && Array.isArray(c.messages));
  for (const c of state.convs) for (const m of c.messages) if (m.state === "streaming") m.state = "stopped"; // a reload cut it off
  const cur = state.convs.find((c) => c.id === localStorage.getItem(CURRENT_STORE));
  if (cur) select(cur.id);
  else newConversation();
  const s = readJSON(SETTINGS_STORE, {});
  for (const id of ["system", "temperature", "top_p", "max_tokens"]) if (s[id] !== undefined) $(id).value = s[id];
  state.wantModel = s.model;
  $("api-key").value = apiKey();
}

function newConversation() {
  const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "", messages: [], updated: Date.now() };
  state.convs.unshift(c);
  select(c.id);
}

function select(id) {
  const c = state.convs.find((x) => x.id === id);
  state.current = c.id;
  state.messages = c.messages;
}

function save() {
  const cur = state.convs.find((c) => c.id === state.current);
  if (cur) {
    const first = cur.messages.find((m) => m.role === "user");
    cur.title = first ? first.content.slice(0, 60) : "";
  }
  // Empty conversations other than the one on screen are not worth keeping.
  state.convs = state.convs.filter((c) => c.messages.length || c.id === state.current).slice(0, MAX_CONVERSATIONS);
  try {
    localStorage.setItem(CONV_STORE, JSON.stringify(state.convs));
  } catch (e) {
    // Pictures fill localStorage quickly: keep the conversations without them rather than none.
    const bare = state.convs.map((c) => ({ ...c, messages: c.messages.map((m) => ({ ...m, images: undefined })) }));
    try { localStorage.setItem(CONV_STORE, JSON.stringify(bare)); } catch (e2) { /* full even so: keep what was there */ }
  }
  localStorage.setItem(CURRENT_STORE, state.current);
  const s = { model: $("model").value || state.wantModel };
  for (const id of ["system", "temperature", "top_p", "max_tokens"]) s[id] = $(id).value;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(s));
  renderList();
}

function renderList() {
  const items = state.convs
    .filter((c) => c.messages.length)
    .map((c) => {
      const li = document.createElement("li");
      li.dataset.id = c.id;
      if (c.id === state.current) li.setAttribute("aria-current", "true");
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = c.title || "(untitled)";
      open.title = c.title;
      open.addEventListener("click", () => switchTo(c.id));
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.textContent = "×";
      del.title = "delete this conversation";
      del.addEventListener("click", () => remove(c.id));
      li.append(open, del);
      return li;
    });
  $("conversations").replaceChildren(...items);
}

function switchTo(id) {
  if (state.controller) state.controller.abort();
  select(id);
  save();
  renderAll();
}

function remove(id) {
  if (id === state.current && state.controller) state.controller.abort();
  state.convs = state.convs.filter((c) => c.id !== id);
  if (id === state.current) newConversation();
  save();
  renderAll();
}

async function loadModels() {
  const note = $("model-note");
  const sel = $("model");
  try {
    const resp = await fetch("v1/models", { headers: authHeaders() });
    if (!resp.ok) {
      sel.replaceChildren();
      note.textContent = "Cannot list the models: " + (await apiError(resp));
      note.className = "note error";
      return;
    }
    const data = (await resp.json()).data;
    const ids = data.map((d) => d.id);
    state.vision = Object.fromEntries(data.map((d) => [d.id, (d.input_modalities || []).includes("image")]));
    sel.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(state.wantModel)) sel.value = state.wantModel;
    note.textContent = ids.length + (ids.length === 1 ? " model" : " models") + " on this server";
    note.className = "note";
    showAttach();
  } catch (e) {
    note.textContent = "Cannot reach the server: " + e.message;
    note.className = "note error";
  }
}

// Thinking models may also write their reasoning inline as <think>...</think>.
function split(m) {
  let reasoning = m.reasoning || "";
  let content = m.content || "";
  const t = content.match(/^\s*<think>([\s\S]*?)(<\/think>|$)/);
  if (t) {
    reasoning += t[1];
    content = content.slice(t[0].length);
  }
  return { reasoning: reasoning.trim(), content };
}

function messageNode(m, i) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  div.dataset.index = i;
  if (m.role === "user") {
    div.innerHTML = '<div class="images"></div><div class="content plain"></div>';
    const imgs = div.querySelector(".images");
    for (const url of m.images || []) imgs.append(Object.assign(document.createElement("img"), { src: url, alt: "attached picture" }));
    imgs.hidden = !imgs.children.length;
    div.querySelector(".content").textContent = m.content;
    return div;
  }
  div.innerHTML = '<details class="reasoning" hidden><summary>Reasoning</summary><div class="reasoning-text"></div></details><div class="content md"></div><div class="meta"></div>';
  fill(div, m);
  return div;
}

function fill(div, m) {
  const { reasoning, content } = split(m);
  div.dataset.state = m.state || "done";
  div.dataset.chunks = m.chunks || 0;
  const rd = div.querySelector(".reasoning");
  rd.hidden = !reasoning;
  if (reasoning) {
    div.querySelector(".reasoning-text").textContent = reasoning;
    if (m.state === "streaming" && !content) rd.open = true;
  }
  div.querySelector(".content").innerHTML = renderMarkdown(content);
  const meta = [];
  if (m.state === "streaming") meta.push("…");
  if (m.state === "stopped") meta.push("stopped");
  if (m.finish === "length") meta.push("cut at max tokens");
  if (m.usage) meta.push(m.usage.completion_tokens + " tokens");
  if (m.tokPerS) meta.push(m.tokPerS.toFixed(1) + " tok/s");
  if (m.error) meta.push("error: " + m.error);
  const md = div.querySelector(".meta");
  md.textContent = meta.join(" · ");
  md.classList.toggle("error", !!m.error);
}

function renderAll() {
  const box = $("messages");
  box.replaceChildren(...state.messages.map(messageNode));
  box.scrollTop = box.scrollHeight;
}

let pending = null;
function scheduleFill(m) {
  if (pending) return;
  // One repaint per frame however many deltas arrive in it.
  pending = requestAnimationFrame(() => {
    pending = null;
    const i = state.messages.indexOf(m);
    const div = $("messages").querySelector('[data-index="' + i + '"]');
    if (div) fill(div, m);
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  });
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("input").disabled = busy;
  document.body.dataset.busy = busy ? "1" : "";
}

function number(id) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

function handleEvent(block, reply, t0) {
  for (const line of block.split("\n")) {
    if (!line.startsWith("data:")) continue;
    const data = line.slice(5).trim();
    if (data === "[DONE]") continue;
    const obj = JSON.parse(data);
    if (obj.error) {
      reply.error = obj.error.message;
      continue;
    }
    if (obj.usage) reply.usage = obj.usage;
    for (const c of obj.choices || []) {
      const d = c.delta || {};
      if (d.reasoning_content) {
        reply.reasoning = (reply.reasoning || "") + d.reasoning_content;
        reply.chunks++;
      }
      if (d.content) {
        reply.content += d.content;
        reply.chunks++;
      }
      if (reply.chunks === 1 && reply.tFirst === undefined) reply.tFirst = performance.now() - t0;
      if (c.finish_reason) reply.finish = c.finish_reason;
    }
  }
}

// The pictures the next message takes: attached with the button, dropped, or pasted.
function showAttach() {
  const can = !!state.vision[$("model").value];
  $("attach").hidden = !can;
  if (!can) state.attached = [];
  renderAttached();
}

function renderAttached() {
  const box = $("attachments");
  box.replaceChildren(...state.attached.map((url, i) => {
    const fig = document.createElement("figure");
    const del = Object.assign(document.createElement("button"), { type: "button", textContent: "×", title: "remove" });
    del.addEventListener("click", () => { state.attached.splice(i, 1); renderAttached(); });
    fig.append(Object.assign(document.createElement("img"), { src: url, alt: "picture to send" }), del);
    return fig;
  }));
  box.hidden = !state.attached.length;
}

function attachFiles(files) {
  for (const f of files) {
    if (!f.type.startsWith("image/")) continue;
    const r = new FileReader();
    r.onload = () => { state.attached.push(r.result); renderAttached(); };
    r.readAsDataURL(f);
  }
}

// A user message as the API takes it: text, or text and image_url parts.
function userContent(m) {
  if (!m.images || !m.images.length) return m.content;
  return [...m.images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text: m.content }];
}

async function send(text) {
  const images = state.attached;
  state.attached = [];
  renderAttached();
  state.messages.push(images.length ? { role: "user", content: text, images } : { role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "", state: "streaming", chunks: 0 };
  state.messages.push(reply);
  renderAll();
  save();
  const messages = [];
  const past = state.messages.slice(0, -1);
  past.forEach((m, i) => {
    const reply = m.role === "user" ? past[i + 1] : m;
    // A turn whose reply failed or was stopped before any text is left out whole, so the roles
    // still alternate as chat templates require.
    if (reply && reply.role === "assistant" && !split(reply).content) return;
    messages.push({ role: m.role, content: m.role === "assistant" ? split(m).content : userContent(m) });
  });
  const system = $("system").value.trim();
  if (system) messages.unshift({ role: "system", content: system });
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if ($("model").value) body.model = $("model").value;
  for (const id of ["temperature", "top_p", "max_tokens"]) {
    const v = number(id);
    if (v !== undefined) body[id] = id === "max_tokens" ? Math.round(v) : v;
  }
  state.controller = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!resp.ok) {
      reply.error = await apiError(resp);
    } else {
      const reader = resp.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true }).replace(/\r\n/g, "\n");
        let at;
        while ((at = buf.indexOf("\n\n")) >= 0) {
          handleEvent(buf.slice(0, at), reply, t0);
          buf = buf.slice(at + 2);
        }
        scheduleFill(reply);
      }
    }
    reply.state = reply.error ? "error" : "done";
  } catch (e) {
    if (e.name === "AbortError") reply.state = "stopped";
    else {
      reply.state = "error";
      reply.error = e.message || String(e);
    }
  } finally {
    const genS = (performance.now() - t0 - (reply.tFirst || 0)) / 1000;
    if (reply.usage && reply.usage.completion_tokens > 1 && genS > 0) reply.tokPerS = (reply.usage.completion_tokens - 1) / genS;
    state.controller = null;
    setBusy(false);
    save();
    renderAll();
    $("input").focus();
  }
}

function init() {
  load();
  renderList();
  renderAll();
  loadModels();
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if ((!text && !state.attached.length) || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  // Aborting the fetch closes the connection; the server cancels the request when it sees that.
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    if (state.messages.length) newConversation();
    save();
    renderAll();
  });
  $("api-key").addEventListener("change", () => {
    setApiKey($("api-key").value.trim());
    loadModels();
  });
  for (const id of ["model", "system", "temperature", "top_p", "max_tokens"]) $(id).addEventListener("change", save);
  $("model").addEventListener("change", showAttach);
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", (ev) => { attachFiles(ev.target.files); ev.target.value = ""; });
  $("input").addEventListener("paste", (ev) => {
    if (!state.vision[$("model").value]) return;
    const files = [...(ev.clipboardData ? ev.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
    if (files.length) {
      ev.preventDefault();
      attachFiles(files);
    }
  });
}

init();

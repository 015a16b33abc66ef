// The status page: polls status.json once a second and shows each model's streams, KV pages,
// prefix cache, rates and compute tier, with two minutes of history as plots.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;

const FIELDS = [
  ["active", "streams running"],
  ["queued", "waiting"],
  ["tokens_per_s", "tokens/s"],
  ["prompt_tokens_per_s", "prompt tokens/s"],
  ["ttft", "TTFT mean"],
  ["kv", "KV pages used / free / cached"],
  ["hit_rate", "prefix-cache hit rate"],
  ["tokens_out", "tokens generated"],
  ["avg_batch", "average batch"],
  ["requests", "requests"],
  ["tier", "tier"],
  ["memory", "memory: weights + KV"],
];

const PLOTS = [
  ["tokens_per_s", "tokens/s"],
  ["ttft_ms", "TTFT ms"],
  ["streams", "running + waiting"],
];

function card(name) {
  const sec = document.createElement("section");
  sec.className = "model";
  sec.dataset.model = name;
  const h = document.createElement("h2");
  h.append(name, " ");
  const sub = document.createElement("span");
  sub.className = "note";
  sub.dataset.field = "about";
  h.append(sub);
  const grid = document.createElement("div");
  grid.className = "grid";
  for (const [key, label] of FIELDS) {
    const d = document.createElement("div");
    d.className = "stat";
    d.innerHTML = '<span class="label"></span><span class="value"></span>';
    d.querySelector(".label").textContent = label;
    d.querySelector(".value").dataset.field = key;
    grid.append(d);
  }
  const bar = document.createElement("div");
  bar.className = "kvbar";
  bar.innerHTML = '<span class="used"></span><span class="cached"></span>';
  const plots = document.createElement("div");
  plots.className = "plots";
  for (const [key, label] of PLOTS) {
    const f = document.createElement("figure");
    f.innerHTML = "<canvas width=320 height=90></canvas><figcaption></figcaption>";
    f.querySelector("canvas").dataset.plot = key;
    f.querySelector("figcaption").textContent = label + " (last 2 min)";
    plots.append(f);
  }
  sec.append(h, grid, bar, plots);
  return sec;
}

function set(sec, key, text) {
  sec.querySelector('[data-field="' + key + '"]').textContent = text;
}

function plot(canvas, values) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width;
  const h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const style = getComputedStyle(document.body);
  ctx.strokeStyle = style.getPropertyValue("--accent") || "#36c";
  ctx.fillStyle = style.getPropertyValue("--muted") || "#888";
  const nums = values.filter((v) => v !== null && v !== undefined);
  const max = Math.max(1, ...nums);
  ctx.font = "10px sans-serif";
  ctx.fillText(max.toFixed(max < 10 ? 1 : 0), 2, 10);
  ctx.beginPath();
  let pen = false;
  values.forEach((v, i) => {
    if (v === null || v === undefined) {
      pen = false;
      return;
    }
    const x = values.length > 1 ? (i / (values.length - 1)) * (w - 2) + 1 : w / 2;
    const y = h - 2 - (v / max) * (h - 14);
    if (pen) ctx.lineTo(x, y);
    else ctx.moveTo(x, y);
    pen = true;
  });
  ctx.stroke();
  // A point with no neighbour (TTFT has a value only where a request began) draws no line: a dot.
  ctx.fillStyle = ctx.strokeStyle;
  const none = (v) => v === null || v === undefined;
  values.forEach((v, i) => {
    if (none(v) || !(none(values[i - 1]) && none(values[i + 1]))) return;
    const x = values.length > 1 ? (i / (values.length - 1)) * (w - 2) + 1 : w / 2;
    ctx.fillRect(x - 1.5, h - 2 - (v / max) * (h - 14) - 1.5, 3, 3);
  });
}

function fmtBytes(n) {
  if (n >= 1 << 30) return (n / (1 << 30)).toFixed(1) + " GiB";
  if (n >= 1 << 20) return (n / (1 << 20)).toFixed(1) + " MiB";
  return (n / 1024).toFixed(0) + " KiB";
}

function show(doc) {
  const t = doc.tier;
  const rss = doc.rss_bytes ? " · server memory " + fmtBytes(doc.rss_bytes) : "";
  $("server-line").textContent = "up " + Math.round(doc.uptime_s) + " s · gpu: " + doc.gpu + " · " + t.detail + rss + (doc.ready ? "" : " · loading models…");
  const box = $("models");
  for (const m of doc.models) {
    let sec = box.querySelector('section[data-model="' + CSS.escape(m.name) + '"]');
    if (!sec) box.append((sec = card(m.name)));
    sec.classList.toggle("dead", !m.alive);
    set(sec, "about", m.file + " · " + m.arch + " · context " + m.context + (m.chat ? "" : " · base model (no chat template: /v1/completions only)") + (m.error ? " · " + m.error : ""));
    set(sec, "active", m.streams.active + " / " + m.streams.max);
    set(sec, "queued", String(m.streams.queued));
    set(sec, "tokens_per_s", m.tokens_per_s.toFixed(1));
    set(sec, "prompt_tokens_per_s", m.prompt_tokens_per_s.toFixed(1));
    set(sec, "ttft", m.ttft_ms_mean === null ? "–" : m.ttft_ms_mean.toFixed(0) + " ms");
    const kv = m.kv;
    set(sec, "kv", kv.paged ? kv.pages_used + " / " + kv.pages_free + " / " + kv.pages_cached + " (" + fmtBytes(kv.bytes_allocated) + ")" : "not paged");
    set(sec, "hit_rate", (100 * m.prefix_cache.hit_rate).toFixed(1) + " %");
    set(sec, "tokens_out", String(m.tokens_out));
    set(sec, "avg_batch", m.avg_batch.toFixed(2));
    const req = Object.entries(m.requests).map(([k, v]) => k + " " + v);
    set(sec, "requests", req.length ? req.join(", ") : "none yet");
    set(sec, "tier", m.tier.backend + " on " + m.tier.device);
    set(sec, "memory", fmtBytes(m.memory.weights_bytes) + " + " + fmtBytes(m.memory.kv_bytes));
    if (m.tier.gpu_cpu_passes) {
      const p = m.tier.gpu_cpu_passes;
      const passes = typeof p === "object" ? Object.entries(p).map(([k, v]) => k + " " + v) : [String(p)];
      set(sec, "tier", m.tier.backend + " on " + m.tier.device + (passes.length ? " · handed back to the CPU: " + passes.join(", ") : ""));
    }
    const total = Math.max(1, kv.pages_total);
    sec.querySelector(".kvbar .used").style.width = (100 * (kv.pages_used - kv.pages_cached)) / total + "%";
    sec.querySelector(".kvbar .cached").style.width = (100 * kv.pages_cached) / total + "%";
    const hist = m.history;
    plot(sec.querySelector('[data-plot="tokens_per_s"]'), hist.map((p) => p.tokens_per_s));
    plot(sec.querySelector('[data-plot="ttft_ms"]'), hist.map((p) => p.ttft_ms));
    plot(sec.querySelector('[data-plot="streams"]'), hist.map((p) => p.active + p.queued));
  }
  document.body.dataset.updated = String(Date.now());
}

async function poll() {
  try {
    const resp = await fetch("status.json", { headers: authHeaders(), cache: "no-store" });
    if (resp.status === 401) {
      $("key-box").hidden = false;
      $("key-msg").textContent = await apiError(resp);
    } else if (!resp.ok) {
      $("server-line").textContent = await apiError(resp);
    } else {
      $("key-box").hidden = true;
      show(await resp.json());
    }
  } catch (e) {
    $("server-line").textContent = "cannot reach the server: " + e.message;
  }
  setTimeout(poll, POLL_MS);
}

$("key-box").addEventListener("submit", (ev) => {
  ev.preventDefault();
  setApiKey($("api-key").value.trim());
  $("key-box").hidden = true;
});
$("api-key").value = apiKey();
poll();

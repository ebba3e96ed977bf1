// llmgw console: reads the control API, renders it, follows its status stream.
//
// Rules this file keeps:
// - Nothing from the API is ever parsed as HTML: every value goes in through
//   textContent / createTextNode (el() below). Catalog content is written by
//   whoever can push to the catalog repository; it must not run here.
// - The token (when the API wants one) lives in sessionStorage and is sent as
//   an Authorization header by fetch, the status stream included (EventSource
//   cannot send headers, so the stream is read from fetch's body).
// - One stream, pushed by the server at most twice a second; no polling.
"use strict";

const API = "../api/v1/";
const TOKEN_KEY = "llmgw.token";
// Reconnect delays: quick at first (a controller restart takes seconds), then
// no more often than every 30 s against one that is down.
const RETRY_FIRST_MS = 1000, RETRY_CAP_MS = 30000;
// Ages on the page (last seen, event times) are redrawn this often between pushes.
const AGE_REDRAW_MS = 5000;

const state = {
  status: null,          // the last status pushed
  receivedAt: 0,         // when, by this browser's clock (ages are counted on from it)
  catalog: null,         // GET /api/v1/catalog of the version in force
  catalogVersion: null,
  openLogs: new Set(),   // replicas whose log lines the reader opened: kept open across redraws
  retryMs: RETRY_FIRST_MS,
  controller: null,      // AbortController of the running stream
};

// -- DOM helpers: text only ------------------------------------------------

function el(tag, props, ...kids) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, String(value));
    else if (key === "title") node.title = String(value);
    else if (key === "open") node.open = true;
    else if (key === "on") for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
    else throw new Error("el(): unsupported property " + key);
  }
  append(node, kids);
  return node;
}

function append(node, kids) {
  for (const kid of kids) {
    if (kid === undefined || kid === null || kid === false) continue;
    if (Array.isArray(kid)) append(node, kid);
    else if (kid instanceof Node) node.appendChild(kid);
    else node.appendChild(document.createTextNode(String(kid)));
  }
}

function $(id) { return document.getElementById(id); }

function setText(id, text) { $(id).textContent = text; }

function replaceRows(tableId, rows) {
  const table = $(tableId);
  const labels = Array.from(table.querySelectorAll("thead th"), (th) => th.textContent);
  const body = table.querySelector("tbody");
  for (const row of rows) {
    Array.from(row.children).forEach((td, i) => td.setAttribute("data-label", labels[i] || ""));
  }
  body.replaceChildren(...rows);
}

function badge(text, stateName) { return el("span", { class: "badge", "data-state": stateName || text }, text); }

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  seconds = Math.max(0, seconds);
  if (seconds < 60) return Math.round(seconds) + "s ago";
  if (seconds < 3600) return Math.round(seconds / 60) + "m ago";
  return (seconds / 3600).toFixed(1) + "h ago";
}

function sinceReceived() { return (Date.now() - state.receivedAt) / 1000; }

function mib(n) {
  if (!n) return "";
  return n >= 1024 ? (n / 1024).toFixed(n % 1024 ? 1 : 0) + " GiB" : n + " MiB";
}

// -- API ---------------------------------------------------------------------

function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}

class NeedToken extends Error {}

async function api(path, init) {
  const resp = await fetch(API + path, { ...(init || {}), headers: headers(), cache: "no-store" });
  if (resp.status === 401) throw new NeedToken(await resp.text());
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
  return resp;
}

// Reads `text/event-stream` from fetch: each frame's `data:` lines joined, per the SSE format.
async function follow() {
  state.controller = new AbortController();
  const resp = await api("watch/status", { signal: state.controller.signal });
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      let event = "message";
      const data = [];
      for (const line of frame.split(/\r?\n/)) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (event === "status" && data.length) onStatus(JSON.parse(data.join("\n")));
    }
  }
}

async function run() {
  for (;;) {
    try {
      connection("connecting");
      await follow();
      connection("offline", "the stream ended; reconnecting");
    } catch (err) {
      if (err instanceof NeedToken) { askToken(sessionStorage.getItem(TOKEN_KEY) ? "That token was refused." : ""); return; }
      connection("offline", String(err && err.message || err));
    }
    await new Promise((done) => setTimeout(done, state.retryMs));
    state.retryMs = Math.min(RETRY_CAP_MS, state.retryMs * 2);
  }
}

function connection(name, why) {
  const node = $("connection");
  node.dataset.state = name;
  node.textContent = name === "live" ? "live" : name === "offline" ? "offline" : "connecting";
  node.title = why || "";
}

async function onStatus(status) {
  state.status = status;
  state.receivedAt = Date.now();
  state.retryMs = RETRY_FIRST_MS;
  connection("live");
  $("token-form").hidden = true;
  if (status.catalog.version !== state.catalogVersion) {
    state.catalogVersion = status.catalog.version;
    try {
      const body = await (await api("catalog")).json();
      if (body.version === state.catalogVersion) state.catalog = body;
    } catch (err) {
      state.catalog = null;
    }
  }
  render();
}

// -- rendering ---------------------------------------------------------------

function render() {
  const s = state.status;
  if (!s) return;
  const cat = s.catalog;
  setText("catalog-version", "catalog " + cat.version + " · " + cat.models + " models"
          + (s.settled === false ? " · settling" : ""));
  renderRejection(cat);
  renderModels(s.models);
  renderReplicas(s.replicas);
  renderNodes(s.nodes);
  renderEvents(s.events || []);
  renderCatalog(cat);
}

function renderRejection(cat) {
  const rejection = cat.last_rejection;
  const show = Boolean(rejection) && cat.directory_valid === false;
  $("rejection").hidden = !show;
  if (show) {
    const n = rejection.errors.length;
    setText("rejection-summary", "An edit " + ago((Date.now() / 1000) - rejection.at) + " was rejected with " + n
            + " problem" + (n === 1 ? "" : "s") + "; catalog " + cat.version + " stays in force.");
    $("rejection-errors").replaceChildren(...rejection.errors.map((e) => el("li", {}, e)));
  }
  const failed = cat.watcher === "degraded" && cat.last_failure;
  // Every followed file or directory not in force (status' watchers): the API key file too.
  const files = (state.status && state.status.watchers || []).filter((w) => w.state === "degraded" && w.name !== "catalog");
  $("watcher-failure").hidden = !failed && !files.length;
  const lines = (failed ? [cat.problem || JSON.stringify(cat.last_failure)] : [])
    .concat(files.map((w) => w.name + ": " + w.problem + " (what was in force stays)"));
  setText("watcher-failure-text", lines.join("\n"));
}

function profilesOf(name) {
  const models = state.catalog && state.catalog.catalog && state.catalog.catalog.models || [];
  const model = models.find((m) => m.name === name);
  return model ? model.profiles : [];
}

function renderModels(models) {
  replaceRows("models", models.map((m) => el("tr", { "data-model": m.name },
    el("td", { class: "mono" }, m.name),
    el("td", {}, (m.aliases || []).join(", ")),
    el("td", {}, badge(m.ready + " / " + m.desired, m.ready >= m.desired && m.desired > 0 ? "ready"
                                                   : m.desired === 0 ? "idle" : "starting")),
    el("td", {}, m.min === m.max ? String(m.min) : m.min + "–" + m.max),
    el("td", {}, el("ul", { class: "plain" }, profilesOf(m.name).map((p) => el("li", {},
      el("span", { class: "mono" }, p.name), ": " + p.engine + ", " + p.gpus + " GPU" + (p.gpus === 1 ? "" : "s")
      + (p.pool ? ", pool " + p.pool : "") + ", priority " + p.priority)))),
    el("td", {}, m.unplaceable ? el("span", { class: "error" }, m.unplaceable) : el("span", { class: "muted" }, "placed"),
      // The chain its requests fall back to when it has no replica that can answer (llmgw-catalog(5) FALLBACKS).
      (m.fallbacks || []).length ? el("div", { class: "muted", "data-fallbacks": m.name },
                                      "falls back to " + m.fallbacks.join(" → ")) : null),
  )));
}

function renderReplicas(replicas) {
  $("no-replicas").hidden = replicas.length > 0;
  replaceRows("replicas", replicas.map((r) => {
    const why = [];
    if (r.reason) why.push(el("div", {}, r.reason));
    // LoRA adapters placed on it: a failed load says the engine's reason here.
    for (const a of r.adapters || []) {
      if (a.reason) why.push(el("div", { class: "error" }, "adapter " + a.name + " " + a.state + ": " + a.reason));
    }
    const adapters = (r.adapters || []).length
      ? el("div", { class: "muted", "data-adapters": r.id }, "adapters: " + r.adapters.map(
        (a) => a.state === "loaded" ? a.name : a.name + " (" + a.state + ")").join(", "))
      : null;
    if (r.last_log && r.last_log.length) {
      const details = el("details", { open: state.openLogs.has(r.id), "data-log": r.id,
                                      on: { toggle: (ev) => { if (ev.target.open) state.openLogs.add(r.id);
                                                              else state.openLogs.delete(r.id); } } },
        el("summary", {}, "last " + r.last_log.length + " log lines"),
        el("pre", { class: "log" }, r.last_log.join("\n")));
      why.push(details);
    }
    return el("tr", { "data-replica": r.id, "data-state": r.state },
      el("td", { class: "mono" }, r.id, r.adopted ? el("div", { class: "muted" }, "adopted") : null),
      el("td", {}, r.model, el("div", { class: "muted" }, r.profile + " · " + r.engine), adapters),
      el("td", {}, badge(r.state)),
      el("td", {}, r.node),
      el("td", {}, (r.gpus || []).join(", ") || "-"),
      el("td", { class: "mono" }, r.url || "-"),
      el("td", {}, String(r.restarts)),
      el("td", {}, r.last_exit === null || r.last_exit === undefined ? "-" : String(r.last_exit)),
      el("td", {}, why),
    );
  }));
}

function renderNodes(nodes) {
  $("no-nodes").hidden = nodes.length > 0;
  const age = sinceReceived();
  replaceRows("nodes", nodes.map((n) => {
    const gpus = (n.gpu_list || []).map((g) => el("li", {},
      "GPU " + g.index + (g.name ? " " + g.name : "") + (g.memory_mib ? " · " + mib(g.memory_mib) : ""),
      g.used_by ? el("span", { class: "muted" }, " · " + g.used_by) : el("span", { class: "muted" }, " · free")));
    const missing = Object.entries(n.engines_missing || {});
    return el("tr", { "data-node": n.name },
      el("td", { class: "mono" }, n.name),
      el("td", {}, badge(n.state), n.conflict ? el("div", { class: "error" }, "conflict: " + n.conflict) : null),
      // Whether placement may use it (llmgwctl cordon, drain, uncordon); older controllers send none.
      el("td", { class: "scheduling" }, badge(n.scheduling || "schedulable")),
      el("td", {}, (n.pools || []).join(", ") || "-"),
      el("td", {}, n.gpus_used + " / " + n.gpus + " used", gpus.length ? el("ul", { class: "plain" }, gpus) : null),
      el("td", {}, (n.engines || []).join(", ") || "-",
         missing.length ? el("ul", { class: "plain muted" }, missing.map(([e, why]) => el("li", { title: why }, "no " + e + ": " + why))) : null),
      el("td", {}, ago(n.last_seen_seconds + age)),
    );
  }));
}

function renderEvents(events) {
  const now = Date.now() / 1000;
  $("events").replaceChildren(...events.slice(-30).reverse().map((e) => el("li", {},
    el("span", { class: "when" }, ago(now - e.at)), el("span", { class: "kind" }, e.kind), e.message)));
}

function renderCatalog(cat) {
  const when = cat.swapped_at ? ", in force since " + ago(Date.now() / 1000 - cat.swapped_at) : "";
  setText("catalog-summary", cat.version + " from " + cat.directory + ": " + cat.models + " models, "
          + cat.swaps + " swaps, " + cat.rejections + " rejected edits" + when);
  setText("catalog-json", state.catalog ? JSON.stringify(state.catalog.catalog, null, 2) : "(not loaded)");
}

// -- token -------------------------------------------------------------------

function askToken(message) {
  connection("offline", "a token is needed");
  $("token-form").hidden = false;
  $("token-error").hidden = !message;
  $("token-error").textContent = message || "";
  $("token-input").focus();
}

function setup() {
  // #token=... (a fragment never reaches any server) is taken into this tab and removed from the address bar.
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.get("token")) {
    sessionStorage.setItem(TOKEN_KEY, hash.get("token"));
    history.replaceState(null, "", location.pathname + location.search);
  }
  $("forget-token").hidden = !sessionStorage.getItem(TOKEN_KEY);
  $("forget-token").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    if (state.controller) state.controller.abort();
    location.reload();
  });
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
    $("token-input").value = "";
    $("forget-token").hidden = false;
    $("token-form").hidden = true;
    run();
  });
  setInterval(render, AGE_REDRAW_MS);
  run();
}

document.addEventListener("DOMContentLoaded", setup);

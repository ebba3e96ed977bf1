// llmgw console: reads the control API, renders it, follows its stream (a summary of the
// status and the traffic history's new points), charts the history with uPlot (vendor/).
//
// Rules this file keeps:
// - Nothing from the API is ever parsed as HTML: every value goes in through
//   textContent / createTextNode (el() below). Catalog content is written by
//   whoever can push to the catalog repository; it must not run here.
// - The token (when the API wants one) lives in sessionStorage and is sent as
//   an Authorization header by fetch, the status stream included (EventSource
//   cannot send headers, so the stream is read from fetch's body).
// - One stream, pushed by the server at most twice a second; what it does not carry (the
//   request log, the GPU view) is read on demand, at most once per REFRESH_MS while shown.
// - The playground's prompt goes through the control API's relay to the router
//   (control/playground.py says why); an API key typed for it stays in this tab.
"use strict";

const API = "../api/v1/";
const TOKEN_KEY = "llmgw.token";
// Reconnect delays: quick at first (a controller restart takes seconds), then
// no more often than every 30 s against one that is down.
const RETRY_FIRST_MS = 1000, RETRY_CAP_MS = 30000;
// Ages on the page (last seen, event times) are redrawn this often between pushes.
const AGE_REDRAW_MS = 5000;
// The request log and the GPU view are read again at most this often, when an update comes.
const REFRESH_MS = 5000;
const APIKEY_KEY = "llmgw.apikey";
// Charts drawn at most for this many models (the fleet's chart always): a page, not a wall; the
// stream carries the history of as many (control/webui.py, CHART_MODELS).
const MAX_CHARTS = 24;

const state = {
  status: null,          // the last status pushed
  receivedAt: 0,         // when, by this browser's clock (ages are counted on from it)
  catalog: null,         // GET /api/v1/catalog of the version in force
  catalogVersion: null,
  openLogs: new Set(),   // replicas whose log lines the reader opened: kept open across redraws
  retryMs: RETRY_FIRST_MS,
  controller: null,      // AbortController of the running stream
  history: null,         // {interval, points, t: [], fleet: {FIELD: []}, models: {NAME: {FIELD: []}}}
  charts: new Map(),     // name ("" for the fleet) -> {card, plots: [uPlot...]}
  refreshed: { requests: 0, gpus: 0 },
  playground: null,      // AbortController of the running prompt
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

// Reads `text/event-stream` from a fetch's body: one { event, data } per frame, its `data:` lines joined,
// per the SSE format; frames without data are passed over. The console's stream and the playground's
// answer both read through it.
async function* events(resp) {
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
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

async function follow() {
  state.controller = new AbortController();
  const resp = await api("watch/console", { signal: state.controller.signal });
  for await (const { event, data } of events(resp)) {
    if (event === "summary" || event === "status") onStatus(JSON.parse(data));
    else if (event === "history") onHistory(JSON.parse(data));
    else if (event === "history-part") onHistoryPart(JSON.parse(data));
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
  renderCounts(s);
  renderRejection(cat);
  renderModels(s.models);
  more("models-more", s.models.length, s.models_total, "models (those needing attention, and with traffic, first)");
  renderReplicas(s.replicas);
  more("replicas-more", s.replicas.length, s.replicas_total, "replicas (the ones not ready first)");
  renderNodes(s.nodes);
  more("nodes-more", s.nodes.length, s.nodes_total, "nodes (unreachable and cordoned first)");
  renderEvents(s.events || []);
  renderCatalog(cat);
  // Every model of the catalog in force, when it is loaded: the summary shows only some of a big one.
  renderModelChoices(state.catalog && state.catalog.catalog ? state.catalog.catalog.models : s.models);
  refreshRequests(false);
  refreshGpus(false);
}

function more(id, shown, total, what) {
  const hidden = total === undefined || total <= shown;
  $(id).hidden = hidden;
  if (!hidden) setText(id, "Showing " + shown + " of " + total + " " + what
                      + "; llmgwctl status (--model NAME) lists them all.");
}

function renderCounts(s) {
  const c = s.counts;
  if (!c) { setText("counts", ""); return; }
  const ready = (c.replicas || {}).ready || 0;
  const replicas = Object.values(c.replicas || {}).reduce((a, b) => a + b, 0);
  const nodes = Object.values(c.nodes || {}).reduce((a, b) => a + b, 0);
  setText("counts", "· " + ready + " / " + replicas + " replicas ready · " + nodes + " nodes · "
          + c.gpus_used + " / " + c.gpus + " GPUs used");
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
    // A replica spanning nodes: one row, its members (rank by rank) where a replica's node and GPUs go.
    const members = r.members || [];
    for (const m of members) {
      if (m.state !== "ready" && m.reason) why.push(el("div", {}, "rank " + m.rank + " (" + m.node + "): " + m.reason));
    }
    const where = members.length
      ? el("ul", { class: "plain", "data-members": r.id }, members.map((m) => el("li", {},
        "rank " + m.rank + " · " + m.node + " · GPUs " + ((m.gpus || []).join(", ") || "-") + " ", badge(m.state))))
      : r.node;
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
      el("td", {}, where),
      el("td", {}, members.length ? members.length + " nodes" : (r.gpus || []).join(", ") || "-"),
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


// -- traffic history and its charts (uPlot) ---------------------------------------

// The series of each chart: [field, label, colour, scale]. Rates per second, TTFT in ms.
const CHARTS = [
  { title: "Requests / s", series: [["requests", "requests/s", "#0969da", "y"], ["errors", "5xx/s", "#cf222e", "y"],
                                    ["tokens_out", "tokens out/s", "#8250df", "tok"]] },
  { title: "Time to first token", series: [["ttft_p50", "p50 ms", "#1a7f37", "y"], ["ttft_p99", "p99 ms", "#9a6700", "y"]] },
  { title: "Replicas and load", series: [["desired", "desired", "#656d76", "y"], ["ready", "ready", "#1a7f37", "y"],
                                         ["inflight", "in flight", "#0969da", "y"], ["load", "load", "#8250df", "y"],
                                         ["target", "target / replica", "#9a6700", "y"]] },
];
const MS_FIELDS = new Set(["ttft_p50", "ttft_p99"]);

function onHistory(doc) {
  const h = state.history;
  if (!h || doc.interval !== h.interval) {
    // The first answer (the last hour), or a controller that samples otherwise now: taken whole.
    state.history = { interval: doc.interval, points: doc.points, t: doc.t.slice(), fleet: doc.fleet, models: doc.models };
  } else {
    // New points only: any the page holds already (a reconnect's first answer) are skipped.
    const last = h.t.length ? h.t[h.t.length - 1] : -Infinity;
    let skip = 0;
    while (skip < doc.t.length && doc.t[skip] <= last) skip++;
    const n = h.t.length, add = doc.t.length - skip;
    if (add <= 0) return;
    const tail = (series) => Object.fromEntries(Object.entries(series).map(([f, col]) => [f, col.slice(skip)]));
    h.t.push(...doc.t.slice(skip));
    appendSeries(h.fleet, tail(doc.fleet), n, add);
    for (const [name, series] of Object.entries(doc.models)) {
      if (!h.models[name]) h.models[name] = {};
      appendSeries(h.models[name], tail(series), n, add);
    }
    for (const [name, series] of Object.entries(h.models)) {
      if (!doc.models[name]) appendSeries(series, {}, n, add);     // a model gone: gaps
    }
    const cut = h.t.length - h.points;
    if (cut > 0) {
      h.t.splice(0, cut);
      for (const series of [h.fleet, ...Object.values(h.models)]) for (const col of Object.values(series)) col.splice(0, cut);
    }
  }
  renderCharts();
}

// More models' series of the last history answer (a big first answer comes in parts, control/webui.py
// HISTORY_PART): each put on the page's times by its own, a time the page does not hold left out.
function onHistoryPart(doc) {
  const h = state.history;
  if (!h) return;
  const at = new Map(doc.t.map((t, i) => [t, i]));
  for (const [name, series] of Object.entries(doc.models)) {
    const into = {};
    for (const [field, col] of Object.entries(series)) {
      into[field] = h.t.map((t) => { const i = at.get(t); return i === undefined ? null : col[i]; });
    }
    h.models[name] = into;
  }
  renderCharts();
}

function appendSeries(into, from, before, add) {
  for (const [field, col] of Object.entries(from)) {
    if (!into[field]) into[field] = new Array(before).fill(null);
    into[field].push(...col);
  }
  for (const [field, col] of Object.entries(into)) {
    if (!from[field]) for (let i = 0; i < add; i++) col.push(null);
  }
}

function chartData(series, spec) {
  const h = state.history;
  return [h.t, ...spec.series.map(([field]) => {
    const col = series[field] || [];
    return MS_FIELDS.has(field) ? col.map((v) => (v === null || v === undefined ? null : v * 1000)) : col;
  })];
}

function peak(col) {
  let best = 0;
  for (const v of col || []) if (v !== null && v > best) best = v;
  return best;
}

function chartCard(name) {
  let entry = state.charts.get(name);
  if (entry) return entry;
  const card = el("div", { class: "chart-card", "data-chart": name || "(fleet)" },
    el("h3", {}, name ? el("span", { class: "mono" }, name) : "Fleet (every model)"));
  const plots = [];
  const width = Math.max(240, Math.min(420, ($("charts").clientWidth || 900) / 3 - 16));
  for (const spec of CHARTS) {
    const box = el("div", { class: "chart" });
    card.appendChild(box);
    if (typeof uPlot !== "function") { box.appendChild(el("p", { class: "error" }, "uPlot did not load")); continue; }
    const opts = {
      title: spec.title, width: width, height: 150,
      scales: { x: { time: true }, tok: { auto: true } },
      legend: { live: false },
      series: [{}, ...spec.series.map(([, label, colour, scale]) => ({ label, stroke: colour, scale, width: 1.5,
                                                                      spanGaps: false }))],
      axes: [{ stroke: "#8d96a0" }, { scale: "y", stroke: "#8d96a0", size: 44 },
             ...(spec.series.some((x) => x[3] === "tok") ? [{ scale: "tok", side: 1, stroke: "#8250df", grid: { show: false }, size: 44 }] : [])],
    };
    plots.push(new uPlot(opts, chartData({}, spec), box));
  }
  entry = { card, plots };
  state.charts.set(name, entry);
  return entry;
}

function renderCharts() {
  const h = state.history;
  if (!h) return;
  setText("history-interval", String(h.interval));
  $("no-history").hidden = h.t.length > 0;
  const names = [""].concat(Object.keys(h.models).sort().slice(0, MAX_CHARTS));
  const wanted = new Set(names);
  for (const [name, entry] of state.charts) {
    if (!wanted.has(name)) { entry.plots.forEach((p) => p.destroy()); entry.card.remove(); state.charts.delete(name); }
  }
  const box = $("charts");
  names.forEach((name) => {
    const entry = chartCard(name);
    if (entry.card.parentNode !== box) box.appendChild(entry.card);
    const series = name ? h.models[name] : h.fleet;
    CHARTS.forEach((spec, i) => {
      const plot = entry.plots[i];
      if (!plot) return;
      plot.setData(chartData(series, spec));
      // At least five minutes across: uPlot spreads a fleet's first point (or few seconds) over years.
      const last = h.t[h.t.length - 1];
      if (last !== undefined && last - h.t[0] < 300) plot.setScale("x", { min: last - 300, max: last });
    });
    // What a test (or a curious reader of the DOM) can check without reading a canvas.
    const points = (series.requests || []).filter((v) => v !== null).length;
    entry.card.setAttribute("data-points", String(points));
    entry.card.setAttribute("data-peak-requests", String(peak(series.requests)));
    entry.card.setAttribute("data-peak-desired", String(peak(series.desired)));
    entry.card.setAttribute("data-peak-ready", String(peak(series.ready)));
    for (const field of ["requests", "desired", "ready"]) {
      entry.card.setAttribute("data-last-" + field, String((series[field] || []).slice(-1)[0] ?? ""));
    }
  });
}

function resizeCharts() {
  const width = Math.max(240, Math.min(420, ($("charts").clientWidth || 900) / 3 - 16));
  for (const entry of state.charts.values()) entry.plots.forEach((p) => p.setSize({ width, height: 150 }));
}

// -- model choices (playground, request log filter) ---------------------------------

function renderModelChoices(models) {
  const names = models.map((m) => m.name);
  const key = names.join("\n") + "|" + models.map((m) => (m.aliases || []).join(",")).join(";");
  if (state.modelChoices === key) return;
  state.modelChoices = key;
  const pg = $("pg-model"), was = pg.value;
  pg.replaceChildren(...models.flatMap((m) => [el("option", {}, m.name),
    ...(m.aliases || []).map((a) => el("option", {}, a))]));
  if (was && [...pg.options].some((o) => o.value === was)) pg.value = was;
  const rl = $("rl-model"), had = rl.value;
  rl.replaceChildren(el("option", {}, ""), ...names.map((n) => el("option", {}, n)));
  rl.options[0].textContent = "all";
  rl.options[0].value = "";
  rl.value = had;
}

// -- request log ---------------------------------------------------------------------

async function refreshRequests(now) {
  const at = Date.now();
  // A tab in the background reads nothing until it is looked at again.
  if (!now && (at - state.refreshed.requests < REFRESH_MS || (document.hidden && state.refreshed.requests))) return;
  state.refreshed.requests = at;
  const q = new URLSearchParams({ limit: "50" });
  if ($("rl-model").value) q.set("model", $("rl-model").value);
  if ($("rl-status").value) q.set("status", $("rl-status").value);
  if ($("rl-id").value.trim()) q.set("id", $("rl-id").value.trim());
  let body;
  try {
    body = await (await api("requests?" + q.toString())).json();
  } catch (err) {
    setText("rl-summary", "cannot read the request log: " + (err && err.message || err));
    return;
  }
  setText("rl-summary", body.requests.length + " shown · the last " + Math.min(body.total, body.capacity)
          + " of " + body.total + " since start are kept");
  $("no-requests").hidden = body.requests.length > 0;
  const now_s = Date.now() / 1000;
  replaceRows("requests", body.requests.map((r) => el("tr", { "data-request-id": r.id, "data-status": r.status },
    el("td", { title: new Date(r.at * 1000).toISOString() }, ago(now_s - r.at)),
    el("td", { class: "mono" }, r.id),
    el("td", {}, r.key || "-"),
    el("td", {}, r.model || "-", r.asked && r.asked !== r.model ? el("div", { class: "muted" }, "asked " + r.asked) : null),
    el("td", {}, badge(String(r.status), r.status >= 500 ? "failed" : r.status >= 400 ? "starting" : "ready")),
    el("td", {}, r.ttft === null ? "-" : Math.round(r.ttft * 1000) + " ms"),
    el("td", {}, (r.tokens_in ?? "-") + " / " + (r.tokens_out ?? "-")),
    el("td", {}, Math.round(r.duration * 1000) + " ms"),
    el("td", { class: "mono" }, r.replica || "-"),
    el("td", {}, r.error ? el("span", { class: "error" }, r.error) : ""),
  )));
}

// -- GPU view --------------------------------------------------------------------------

async function refreshGpus(now) {
  const at = Date.now();
  if (!now && (at - state.refreshed.gpus < REFRESH_MS || (document.hidden && state.refreshed.gpus))) return;
  state.refreshed.gpus = at;
  const q = new URLSearchParams({ limit: "50" });
  if ($("gpu-node").value.trim()) q.set("node", $("gpu-node").value.trim());
  let body;
  try {
    body = await (await api("gpus?" + q.toString())).json();
  } catch (err) {
    setText("gpu-summary", "cannot read the GPUs: " + (err && err.message || err));
    return;
  }
  setText("gpu-summary", body.total ? "nodes with GPUs: " + body.total + (body.total > body.nodes.length
          ? ", the first " + body.nodes.length + " shown" : "") : "no node reports a GPU");
  $("gpu-nodes").replaceChildren(...body.nodes.map((n) => el("div", { class: "gpu-node", "data-node": n.name },
    el("h3", {}, el("span", { class: "mono" }, n.name), " ", badge(n.state)),
    ...n.gpus.map((g) => gpuRow(g)))));
}

function gpuRow(g) {
  const total = g.memory_mib || 0;
  const bar = el("div", { class: "gpu-bar", title: total ? mib(total) + " in all" : "memory unknown" });
  const legend = [];
  const add = (cls, size, label) => {
    const seg = el("span", { class: "seg " + cls, title: label });
    seg.style.width = total ? Math.min(100, (100 * size) / total).toFixed(2) + "%" : "0";
    bar.appendChild(seg);
    legend.push(el("li", {}, el("span", { class: "swatch " + cls }), label));
  };
  g.replicas.forEach((r, i) => add("r" + (i % 4), r.memory_mib,
    r.id + " (" + r.model + ", " + r.state + "): " + (r.whole ? "the whole GPU" : mib(r.memory_mib))));
  if (g.other_mib) add("other", g.other_mib, mib(g.other_mib) + " held outside llmgw");
  const used = g.replicas.reduce((a, r) => a + r.memory_mib, 0) + (g.other_mib || 0);
  return el("div", { class: "gpu", "data-gpu": g.index },
    el("div", { class: "gpu-label" }, "GPU " + g.index + (g.name ? " " + g.name : "") + (total ? " · " + mib(total) : ""),
       el("span", { class: "muted" }, " · " + (g.replicas.length ? mib(Math.min(used, total)) + " held" : "free"))),
    bar, legend.length ? el("ul", { class: "plain legend" }, legend) : null);
}

// -- playground ----------------------------------------------------------------------

function newRequestId() {
  const bytes = new Uint8Array(8);
  crypto.getRandomValues(bytes);
  return "console-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function sendPrompt(ev) {
  ev.preventDefault();
  if (state.playground) return;
  const out = $("pg-output");
  const rid = newRequestId();
  const key = $("pg-key").value.trim();
  if (key) sessionStorage.setItem(APIKEY_KEY, key); else sessionStorage.removeItem(APIKEY_KEY);
  const body = { model: $("pg-model").value, max_tokens: Number($("pg-max-tokens").value) || 128,
                 messages: [{ role: "user", content: $("pg-prompt").value }] };
  const hdrs = { ...headers(), "Content-Type": "application/json", "X-Request-Id": rid };
  if (key) hdrs["X-Llmgw-Api-Key"] = key;
  out.textContent = "";
  out.dataset.state = "streaming";
  out.dataset.requestId = rid;
  const t0 = performance.now();
  let ttft = null, chunks = 0, usage = null, replica = "";
  const stats = () => setText("pg-stats", "request " + rid + (replica ? " · replica " + replica : "")
    + " · TTFT " + (ttft === null ? "…" : Math.round(ttft) + " ms")
    + " · " + (usage ? usage.prompt_tokens + " tokens in, " + usage.completion_tokens + " out" : chunks + " chunks")
    + (ttft !== null && usage ? " · " + (usage.completion_tokens / Math.max(0.001, (performance.now() - t0) / 1000)).toFixed(1) + " tokens/s" : ""));
  state.playground = new AbortController();
  $("pg-send").disabled = true;
  $("pg-stop").disabled = false;
  stats();
  try {
    const resp = await fetch(API + "playground/chat", { method: "POST", headers: hdrs, body: JSON.stringify(body),
                                                         cache: "no-store", signal: state.playground.signal });
    replica = resp.headers.get("x-llmgw-replica") || "";
    if (!resp.ok || !(resp.headers.get("Content-Type") || "").startsWith("text/event-stream")) {
      const text = await resp.text();
      let message = text;
      try { message = JSON.parse(text).error.message; } catch (err) { /* not JSON: shown as it is */ }
      out.dataset.state = "error";
      out.textContent = "HTTP " + resp.status + ": " + message;
      return;
    }
    for await (const { data } of events(resp)) {
      if (data.trim() === "[DONE]") continue;
      let doc;
      try { doc = JSON.parse(data); } catch (err) { continue; }
      if (doc.error) { out.dataset.state = "error"; out.appendChild(el("span", { class: "error" }, "\n" + (doc.error.message || "error"))); continue; }
      const text = doc.choices && doc.choices[0] && doc.choices[0].delta && doc.choices[0].delta.content;
      if (text) {
        if (ttft === null) ttft = performance.now() - t0;
        chunks += 1;
        out.appendChild(document.createTextNode(text));
      }
      if (doc.usage) usage = doc.usage;
      stats();
    }
    if (out.dataset.state === "streaming") out.dataset.state = "done";
  } catch (err) {
    out.dataset.state = err && err.name === "AbortError" ? "stopped" : "error";
    if (out.dataset.state === "error") out.appendChild(el("span", { class: "error" }, "\n" + String(err && err.message || err)));
  } finally {
    stats();
    state.playground = null;
    $("pg-send").disabled = false;
    $("pg-stop").disabled = true;
    refreshRequests(true);
  }
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
    sessionStorage.removeItem(APIKEY_KEY);
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
  $("pg-key").value = sessionStorage.getItem(APIKEY_KEY) || "";
  $("pg-form").addEventListener("submit", sendPrompt);
  $("pg-stop").addEventListener("click", () => { if (state.playground) state.playground.abort(); });
  $("rl-form").addEventListener("submit", (ev) => { ev.preventDefault(); refreshRequests(true); });
  $("rl-model").addEventListener("change", () => refreshRequests(true));
  $("rl-status").addEventListener("change", () => refreshRequests(true));
  $("gpu-form").addEventListener("submit", (ev) => { ev.preventDefault(); refreshGpus(true); });
  $("gpu-node").addEventListener("change", () => refreshGpus(true));
  window.addEventListener("resize", resizeCharts);
  setInterval(render, AGE_REDRAW_MS);
  run();
}

document.addEventListener("DOMContentLoaded", setup);

// A run: its plan graph coloured by stage state, its stages, output or failure reason and history, kept
// current by GET /api/v1/runs/{id}/events (which ends once the run is final); cancel and re-drive for
// the roles that may (the server renders those buttons for them only).
"use strict";

(() => {
  const {h, badge, time, api, json} = Saga;
  const runId = document.getElementById("run").dataset.run;
  const base = "/api/v1/runs/" + encodeURIComponent(runId);
  const graph = document.getElementById("graph");
  const FINAL = new Set(["completed", "failed", "refused"]);
  const BAD = new Set(["failed", "timed-out"]);
  let current = null;
  let historyShown = -1;

  function paintGraph(doc) {
    for (const group of graph.querySelectorAll("g.stage[data-stage]")) {
      const stage = doc.stages[group.dataset.stage];
      const state = stage ? stage.state : "";
      if (group.dataset.state !== state) group.dataset.state = state;
      const progress = graph.querySelector(`text.progress[data-stage="${CSS.escape(group.dataset.stage)}"]`);
      if (progress && stage && stage.items) progress.textContent = `${stage.items.done}/${stage.items.total}`;
    }
    // each stage routing to a terminal has its own copy of it: light the one the run ended through
    for (const terminal of graph.querySelectorAll("g.terminal[data-terminal]")) {
      const source = doc.stages[terminal.dataset.source];
      const through = source && (doc.state === "completed" ? source.state === "completed" : BAD.has(source.state));
      terminal.dataset.state = terminal.dataset.terminal === doc.state && through ? "reached" : "";
    }
    for (const edge of graph.querySelectorAll("path.edge[data-from][data-to]")) {
      edge.dataset.state = taken(edge, doc) ? "taken" : "";
    }
  }

  // A route was taken when its stage ended the way the route is for and its target was reached (a
  // decision: the branch it chose).
  function taken(edge, doc) {
    const from = doc.stages[edge.dataset.from];
    const reached = doc.stages[edge.dataset.to] || edge.dataset.to === doc.state;
    if (!from || !reached) return false;
    if (edge.classList.contains("edge-failure")) return BAD.has(from.state);
    if (from.state !== "completed") return false;
    return !edge.classList.contains("edge-branch") || from.next === undefined || from.next === edge.dataset.to;
  }

  function detail(stage) {
    const parts = [];
    if (stage.items) parts.push(`${stage.items.done}/${stage.items.total} items`);
    if (stage.arrived) parts.push(`${stage.arrived.done}/${stage.arrived.total} branches arrived`);
    if (stage.next) parts.push(`took branch ${stage.branch} → ${stage.next}`);
    if (stage.error) parts.push(typeof stage.error === "string" ? stage.error : JSON.stringify(stage.error));
    if (stage.waiting) parts.push(stage.waiting);
    if (stage.lane) parts.push(stage.lane);
    return parts.join("; ");
  }

  function showStages(doc) {
    const names = doc.order && doc.order.length ? doc.order : Object.keys(doc.stages);
    const rows = names.filter((name) => doc.stages[name]).map((name) => {
      const stage = doc.stages[name];
      return h("tr", {"data-stage": name, "data-state": stage.state},
        h("td", {}, name), h("td", {}, stage.type || ""), h("td", {}, badge(stage.state)),
        h("td", {}, stage.attempt ?? ""), h("td", {class: "reason"}, detail(stage)));
    });
    document.querySelector("#stages tbody").replaceChildren(...rows);
  }

  function showFacts(doc) {
    const state = document.getElementById("run-state");
    state.dataset.state = doc.state;
    state.textContent = doc.intent && !FINAL.has(doc.state) ? `${doc.state} (ending ${doc.intent})` : doc.state;
    document.getElementById("run-shard").textContent = doc.shard || "";
    document.getElementById("run-created").textContent = time(doc.created_at);
    document.getElementById("run-finished").textContent = time(doc.finished_at);
    const reason = document.getElementById("run-reason");
    reason.hidden = !doc.reason;
    reason.textContent = doc.reason ? `Reason: ${doc.reason}` : "";
    document.getElementById("run-output").textContent = doc.output == null ? "(none yet)" : json(doc.output);
    for (const button of document.querySelectorAll("#run-controls button[data-verb]")) {
      const verb = button.dataset.verb;
      button.disabled = verb === "cancel" ? FINAL.has(doc.state) || doc.intent === "failed" : doc.state !== "failed";
    }
  }

  async function showHistory() {
    const {events} = await api("GET", base + "/history");
    if (events.length === historyShown) return;
    historyShown = events.length;
    const items = events.map((e) => {
      const rest = Object.fromEntries(
        Object.entries(e).filter(([k]) => !["seq", "id", "at", "kind", "stage", "attempt"].includes(k)));
      return h("li", {"data-kind": e.kind},
        h("time", {}, time(e.at)), " ", h("strong", {}, e.kind),
        e.stage ? h("span", {class: "stage-name"}, " " + e.stage + (e.attempt ? ` #${e.attempt}` : "")) : null,
        Object.keys(rest).length ? h("code", {class: "detail"}, JSON.stringify(rest)) : null);
    });
    document.getElementById("history").replaceChildren(...items);
  }

  function update(doc) {
    current = doc;
    paintGraph(doc);
    showFacts(doc);
    showStages(doc);
    showHistory().catch((error) => Saga.notice(error.message, "error"));
  }

  function controls() {
    const form = document.getElementById("run-controls");
    if (!form) return;
    const confirm = document.getElementById("confirm");
    const go = document.getElementById("confirm-action");
    let verb = null;
    for (const button of form.querySelectorAll("button[data-verb]")) {
      button.addEventListener("click", () => {
        verb = button.dataset.verb;
        go.textContent = `Confirm ${button.textContent.toLowerCase()}`;
        confirm.hidden = false;
      });
    }
    document.getElementById("confirm-back").addEventListener("click", () => { confirm.hidden = true; });
    go.addEventListener("click", async () => {
      confirm.hidden = true;
      try {
        const reason = document.getElementById("run-action-reason").value;
        await api("POST", `${base}/${verb}`, {reason});
        Saga.notice(`${verb === "cancel" ? "Cancel" : "Re-drive"} requested; the run's shard acts on it.`);
        if (verb === "redrive" && current && FINAL.has(current.state)) follow(current.finished_at, 10);
      } catch (error) {
        Saga.notice(error.message, "error");
      }
    });
    form.addEventListener("submit", (e) => e.preventDefault());
  }

  // After a re-drive the run stays failed until its shard takes the request: read again (a stream ends
  // at once on a final run) until it moved on from the failure it had.
  function follow(failedAt, tries) {
    Saga.follow(base + "/events", update, document.getElementById("live"), () => {
      showHistory().catch(() => {});
      const unmoved = failedAt && current && current.state === "failed" && current.finished_at === failedAt;
      if (unmoved && tries > 0) setTimeout(() => follow(failedAt, tries - 1), 1000);
    });
  }

  controls();
  follow();
})();

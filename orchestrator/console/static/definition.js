// A definition: its versions with their lifecycle state and who moved them, the plan of a version as a
// graph (GET .../versions/{v}/graph), a diff of two versions, the audit; lifecycle buttons for the
// roles that may use them.
"use strict";

(() => {
  const {h, api, time, badge, may} = Saga;
  const name = document.getElementById("definition").dataset.definition;
  const base = "/api/v1/definitions/" + encodeURIComponent(name);
  // The verbs a version's row offers, by its state (the server decides: a refusal says why).
  const OFFERED = {
    published: ["approve", "retire"],
    approved: ["activate", "canary", "retire"],
    standby: ["activate", "canary", "retire"],
    active: [],
    canary: [],
    retired: [],
  };

  function who(by, at) {
    return by ? [by, h("br"), h("small", {}, time(at))] : "";
  }

  function verbButtons(version) {
    return (OFFERED[version.state] || []).filter((verb) => may(verb)).map((verb) =>
      h("button", {type: "button", "data-verb": verb, "data-version": version.version,
        onclick: () => change(verb, version.version)}, verb));
  }

  async function change(verb, version) {
    const body = {reason: document.getElementById("lifecycle-reason").value};
    if (version) body.version = version;
    if (verb === "canary") body.percent = Number(document.getElementById("canary-percent").value);
    try {
      const done = await api("POST", `${base}/${verb}`, body);
      Saga.notice(done.changed ? `${verb}: done` : `${verb}: nothing to change`);
      await load();
    } catch (error) {
      Saga.notice(error.message, "error");
    }
  }

  function options(select, versions, chosen) {
    const keep = select.value;
    select.replaceChildren(...versions.map((v) => h("option", {value: v.version}, `${v.version} (${v.state})`)));
    select.value = keep && versions.some((v) => v.version === keep) ? keep : chosen;
  }

  async function drawGraph(version) {
    const box = document.getElementById("graph");
    if (!version) return box.replaceChildren(h("p", {class: "hint"}, "no version"));
    const response = await fetch(`${base}/versions/${encodeURIComponent(version)}/graph`, {credentials: "same-origin"});
    if (!response.ok) return box.replaceChildren(h("p", {class: "hint"}, `no graph (HTTP ${response.status})`));
    // our own server's SVG, drawn from the stored plan (names escaped there); parsed as SVG, not HTML
    const svg = new DOMParser().parseFromString(await response.text(), "image/svg+xml").documentElement;
    box.replaceChildren(document.importNode(svg, true));
  }

  function showDiff(diff) {
    const lines = [];
    for (const s of diff.stages_added) lines.push(h("li", {class: "added"}, `+ stage ${s}`));
    for (const s of diff.stages_removed) lines.push(h("li", {class: "removed"}, `- stage ${s}`));
    for (const [stage, changes] of Object.entries(diff.stages_changed)) {
      lines.push(h("li", {class: "changed"}, `~ stage ${stage}`,
        h("ul", {}, changes.map((c) => h("li", {}, `${c.path}: ${JSON.stringify(c.before)} → ${JSON.stringify(c.after)}`)))));
    }
    for (const c of diff.definition_changed) {
      lines.push(h("li", {class: "changed"}, `~ ${c.path}: ${JSON.stringify(c.before)} → ${JSON.stringify(c.after)}`));
    }
    for (const c of diff.contracts_added) lines.push(h("li", {class: "added"}, `+ contract ${c}`));
    for (const c of diff.contracts_removed) lines.push(h("li", {class: "removed"}, `- contract ${c}`));
    for (const c of Object.keys(diff.contracts_changed)) lines.push(h("li", {class: "changed"}, `~ contract ${c}`));
    document.getElementById("diff").replaceChildren(
      lines.length ? h("ul", {class: "diff"}, lines) : h("p", {class: "hint"}, "no change in meaning"));
  }

  async function load() {
    const shown = await api("GET", base);
    document.getElementById("active").textContent = shown.active || "none";
    document.getElementById("canary").textContent =
      shown.canary ? `${shown.canary} (${shown.canary_percent}%)` : "none";
    const rows = shown.versions.map((v) => h("tr", {"data-version": v.version, "data-state": v.state},
      h("td", {}, v.version), h("td", {}, badge(v.state)), h("td", {}, h("code", {title: v.digest}, v.digest.replace(/^sha256:/, "").slice(0, 12))),
      h("td", {}, who(v.published_by, v.published_at)), h("td", {}, who(v.approved_by, v.approved_at)),
      h("td", {}, who(v.activated_by, v.activated_at)), h("td", {}, who(v.retired_by, v.retired_at)),
      h("td", {}, v.unfinished_runs), h("td", {class: "buttons"}, verbButtons(v))));
    document.querySelector("#versions tbody").replaceChildren(...rows);
    const audit = [...shown.audit].reverse().map((a) => h("tr", {},
      h("td", {}, time(a.at)), h("td", {}, a.actor || ""), h("td", {}, a.action || ""), h("td", {}, a.version || ""),
      h("td", {}, a.from || a.to ? `${a.from || "–"} → ${a.to || "–"}` : ""), h("td", {}, a.reason || "")));
    document.querySelector("#audit tbody").replaceChildren(...audit);
    const newest = shown.versions.length ? shown.versions[shown.versions.length - 1].version : "";
    const pick = shown.active || newest;
    options(document.getElementById("graph-version"), shown.versions, pick);
    options(document.getElementById("diff-from"), shown.versions, shown.versions.length > 1 ? shown.versions[0].version : pick);
    options(document.getElementById("diff-to"), shown.versions, newest);
    await drawGraph(document.getElementById("graph-version").value);
  }

  const lifecycle = document.getElementById("lifecycle");
  if (lifecycle) {
    lifecycle.addEventListener("submit", (e) => e.preventDefault());
    for (const button of lifecycle.querySelectorAll("button[data-verb]")) {
      button.addEventListener("click", () => change(button.dataset.verb, null));
    }
  }
  document.getElementById("graph-version").addEventListener("change", (e) => drawGraph(e.target.value));
  document.getElementById("diff-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const query = new URLSearchParams({v1: document.getElementById("diff-from").value, v2: document.getElementById("diff-to").value});
    try {
      showDiff(await api("GET", `${base}/diff?${query}`));
    } catch (error) {
      Saga.notice(error.message, "error");
    }
  });
  load().catch((error) => Saga.notice(error.message, "error"));
})();

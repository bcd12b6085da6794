// Definitions: one row per definition, from GET /api/v1/definitions (one row per version).
"use strict";

(async () => {
  const {h, api, time} = Saga;
  try {
    const rows = await api("GET", "/api/v1/definitions");
    const byName = new Map();
    for (const row of rows) {
      if (!byName.has(row.definition)) byName.set(row.definition, []);
      byName.get(row.definition).push(row);
    }
    const lines = [...byName.entries()].sort(([a], [b]) => a.localeCompare(b)).map(([name, versions]) => {
      const active = versions.find((v) => v.state === "active");
      const canary = versions.find((v) => v.state === "canary");
      const last = Math.max(...versions.map((v) =>
        Math.max(v.published_at || 0, v.approved_at || 0, v.activated_at || 0, v.retired_at || 0)));
      return h("tr", {"data-definition": name},
        h("td", {}, h("a", {href: "/console/definitions/" + encodeURIComponent(name)}, name)),
        h("td", {}, active ? active.version : "none"),
        h("td", {}, canary ? `${canary.version} (${canary.canary_percent}%)` : ""),
        h("td", {}, versions.length),
        h("td", {}, versions.reduce((n, v) => n + (v.unfinished_runs || 0), 0)),
        h("td", {}, time(last)));
    });
    document.querySelector("#definitions tbody").replaceChildren(...lines);
    document.getElementById("definitions-empty").hidden = lines.length > 0;
  } catch (error) {
    Saga.notice(error.message, "error");
  }
})();

// Runs: the listing with the page's filters, kept current by GET /api/v1/runs/events.
"use strict";

(() => {
  const {h, badge, time} = Saga;
  const body = document.querySelector("#runs tbody");
  const empty = document.getElementById("runs-empty");
  const params = new URLSearchParams(location.search);
  for (const key of [...params.keys()]) if (!params.get(key)) params.delete(key);

  function row(run) {
    const link = "/console/runs/" + encodeURIComponent(run.run_id);
    return h("tr", {"data-run": run.run_id, "data-state": run.state},
      h("td", {}, h("a", {href: link}, h("code", {}, run.run_id))),
      h("td", {}, run.definition || "?"),
      h("td", {}, run.version || "?"),
      h("td", {}, badge(run.state)),
      h("td", {}, time(run.created_at)),
      h("td", {}, time(run.finished_at || run.updated_at)),
      h("td", {class: "reason"}, run.reason || ""));
  }

  Saga.follow("/api/v1/runs/events?" + params, (listing) => {
    body.replaceChildren(...listing.runs.map(row));
    empty.hidden = listing.runs.length > 0;
  }, document.getElementById("live"));
})();

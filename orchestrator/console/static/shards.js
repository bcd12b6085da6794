// Shards: queue depth (messages waiting: the lag), consumers, unfinished runs and who serves each
// (GET /api/v1/shards), read again every two seconds.
"use strict";

(() => {
  const {h, api} = Saga;
  const live = document.getElementById("live");
  const unknown = (n) => (n === null || n === undefined ? "?" : n);

  async function load() {
    try {
      const {version, shards} = await api("GET", "/api/v1/shards");
      document.getElementById("map-version").textContent = version;
      document.querySelector("#shards tbody").replaceChildren(...shards.map((s) => h("tr", {"data-shard": s.shard},
        h("td", {}, h("code", {}, s.shard)), h("td", {}, s.shard_class), h("td", {}, Saga.badge(s.state)),
        h("td", {class: "number"}, unknown(s.queued)), h("td", {class: "number"}, unknown(s.consumers)),
        h("td", {class: "number"}, s.unfinished_runs), h("td", {class: "number"}, s.outbox),
        h("td", {class: "number"}, s.timers), h("td", {class: "number"}, unknown(s.dead_letters)),
        h("td", {}, s.serving || "–"))));
      live.dataset.live = "live";
      live.textContent = "live";
    } catch (error) {
      live.dataset.live = "problem";
      live.textContent = error.message;
    }
    setTimeout(load, 2000);
  }

  load();
})();

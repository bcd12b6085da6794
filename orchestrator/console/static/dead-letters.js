// Dead letters, per dead-letter queue (GET /api/v1/dead-letters); replay for the roles that may.
"use strict";

(() => {
  const {h, api, may} = Saga;
  const canReplay = may("handle_dead_letters");

  async function replay(queue, messageId) {
    try {
      const body = messageId ? {queue, message_id: messageId} : {queue};
      const {replayed} = await api("POST", "/api/v1/dead-letters/replay", body);
      const failed = replayed.filter((r) => r.error);
      Saga.notice(failed.length
        ? `replayed ${replayed.length - failed.length}; failed: ${failed.map((r) => r.error).join("; ")}`
        : `replayed ${replayed.length} message(s)`, failed.length ? "error" : "info");
      await load();
    } catch (error) {
      Saga.notice(error.message, "error");
    }
  }

  function queueSection(q) {
    const rows = q.messages.map((m) => h("tr", {"data-message": m.message_id},
      h("td", {}, h("code", {}, m.message_id || m.amqp_message_id || "?")), h("td", {}, m.kind || ""),
      h("td", {}, m.run_id ? h("a", {href: "/console/runs/" + encodeURIComponent(m.run_id)}, m.run_id) : ""),
      h("td", {}, m.stage || ""), h("td", {}, m.reason || ""), h("td", {class: "reason"}, m.detail || ""),
      h("td", {}, m.death_count ?? ""),
      h("td", {}, canReplay && m.message_id ? h("button", {type: "button", class: "replay",
        onclick: () => replay(q.queue, m.message_id)}, "Replay") : "")));
    return h("section", {class: "queue", "data-queue": q.queue},
      h("h2", {}, h("code", {}, q.queue), " ", h("span", {class: "count"}, q.exists ? `${q.count}` : "not declared"),
        canReplay && q.count ? h("button", {type: "button", class: "replay-all", onclick: () => replay(q.queue, null)},
          "Replay all") : null),
      rows.length ? h("table", {class: "grid"},
        h("thead", {}, h("tr", {}, ["Message", "Kind", "Run", "Stage", "Reason", "Detail", "Deaths", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, rows)) : null);
  }

  async function load() {
    try {
      const {queues} = await api("GET", "/api/v1/dead-letters?limit=200");
      document.getElementById("queues").replaceChildren(...queues.map(queueSection));
    } catch (error) {
      Saga.notice(error.message, "error");
    }
  }

  load();
})();

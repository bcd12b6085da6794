// The console's shared helpers (window.Saga): API calls, live streams, DOM building, times. Plain
// JavaScript, no library: the server ships every file the console needs.
"use strict";

window.Saga = (() => {
  const actions = new Set((document.body.dataset.actions || "").split(" ").filter(Boolean));

  /** Whether the signed-in role may do `action` (the server rendered the list: GET /api/v1/whoami). */
  function may(action) {
    return actions.has(action);
  }

  /** An element: h("a", {href: "/x", class: "y"}, "text", child, ...). Text is never parsed as HTML. */
  function h(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function signIn() {
    const here = location.pathname + location.search;
    location.assign("/console/sign-in?next=" + encodeURIComponent(here));
  }

  class ApiError extends Error {
    constructor(status, error) {
      super(error && error.message ? error.message : "HTTP " + status);
      this.status = status;
      this.code = error && error.code;
    }
  }

  /** Call the API with the session cookie. Changing calls carry X-Saga-Console: 1, which the server
   * requires of cookie-authenticated requests (a page on another site cannot add it). A 401 (signed
   * out, or the token revoked) leads to the sign-in page, unless `signInOn401` is false. */
  async function api(method, path, body, signInOn401 = true) {
    const init = {method, credentials: "same-origin", headers: {Accept: "application/json"}};
    if (method !== "GET") {
      init.headers["X-Saga-Console"] = "1";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body || {});
    }
    const response = await fetch(path, init);
    if (response.status === 401 && signInOn401) {
      signIn();
      throw new ApiError(401, {message: "signed out"});
    }
    const text = await response.text();
    const data = text && (response.headers.get("content-type") || "").includes("json") ? JSON.parse(text) : text;
    if (!response.ok) throw new ApiError(response.status, data && data.error);
    return data;
  }

  /** Follow a server-sent event stream: `onData` gets each document; the stream's `end` event closes
   * it; `denied` (the token was revoked) sends the user to sign in. `live` (an element) shows whether
   * the page is connected. EventSource reconnects by itself after a dropped connection. */
  function follow(path, onData, live, onEnd) {
    const source = new EventSource(path);
    const show = (state, text) => {
      if (!live) return;
      live.dataset.live = state;
      live.textContent = text;
    };
    source.onopen = () => show("live", "live");
    source.onmessage = (e) => {
      show("live", "live");
      onData(JSON.parse(e.data));
    };
    source.addEventListener("end", () => {
      source.close();
      show("ended", "final");
      if (onEnd) onEnd();
    });
    source.addEventListener("denied", () => {
      source.close();
      signIn();
    });
    source.addEventListener("problem", (e) => show("problem", JSON.parse(e.data).message));
    source.onerror = () => {
      if (source.readyState !== EventSource.CLOSED) show("connecting", "reconnecting…");
    };
    return source;
  }

  /** A time in ms as local "YYYY-MM-DD HH:MM:SS". */
  function time(ms) {
    if (!ms) return "";
    const d = new Date(Number(ms));
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function notice(text, kind) {
    const box = document.getElementById("notice");
    if (!box) return;
    box.textContent = text;
    box.dataset.kind = kind || "info";
    box.hidden = !text;
  }

  /** A state as a badge, coloured by CSS on its data-state. */
  function badge(state) {
    return h("span", {class: "state", "data-state": state}, state);
  }

  function json(value) {
    return JSON.stringify(value, null, 2);
  }

  function markNav() {
    const section = {run: "runs", definition: "definitions"}[document.body.dataset.page] || document.body.dataset.page;
    for (const link of document.querySelectorAll("nav a")) {
      if (link.dataset.section === section) link.setAttribute("aria-current", "page");
    }
    const out = document.getElementById("sign-out");
    if (out) {
      out.addEventListener("click", async () => {
        await api("DELETE", "/console/session");
        location.assign("/console/sign-in");
      });
    }
  }

  document.addEventListener("DOMContentLoaded", markNav);
  return {may, h, api, follow, time, notice, badge, json, ApiError};
})();

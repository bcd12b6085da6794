// Sign in: the token goes to POST /console/session, which keeps it in an HttpOnly cookie.
"use strict";

(() => {
  const form = document.getElementById("sign-in-form");
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    Saga.notice("");
    try {
      await Saga.api("POST", "/console/session", {token: form.token.value}, false);
      location.assign(form.dataset.next || "/console/runs");
    } catch (error) {
      Saga.notice(error.message, "error");
    }
  });
})();

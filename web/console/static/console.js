// The loraplex console's only script. Every page works without it (plain forms, confirmation pages);
// with it: copy buttons, confirmation dialogs, upload progress, status polling and streamed chat.
"use strict";

const csrfToken = () => document.querySelector('meta[name="csrf-token"]').content;

// -- copy buttons ----------------------------------------------------------------------------------

function setUpCopyButtons() {
  for (const button of document.querySelectorAll("[data-copy-target]")) {
    button.addEventListener("click", async () => {
      const input = document.getElementById(button.dataset.copyTarget);
      const status = document.getElementById("copy-status");
      let copied = false;
      try {
        await navigator.clipboard.writeText(input.value);
        copied = true;
      } catch {
        input.select(); // the clipboard API needs a secure context; the old command does not
        copied = document.execCommand("copy");
      }
      button.textContent = copied ? "Copied" : "Copy";
      if (status) status.textContent = copied ? "The key is on your clipboard." : "Select the key and copy it.";
    });
  }
  for (const input of document.querySelectorAll("[data-select-on-focus]")) {
    input.addEventListener("focus", () => input.select());
  }
}

// -- confirmation dialogs --------------------------------------------------------------------------

function setUpConfirmations() {
  const dialog = document.getElementById("confirm-dialog");
  if (!dialog || typeof dialog.showModal !== "function") return; // the server's confirmation page then
  let pending = null;
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (form.elements.confirm.value === "yes") return;
      event.preventDefault();
      pending = form;
      document.getElementById("confirm-dialog-title").textContent = form.dataset.confirm;
      document.getElementById("confirm-dialog-text").textContent = form.dataset.confirmDetail || "";
      document.getElementById("confirm-dialog-ok").textContent = form.dataset.confirmLabel || "Confirm";
      dialog.returnValue = "";
      dialog.showModal();
    });
  }
  dialog.addEventListener("close", () => {
    if (dialog.returnValue === "confirm" && pending) {
      pending.elements.confirm.value = "yes";
      pending.submit();
    }
    pending = null;
  });
}

// -- adapter upload with a progress bar ------------------------------------------------------------

function setUpUpload() {
  const form = document.getElementById("upload-form");
  if (!form) return;
  const progress = document.getElementById("upload-progress");
  const bar = document.getElementById("upload-bar");
  const label = document.getElementById("upload-progress-label");
  const button = document.getElementById("upload-button");

  function showErrors(errors) {
    for (const slot of form.querySelectorAll("[data-error-for]")) {
      const message = errors[slot.dataset.errorFor] || "";
      slot.textContent = message;
      const field = form.elements[slot.dataset.errorFor];
      if (field) field.setAttribute("aria-invalid", message ? "true" : "false");
    }
    const first = Object.keys(errors)[0];
    if (first && form.elements[first]) form.elements[first].focus();
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    showErrors({});
    const request = new XMLHttpRequest();
    request.open("POST", form.action);
    request.setRequestHeader("Accept", "application/json");
    request.setRequestHeader("X-CSRF-Token", csrfToken());
    request.upload.addEventListener("progress", (e) => {
      if (!e.lengthComputable) return;
      const percent = Math.round((100 * e.loaded) / e.total);
      bar.value = percent;
      label.textContent = `Uploading… ${percent}%`;
    });
    request.upload.addEventListener("load", () => {
      bar.value = 100;
      bar.removeAttribute("value"); // indeterminate while the server checks the adapter
      label.textContent = "Validating against the base model…";
    });
    request.addEventListener("load", () => {
      let body = {};
      try {
        body = JSON.parse(request.responseText);
      } catch {
        body = {};
      }
      if (request.status === 201 && body.redirect) {
        label.textContent = "Ready.";
        window.location.assign(body.redirect);
        return;
      }
      progress.hidden = true;
      button.disabled = false;
      showErrors(body.errors || { files: body.detail || `The upload failed (HTTP ${request.status}).` });
    });
    request.addEventListener("error", () => {
      progress.hidden = true;
      button.disabled = false;
      showErrors({ files: "The connection broke off during the upload; try again." });
    });
    bar.value = 0;
    label.textContent = "Uploading… 0%";
    progress.hidden = false;
    button.disabled = true;
    request.send(new FormData(form));
  });
}

function setUpStatusPolling() {
  const section = document.querySelector("[data-poll-status]");
  if (!section) return;
  const poll = async () => {
    try {
      const response = await fetch(section.dataset.pollStatus, { headers: { Accept: "application/json" } });
      const statuses = await response.json();
      const inProgress = Object.values(statuses).some((s) => s === "uploaded" || s === "validating");
      if (!inProgress) {
        window.location.reload();
        return;
      }
    } catch {
      // try again on the next tick
    }
    setTimeout(poll, 2000);
  };
  setTimeout(poll, 2000);
}

// -- playground: chat with tokens streaming in -----------------------------------------------------

function setUpPlayground() {
  const form = document.getElementById("chat-form");
  if (!form) return;
  const log = document.getElementById("chat-log");
  const empty = document.getElementById("chat-empty");
  const input = document.getElementById("chat-message");
  const send = document.getElementById("chat-send");
  const stop = document.getElementById("chat-stop");
  const stats = document.getElementById("chat-stats");
  let history = JSON.parse(document.getElementById("chat-history").value || "[]");
  let controller = null;

  function bubble(role, text) {
    const item = document.createElement("li");
    item.className = `message message-${role}`;
    const who = document.createElement("span");
    who.className = "message-role";
    who.textContent = role === "user" ? "You" : role === "assistant" ? "Model" : "Error";
    const body = document.createElement("div");
    body.className = "message-text";
    body.textContent = text;
    item.append(who, body);
    log.append(item);
    empty.hidden = true;
    item.scrollIntoView({ block: "end" });
    return body;
  }

  function number(name, fallback) {
    const value = parseFloat(form.elements[name].value);
    return Number.isFinite(value) ? value : fallback;
  }

  async function errorOf(response) {
    try {
      const body = await response.json();
      return body.error?.message || (typeof body.detail === "string" ? body.detail : null) || `HTTP ${response.status}`;
    } catch {
      return `HTTP ${response.status}`;
    }
  }

  async function chat(text) {
    history.push({ role: "user", content: text });
    bubble("user", text);
    const system = form.elements.system.value.trim();
    const payload = {
      model: form.elements.model.value,
      messages: (system ? [{ role: "system", content: system }] : []).concat(history),
      temperature: number("temperature", 0.7),
      top_p: number("top_p", 1.0),
      max_tokens: Math.round(number("max_tokens", 256)),
    };
    const answer = bubble("assistant", "");
    answer.parentElement.classList.add("streaming");
    log.setAttribute("aria-busy", "true");
    controller = new AbortController();
    send.disabled = true;
    stop.hidden = false;
    stats.textContent = "";
    const started = performance.now();
    let content = "";
    let usage = null;
    try {
      const response = await fetch(form.dataset.streamUrl, {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", "X-CSRF-Token": csrfToken() },
        body: JSON.stringify(payload),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorOf(response));
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let pending = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        pending += decoder.decode(value, { stream: true });
        const lines = pending.split("\n");
        pending = lines.pop();
        for (const line of lines) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const event = JSON.parse(data);
          if (event.error) throw new Error(event.error.message || "the engine failed");
          if (event.usage) usage = event.usage;
          const delta = event.choices?.[0]?.delta?.content;
          if (delta) {
            content += delta;
            answer.textContent = content;
          }
        }
      }
      history.push({ role: "assistant", content });
      const seconds = (performance.now() - started) / 1000;
      stats.textContent = usage
        ? `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens in ${seconds.toFixed(1)} s`
        : `Answered in ${seconds.toFixed(1)} s`;
    } catch (error) {
      if (error.name === "AbortError") {
        history.push({ role: "assistant", content });
        stats.textContent = "Stopped.";
      } else {
        history.pop(); // the question was not answered: it can be sent again
        answer.parentElement.remove();
        bubble("error", error.message);
      }
    } finally {
      answer.parentElement?.classList.remove("streaming");
      log.setAttribute("aria-busy", "false");
      send.disabled = false;
      stop.hidden = true;
      controller = null;
      input.focus();
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || controller) return;
    input.value = "";
    chat(text);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  stop.addEventListener("click", () => controller?.abort());
  document.getElementById("chat-clear").addEventListener("click", () => {
    history = [];
    log.replaceChildren();
    empty.hidden = false;
    stats.textContent = "";
    input.focus();
  });
}

function setUpTrafficSliders() {
  // Each weight slider shows its value, and its share of the split, as it moves.
  const sliders = [...document.querySelectorAll("input[type=range][data-weight-output]")];
  function update() {
    const total = sliders.reduce((sum, s) => sum + Number(s.value), 0);
    for (const slider of sliders) {
      const output = document.getElementById(slider.dataset.weightOutput);
      const share = total ? Math.round((100 * Number(slider.value)) / total) : 0;
      if (output) output.textContent = `${slider.value} (${share}% of requests)`;
    }
  }
  for (const slider of sliders) slider.addEventListener("input", update);
  if (sliders.length) update();
}

document.addEventListener("DOMContentLoaded", () => {
  setUpTrafficSliders();
  setUpCopyButtons();
  setUpConfirmations();
  setUpUpload();
  setUpStatusPolling();
  setUpPlayground();
});

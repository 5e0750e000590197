// The chat page: streams each answer from /v1/chat/completions (SSE) and shows under it the
// tokens per second and the share of the cached context the KV policy read (the server's
// `flexgen.kv_read_share`). Plain browser JavaScript: no build step, nothing fetched from elsewhere.
"use strict";
const log = document.getElementById("log");
const form = document.getElementById("ask");
const question = document.getElementById("question");
const keyBox = document.getElementById("key");
const history = [];
let model = null;

function headers() {
  const h = {"Content-Type": "application/json"};
  if (keyBox.value) h["Authorization"] = "Bearer " + keyBox.value;
  return h;
}

function add(cls, text) {
  const div = document.createElement("div");
  div.className = cls;
  div.textContent = text;
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    const body = await r.json();
    model = body.data[0].id;
    document.getElementById("model").textContent = model;
  } catch (e) {
    setTimeout(loadModel, 1000);
  }
}

function facts(usage, info, seconds) {
  const parts = [];
  const n = usage ? usage.completion_tokens : 0;
  parts.push(n + " tokens");
  if (seconds > 0 && n > 1) parts.push(((n - 1) / seconds).toFixed(1) + " tokens/s");
  if (info && info.kv_read_share != null) {
    const policy = info.kv_policy ? " (" + info.kv_policy.kv_policy + ")" : "";
    parts.push("KV read: " + (100 * info.kv_read_share).toFixed(0) + "% of the context" + policy);
  }
  return parts.join(" · ");
}

async function ask(text) {
  history.push({role: "user", content: text});
  add("msg user", text);
  const answer = add("msg assistant", "");
  const under = add("facts", "…");
  const body = {model: model, messages: history, stream: true, stream_options: {include_usage: true}};
  const max = parseInt(document.getElementById("max").value, 10);
  if (max > 0) body.max_tokens = max;
  const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body)});
  if (!r.ok) {
    const err = await r.json().catch(() => ({error: {message: r.statusText}}));
    answer.classList.add("error");
    answer.textContent = r.status + ": " + err.error.message;
    under.textContent = "";
    history.pop();
    return;
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", first = null, usage = null, info = null;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) { answer.classList.add("error"); answer.textContent += "\n" + chunk.error.message; continue; }
      if (chunk.usage) { usage = chunk.usage; info = chunk.flexgen; }
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
      if (delta) {
        if (first === null) first = performance.now();
        answer.textContent += delta;
        log.scrollTop = log.scrollHeight;
      }
    }
  }
  history.push({role: "assistant", content: answer.textContent});
  under.textContent = facts(usage, info, first === null ? 0 : (performance.now() - first) / 1000);
  under.dataset.done = "1";
}

form.addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = question.value.trim();
  if (!text) return;
  question.value = "";
  document.getElementById("send").disabled = true;
  try { await ask(text); } finally { document.getElementById("send").disabled = false; }
});
question.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
});
loadModel();

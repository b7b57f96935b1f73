// plait's chat page: the OpenAI chat API of the server that serves this page, streamed.
// No build step and no third-party code: the conversation lives in this browser's localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "plait-chat";
const KEY_STORE = "plait-api-key";

const state = { messages: [], controller: null, model: "default" };

// ---- saved state ----------------------------------------------------------------------------------------
function save() {
  localStorage.setItem(STORE, JSON.stringify({
    messages: state.messages, system: $("system").value, temperature: $("temperature").value,
    maxTokens: $("max-tokens").value, schema: $("schema").value, speed: $("speed").textContent,
  }));
}

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    state.messages = Array.isArray(saved.messages) ? saved.messages : [];
    if (saved.system !== undefined) $("system").value = saved.system;
    if (saved.temperature !== undefined) $("temperature").value = saved.temperature;
    if (saved.maxTokens !== undefined) $("max-tokens").value = saved.maxTokens;
    if (saved.schema !== undefined) $("schema").value = saved.schema;
    if (saved.speed) $("speed").textContent = saved.speed;
  } catch (e) {
    state.messages = [];
  }
}

// ---- Markdown (escaped first: the model's text never becomes markup of its own) --------------------------
function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function inline(s) {
  const codes = [];
  s = escapeHtml(s).replace(/`([^`]+)`/g, (_, c) => { codes.push(c); return `\u0000${codes.length - 1}\u0000`; });
  s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
       .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
       .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[+i]}</code>`);
}

function blocks(text) {
  const out = [];
  let list = null;
  let para = [];
  const flush = () => {
    if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    para = [];
    if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  for (const line of text.split("\n")) {
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flush();
      out.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`);
    } else if (bullet || numbered) {
      const tag = bullet ? "ul" : "ol";
      if (para.length || (list && list.tag !== tag)) flush();
      list = list || { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
    } else if (!line.trim()) {
      flush();
    } else {
      if (list) flush();
      para.push(line);
    }
  }
  flush();
  return out.join("");
}

function markdown(src) {
  // fenced code: the odd parts of a split on ```; an unclosed fence (still streaming) is code to the end
  return src.split("```").map((part, i) => {
    if (i % 2 === 0) return blocks(part);
    const nl = part.indexOf("\n");
    const lang = nl >= 0 ? part.slice(0, nl).trim() : "";
    const code = nl >= 0 ? part.slice(nl + 1) : part;
    return `<pre><code data-lang="${escapeHtml(lang)}">${escapeHtml(code)}</code></pre>`;
  }).join("");
}

// ---- the conversation on screen ---------------------------------------------------------------------------
function bubble(message) {
  const div = document.createElement("div");
  div.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const body = document.createElement("div");
  body.className = "content";
  div.append(role, body);
  fill(div, message);
  $("messages").append(div);
  return div;
}

function fill(div, message) {
  const body = div.querySelector(".content");
  if (message.role === "user") body.textContent = message.content;
  else body.innerHTML = markdown(message.content);
  div.querySelector(".badge")?.remove();
  if (message.schemaCheck) {
    const badge = document.createElement("span");
    badge.className = `badge ${message.schemaCheck.ok ? "ok" : "bad"}`;
    badge.textContent = message.schemaCheck.ok ? "parses as JSON" : `does not parse: ${message.schemaCheck.why}`;
    div.append(badge);
  }
}

function redraw() {
  $("messages").replaceChildren();
  state.messages.forEach(bubble);
  $("messages").scrollTop = $("messages").scrollHeight;
  busy(state.controller !== null);
}

function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("regenerate").disabled = on || !state.messages.some((m) => m.role === "assistant");
}

// ---- the server -------------------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY_STORE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function explain(status, body) {
  const said = body && body.error ? (body.error.message || body.error) : "";
  if (status === 401) return "The API key was refused.";
  if (status === 429) return "The server is busy (its queue is full): try again in a moment.";
  if (status === 503) return `The server is shutting down or its runtime stopped. ${said}`;
  return `The server refused the request (${status}): ${said}`;
}

async function askForKey() {
  const dialog = $("key-dialog");
  $("key").value = "";
  dialog.showModal();
  await new Promise((resolve) => dialog.addEventListener("close", resolve, { once: true }));
  localStorage.setItem(KEY_STORE, $("key").value.trim());
}

async function connect() {
  if (document.body.dataset.needsKey && !localStorage.getItem(KEY_STORE)) await askForKey();
  for (;;) {
    let r;
    try {
      r = await fetch("/v1/models", { headers: headers() });
    } catch (e) {
      status("The server is gone: nothing answers at this address.", true);
      $("model").textContent = "offline";
      setTimeout(connect, 5000);
      return;
    }
    if (r.status === 401) {
      await askForKey();
      continue;
    }
    if (!r.ok) {
      status(explain(r.status, await r.json().catch(() => null)), true);
      return;
    }
    const model = (await r.json()).data[0];
    state.model = model.id;
    $("model").textContent = `${model.id} · context ${model.max_model_len} tokens`;
    status("");
    return;
  }
}

function schema() {
  const text = $("schema").value.trim();
  $("schema-error").hidden = true;
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (e) {
    $("schema-error").textContent = `The schema is not valid JSON: ${e.message}`;
    $("schema-error").hidden = false;
    throw e;
  }
}

async function reply() {
  let constraint;
  try {
    constraint = schema();
  } catch (e) {
    return;
  }
  const system = $("system").value.trim();
  const history = state.messages.map((m) => ({ role: m.role, content: m.content }));
  const body = {
    model: state.model, stream: true, stream_options: { include_usage: true },
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  if (constraint) body.response_format = { type: "json_schema", json_schema: { name: "reply", schema: constraint } };
  const message = { role: "assistant", content: "" };
  state.messages.push(message);
  const div = bubble(message);
  state.controller = new AbortController();
  busy(true);
  status("…");
  const started = performance.now();
  let firstAt = null;
  let tokens = 0;
  let finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!r.ok) throw new Error(explain(r.status, await r.json().catch(() => null)));
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(explain(chunk.error.code || 500, chunk));
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.delta && choice.delta.content) {
          firstAt = firstAt || performance.now();
          message.content += choice.delta.content;
          fill(div, message);
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        finish = choice.finish_reason || finish;
      }
    }
    const seconds = (performance.now() - (firstAt || started)) / 1000;
    if (tokens > 1 && seconds > 0) $("speed").textContent = `${(tokens / seconds).toFixed(1)} tokens/s`;
    status(finish === "length" ? "Stopped at the token limit." : "");
  } catch (e) {
    if (e.name === "AbortError") status("Stopped.");
    else if (e instanceof TypeError) status("The server is gone: the connection was lost.", true);
    else status(e.message, true);
  } finally {
    state.controller = null;
    if (constraint && message.content) {
      try {
        JSON.parse(message.content);
        message.schemaCheck = { ok: true };
      } catch (e) {
        message.schemaCheck = { ok: false, why: e.message };
      }
      fill(div, message);
    }
    if (!message.content) state.messages.pop();
    save();
    redraw();
  }
}

// ---- controls ---------------------------------------------------------------------------------------------
function send(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  bubble(state.messages[state.messages.length - 1]);
  save();
  reply();
}

function regenerate() {
  while (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") state.messages.pop();
  redraw();
  if (state.messages.length) reply();
}

document.addEventListener("DOMContentLoaded", () => {
  load();
  redraw();
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    save();
    redraw();
  });
  for (const id of ["system", "temperature", "max-tokens", "schema"]) $(id).addEventListener("change", save);
  connect();
});

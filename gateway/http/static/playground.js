// The stagemesh playground: a client of the gateway's public HTTP API, nothing more. It keeps the
// API key and control token only in the two password fields of this tab (never in storage, never
// in a URL), and lets the API validate every field, so the errors shown are the API's own.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const MAX_RESULTS = 24;
  // The request fields this form sends; each has an input (or group) whose id is the field's name.
  const FIELDS = ["prompt", "negative_prompt", "num_inference_steps", "guidance_scale", "seed", "n", "output_format"];
  // Fields sent as JSON numbers when they look like one; anything else goes as typed and the API names it.
  const NUMERIC = new Set(["num_inference_steps", "guidance_scale", "seed", "n", "strength"]);
  const JSON_NUMBER = /^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$/;

  const byId = (id) => document.getElementById(id);
  const page = {
    form: byId("generate-form"),
    generate: byId("generate-button"),
    cancel: byId("cancel-button"),
    apiKey: byId("api-key"),
    token: byId("control-token"),
    accessNeeded: byId("access-needed"),
    image: byId("image"),
    strength: byId("strength"),
    progressBar: byId("progress-bar"),
    progressText: byId("progress-text"),
    events: byId("events"),
    results: byId("result-list"),
    resultsEmpty: byId("results-empty"),
    stageRows: byId("stage-rows"),
    meshUpdated: byId("mesh-updated"),
    admission: byId("admission-state"),
    controlStatus: byId("control-status"),
  };
  let running = null; // the AbortController of the generation in flight
  let limitsApplied = false;
  let refreshing = false;

  // --- talking to the API ---------------------------------------------------------------------

  function authHeaders(plane) {
    // Data routes take the API key, or the control token as a bearer; control routes the token.
    const secret = plane === "control" ? page.token.value.trim() : page.apiKey.value.trim() || page.token.value.trim();
    return secret ? { authorization: `Bearer ${secret}` } : {};
  }

  async function apiError(response) {
    // The API answers OpenAI's error object; anything else (a proxy's page) is named by its status.
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      body = null;
    }
    const error = body && typeof body.error === "object" && body.error ? body.error : {};
    return {
      status: response.status,
      message: error.message || `HTTP ${response.status} ${response.statusText}`,
      type: error.type || null,
      param: error.param || null,
      code: error.code || null,
    };
  }

  function networkError(err) {
    return { status: 0, message: `the gateway did not answer: ${err.message}`, type: null, param: null, code: null };
  }

  // Seeds are uint64: past 2^53 a JavaScript number would round them. The gateway writes compact
  // JSON, and base64 has no quotes, so every `"seed":<digits>` is a seed; read it as text.
  function parseKeepingSeeds(text) {
    return JSON.parse(text.replace(/"seed":([0-9]+)/g, '"seed":"$1"'));
  }

  // --- errors ---------------------------------------------------------------------------------

  function showError(boxId, title, error) {
    const box = byId(boxId);
    box.querySelector(".error-title").textContent = title;
    box.querySelector(".error-message").textContent = error.message;
    const detail = [];
    if (error.param) detail.push(`field: ${error.param}`);
    if (error.status) detail.push(`HTTP ${error.status}`);
    if (error.code) detail.push(`code: ${error.code}`);
    if (error.type) detail.push(`type: ${error.type}`);
    box.querySelector(".error-detail").textContent = detail.join(" · ");
    box.hidden = false;
    if (error.status === 401) askForSecret(boxId === "control-error" ? "control" : "data");
  }

  function hideError(boxId) {
    byId(boxId).hidden = true;
  }

  function askForSecret(plane) {
    const input = plane === "control" ? page.token : page.apiKey;
    const name = plane === "control" ? "control token" : "API key (or the control token)";
    page.accessNeeded.textContent = `This gateway needs the ${name}: enter it under Access.`;
    page.accessNeeded.hidden = false;
    input.setAttribute("aria-invalid", "true");
  }

  function clearFieldErrors() {
    for (const element of document.querySelectorAll("[aria-invalid]")) element.removeAttribute("aria-invalid");
    for (const element of document.querySelectorAll(".field-error")) {
      element.hidden = true;
      element.textContent = "";
    }
  }

  function markField(error) {
    // `param` is the request field at fault; its input carries the same name (size: both sides).
    if (!error.param) return;
    const inputs = error.param === "size" ? [byId("width"), byId("height")] : [byId(error.param)];
    const where = byId(`${error.param}-error`);
    if (where) {
      where.textContent = error.message;
      where.hidden = false;
    }
    const first = inputs.find((input) => input && !input.disabled);
    for (const input of inputs) if (input) input.setAttribute("aria-invalid", "true");
    if (first) first.focus();
  }

  // --- generating -----------------------------------------------------------------------------

  function requestFields() {
    const fields = {};
    for (const name of FIELDS) {
      const input = byId(name);
      if (!input || input.closest("[hidden]")) continue;
      const value = input.value.trim();
      if (value !== "" || name === "prompt") fields[name] = value;
    }
    const width = byId("width").value.trim();
    const height = byId("height").value.trim();
    if (width || height) fields.size = `${width}x${height}`;
    if (page.image.files.length) fields.strength = page.strength.value.trim();
    return fields;
  }

  function jsonBody(fields) {
    // Built by hand so that a number goes out exactly as typed (a seed keeps all its digits).
    const parts = Object.entries(fields).map(([name, value]) => {
      const literal = NUMERIC.has(name) && JSON_NUMBER.test(value) ? value : JSON.stringify(value);
      return `${JSON.stringify(name)}:${literal}`;
    });
    parts.push('"stream":true');
    return `{${parts.join(",")}}`;
  }

  function buildRequest(fields) {
    if (page.image.files.length) {
      const form = new FormData();
      for (const [name, value] of Object.entries(fields)) form.append(name, value);
      form.append("stream", "true");
      form.append("image", page.image.files[0]);
      return { url: "/v1/images/edits", init: { body: form, headers: authHeaders("data") } };
    }
    const headers = { ...authHeaders("data"), "content-type": "application/json" };
    return { url: "/v1/images/generations", init: { body: jsonBody(fields), headers } };
  }

  async function generate(event) {
    event.preventDefault();
    if (running) return;
    clearFieldErrors();
    hideError("request-error");
    const fields = requestFields();
    const { url, init } = buildRequest(fields);
    const images = Number.parseInt(fields.n || "1", 10) || 1;
    const progress = new Progress(images);
    running = new AbortController();
    setBusy(true);
    progress.note(`Sent to ${url}.`);
    try {
      const response = await fetch(url, { method: "POST", cache: "no-store", signal: running.signal, ...init });
      if (!response.ok) {
        const error = await apiError(response);
        progress.done(`Refused: HTTP ${response.status}.`);
        showError("request-error", "The request was refused", error);
        markField(error);
        return;
      }
      await readEvents(response, (data) => onEvent(data, progress));
      progress.finish();
    } catch (err) {
      if (err.name === "AbortError") {
        progress.done("Cancelled: the gateway stopped the work in every stage.");
      } else {
        progress.done("The connection failed.");
        showError("request-error", "The request failed", networkError(err));
      }
    } finally {
      running = null;
      setBusy(false);
      refreshMesh();
    }
  }

  async function readEvents(response, onData) {
    // Server-sent events: blocks separated by a blank line, each with `event:` and `data:` lines.
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      let end = buffer.indexOf("\n\n");
      while (end >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) onData(parseKeepingSeeds(data));
        end = buffer.indexOf("\n\n");
      }
    }
  }

  function onEvent(data, progress) {
    const type = String(data.type || "");
    if (type.endsWith(".stage_started")) {
      progress.note(`Stage ${data.stage_id} (${data.kind}) started.`);
    } else if (type.endsWith(".progress")) {
      progress.step(data.index || 0, data.step, data.total, data.stage_id);
    } else if (type.endsWith(".completed")) {
      progress.completed(data.index || 0);
      addResult(data, progress.shown);
    } else if (type === "error") {
      const error = { status: 0, ...data.error };
      progress.done("The request failed.");
      showError("request-error", "The request failed while running", error);
      markField(error);
    }
  }

  class Progress {
    constructor(images) {
      this.images = images;
      this.fractions = new Array(images).fill(0);
      this.stepLines = new Map();
      this.shown = []; // this request's result items, in index order
      page.events.replaceChildren();
      page.progressBar.value = 0;
      page.progressText.textContent = "Waiting for the gateway…";
    }

    note(text) {
      const item = document.createElement("li");
      item.textContent = text;
      page.events.append(item);
      page.progressText.textContent = text;
    }

    step(index, step, total, stageId) {
      // One line per image, updated in place: step k of N.
      const image = this.images > 1 ? `image ${index + 1} of ${this.images}, ` : "";
      const text = `Stage ${stageId}: ${image}denoising step ${step} of ${total}`;
      let line = this.stepLines.get(index);
      if (!line) {
        line = document.createElement("li");
        this.stepLines.set(index, line);
        page.events.append(line);
      }
      line.textContent = text;
      this.fractions[index] = total ? step / total : 0;
      this.update(text);
    }

    completed(index) {
      this.fractions[index] = 1;
      const done = this.fractions.filter((f) => f === 1).length;
      this.note(`Image ${index + 1} of ${this.images} ready.`);
      this.update(`${done} of ${this.images} image${this.images > 1 ? "s" : ""} ready.`);
    }

    update(text) {
      page.progressBar.value = this.fractions.reduce((a, b) => a + b, 0) / this.images;
      page.progressText.textContent = text;
    }

    finish() {
      if (this.fractions.every((f) => f === 1)) this.done("Done.");
    }

    done(text) {
      const item = document.createElement("li");
      item.textContent = text;
      page.events.append(item);
      page.progressText.textContent = text;
    }
  }

  function decodeBase64(text) {
    const raw = atob(text);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i += 1) bytes[i] = raw.charCodeAt(i);
    return bytes;
  }

  function addResult(data, shown) {
    const format = data.output_format || "png";
    const blob = new Blob([decodeBase64(data.b64_json)], { type: `image/${format}` });
    const url = URL.createObjectURL(blob);
    const item = document.createElement("li");
    const figure = document.createElement("figure");
    const img = document.createElement("img");
    img.src = url;
    img.alt = `Generated image, seed ${data.seed}, ${data.size}`;
    img.dataset.seed = data.seed;
    img.dataset.size = data.size;
    const caption = document.createElement("figcaption");
    const link = document.createElement("a");
    link.href = url;
    link.download = `stagemesh-${data.seed}.${format === "jpeg" ? "jpg" : format}`;
    link.textContent = "Download";
    link.setAttribute("aria-label", `Download the image with seed ${data.seed}`);
    caption.append(`Seed ${data.seed} · ${data.size} · ${format.toUpperCase()} · `, link);
    figure.append(img, caption);
    item.append(figure);
    // The newest request first; its images by index, whichever order they finish in.
    const index = data.index || 0;
    const after = shown.find((other) => other.index > index);
    if (after) after.item.before(item);
    else if (shown.length) shown[shown.length - 1].item.after(item);
    else page.results.prepend(item);
    shown.push({ index, item });
    shown.sort((a, b) => a.index - b.index);
    page.resultsEmpty.hidden = true;
    while (page.results.children.length > MAX_RESULTS) {
      const old = page.results.lastElementChild;
      URL.revokeObjectURL(old.querySelector("img").src);
      old.remove();
    }
  }

  function setBusy(busy) {
    page.generate.disabled = busy;
    page.cancel.disabled = !busy;
    page.form.setAttribute("aria-busy", String(busy));
  }

  // --- the mesh -------------------------------------------------------------------------------

  const COLUMNS = [
    ["stage", "Stage"],
    ["kind", "Kind"],
    ["state", "State"],
    ["replicas", "Replicas"],
    ["workers", "Workers"],
    ["device", "Device"],
    ["memory", "Device memory"],
    ["sleep", "Sleep level"],
    ["queue", "Queue"],
    ["batch", "Batch size (max / mean)"],
    ["actions", "Sleep and wake"],
  ];
  const rows = new Map(); // stage_id -> {row, cells}

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = Number(n) || 0;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
  }

  function stageRow(stageId) {
    // Rows are made once and updated in place, so a refresh never takes the keyboard focus away.
    if (rows.has(stageId)) return rows.get(stageId);
    const row = document.createElement("tr");
    row.id = `stage-${stageId}`;
    const cells = {};
    for (const [key, label] of COLUMNS) {
      const cell = document.createElement(key === "stage" ? "th" : "td");
      if (key === "stage") cell.scope = "row";
      cell.dataset.label = label;
      if (["replicas", "workers", "memory", "sleep", "queue", "batch"].includes(key)) cell.className = "number";
      cells[key] = cell;
      row.append(cell);
    }
    const actions = document.createElement("div");
    actions.className = "stage-actions";
    const level = document.createElement("select");
    level.id = `sleep-level-${stageId}`;
    for (const [value, text, meaning] of [
      ["1", "level 1", "weights to host memory: a fast wake"],
      ["2", "level 2", "weights discarded: reloaded on wake"],
    ]) {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = text;
      option.title = meaning;
      level.append(option);
    }
    level.value = "1";
    const levelLabel = document.createElement("label");
    levelLabel.htmlFor = level.id;
    levelLabel.className = "visually-hidden";
    levelLabel.textContent = `Sleep level for stage ${stageId}`;
    const sleep = document.createElement("button");
    sleep.type = "button";
    sleep.textContent = "Sleep";
    sleep.setAttribute("aria-label", `Sleep stage ${stageId}`);
    sleep.addEventListener("click", () =>
      control("/v1/omni/sleep", { stage_ids: [stageId], level: Number(level.value) }, `Sleep stage ${stageId}`),
    );
    const wake = document.createElement("button");
    wake.type = "button";
    wake.textContent = "Wake";
    wake.setAttribute("aria-label", `Wake stage ${stageId}`);
    wake.addEventListener("click", () => control("/v1/omni/wakeup", { stage_ids: [stageId] }, `Wake stage ${stageId}`));
    actions.append(levelLabel, level, sleep, wake);
    cells.actions.append(actions);
    const entry = { row, cells, level, sleep, wake };
    rows.set(stageId, entry);
    page.stageRows.append(row);
    return entry;
  }

  function renderStages(body) {
    page.admission.textContent = body.generation_paused ? "paused" : "open";
    for (const stage of body.stages) {
      const { cells, level, sleep, wake } = stageRow(stage.stage_id);
      cells.stage.textContent = String(stage.stage_id);
      cells.kind.textContent = stage.kind || "—";
      cells.state.textContent = stage.state;
      cells.state.className = `state-${stage.state}`;
      cells.replicas.textContent = String(stage.replicas);
      cells.workers.textContent = String(stage.workers);
      cells.device.textContent = stage.device || "—";
      cells.memory.textContent = bytes(stage.device_memory_bytes);
      cells.sleep.textContent = stage.sleep_level ? `asleep, level ${stage.sleep_level}` : "awake";
      cells.queue.textContent = String(stage.queue_depth);
      const mean = stage.mean_batch_size ? stage.mean_batch_size.toFixed(2) : "—";
      cells.batch.textContent = `${stage.max_batch_size || "—"} / ${mean}`;
      const canSleep = stage.supports_sleep;
      level.disabled = !canSleep;
      sleep.disabled = !canSleep;
      sleep.title = canSleep ? "" : "This stage runs without sleep support";
      wake.disabled = !stage.sleep_level;
    }
    page.meshUpdated.textContent = `Updated ${new Date().toLocaleTimeString()}; refreshed every ${REFRESH_MS / 1000} s.`;
  }

  function applyLimits(limits) {
    // The pipeline's defaults and bounds, as GET /v1/omni/stages reports them.
    limitsApplied = true;
    byId("negative-prompt-field").hidden = !limits.supports_negative_prompt;
    byId("edit-fields").hidden = !limits.supports_init_image;
    for (const [id, value] of [
      ["width", limits.default_size],
      ["height", limits.default_size],
      ["num_inference_steps", limits.default_inference_steps],
      ["guidance_scale", limits.default_guidance_scale],
    ]) {
      const input = byId(id);
      if (input.value === "") input.value = String(value);
    }
    byId("size-hint").textContent =
      `Multiples of ${limits.pixel_multiple}, up to ${limits.max_pixels_side}; default ${limits.default_size}.`;
    byId("num_inference_steps-hint").textContent = `1 to ${limits.max_inference_steps}.`;
    byId("guidance_scale-hint").textContent = `1.0 (none) to ${limits.max_guidance_scale}.`;
    byId("n-hint").textContent = `1 to ${limits.max_num_images}.`;
  }

  async function refreshMesh() {
    if (refreshing || document.hidden) return;
    refreshing = true;
    try {
      const response = await fetch("/v1/omni/stages", { headers: authHeaders("data"), cache: "no-store" });
      if (!response.ok) {
        showError("mesh-error", "The mesh's state could not be read", await apiError(response));
        page.meshUpdated.textContent = "Not updated.";
        return;
      }
      hideError("mesh-error");
      const body = await response.json();
      if (!limitsApplied) applyLimits(body.limits);
      renderStages(body);
    } catch (err) {
      showError("mesh-error", "The mesh's state could not be read", networkError(err));
    } finally {
      refreshing = false;
    }
  }

  function describeAcks(acks) {
    return acks
      .map((ack) => {
        const what =
          ack.status === "SUCCESS" ? `${bytes(ack.freed_bytes)} freed, ${Math.round(ack.latency_ms)} ms` : ack.error;
        return `stage ${ack.stage_id} rank ${ack.rank}: ${ack.status} (${what})`;
      })
      .join("; ");
  }

  async function control(path, body, label) {
    hideError("control-error");
    page.controlStatus.hidden = true;
    try {
      const init = { method: "POST", cache: "no-store", headers: authHeaders("control") };
      if (body) {
        init.headers = { ...init.headers, "content-type": "application/json" };
        init.body = JSON.stringify(body);
      }
      const response = await fetch(path, init);
      if (!response.ok) {
        showError("control-error", `${label}: refused`, await apiError(response));
        return;
      }
      const answer = await response.json();
      const parts = [`${label}: ${answer.status}`];
      if (answer.reason) parts.push(answer.reason);
      if (answer.acks && answer.acks.length) parts.push(describeAcks(answer.acks));
      if ("generation_paused" in answer) parts.push(answer.generation_paused ? "generation paused" : "generation open");
      page.controlStatus.textContent = parts.join(" — ");
      page.controlStatus.hidden = false;
    } catch (err) {
      showError("control-error", `${label}: failed`, networkError(err));
    } finally {
      refreshMesh();
    }
  }

  // --- wiring ---------------------------------------------------------------------------------

  page.form.addEventListener("submit", generate);
  // Enter in a text area starts a new line; Ctrl+Enter (or Cmd+Enter) sends the form from there too.
  for (const area of page.form.querySelectorAll("textarea")) {
    area.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        page.form.requestSubmit();
      }
    });
  }
  page.cancel.addEventListener("click", () => running && running.abort());
  page.image.addEventListener("change", () => {
    const chosen = page.image.files.length > 0;
    page.strength.disabled = !chosen;
    // An edit's size is the starting image's unless set to exactly that: leave it to the image.
    if (chosen) {
      byId("width").value = "";
      byId("height").value = "";
    }
    byId("width").placeholder = chosen ? "the image's" : "";
    byId("height").placeholder = chosen ? "the image's" : "";
  });
  byId("access-form").addEventListener("submit", (event) => {
    event.preventDefault(); // Enter in a secret's field: use it now; nothing is sent anywhere else
    refreshMesh();
  });
  for (const input of [page.apiKey, page.token]) {
    input.addEventListener("change", () => {
      input.removeAttribute("aria-invalid");
      page.accessNeeded.hidden = true;
      refreshMesh();
    });
  }
  byId("pause-button").addEventListener("click", () => control("/v1/omni/pause", null, "Pause generation"));
  byId("resume-button").addEventListener("click", () => control("/v1/omni/resume", null, "Resume generation"));
  document.addEventListener("visibilitychange", refreshMesh);
  setInterval(refreshMesh, REFRESH_MS);
  refreshMesh();
})();

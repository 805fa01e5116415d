/* The playground page (docs/playground.md): a chat with streamed answers and a live slot
   view, and a race of AR against ReFusion, over the server's own OpenAI-style API. The
   settings form is made from /playground/settings (DecodeConfig's field metadata); each
   request streams its slot events (stream_options.include_slots), drawn by slots.js. */
(function () {
  'use strict';

  const $ = (id) => document.getElementById(id);
  const state = { key: null, settings: null, history: [], abort: null };

  // ------------------------------------------------------------------ errors and the key
  function showError(message) {
    const box = $('error');
    box.textContent = message;
    box.hidden = false;
  }

  function clearError() {
    $('error').hidden = true;
    $('error').textContent = '';
    document.querySelectorAll('.field.invalid').forEach((el) => el.classList.remove('invalid'));
  }

  function headers() {
    const h = { 'Content-Type': 'application/json' };
    if (state.key) h.Authorization = 'Bearer ' + state.key;
    return h;
  }

  /* An error response as one line for the page: the server's message, and its field
     marked in the form. */
  async function responseError(resp) {
    let message = 'the server answered ' + resp.status;
    try {
      const body = await resp.json();
      if (body && body.error) {
        message = body.error.message;
        markField(body.error.param);
      }
    } catch (e) { /* not JSON: the status says it */ }
    if (resp.status === 401) askKey();
    return new Error(message);
  }

  function markField(param) {
    const el = param && document.querySelector('.field[data-name="' + param.split('.')[0] + '"]');
    if (el) el.classList.add('invalid');
  }

  function askKey() {
    $('key-box').hidden = false;
    $('key').focus();
  }

  // ------------------------------------------------------------------ the settings form
  async function loadSettings() {
    const resp = await fetch('/playground/settings', { headers: headers() });
    if (!resp.ok) throw await responseError(resp);
    state.settings = await resp.json();
    const s = state.settings;
    $('model').textContent = 'model: ' + s.model;
    showMarkup($('about'), s.about || '');
    // the widths in force, in the server's words (its startup line says the same)
    $('widths').textContent = 'Draft widths: ' + s.draft_widths.in_force + '.' +
      (s.draft_widths.adaptive ? ' ' + s.draft_widths.help + '.' : '');
    buildForm(s.fields, s.defaults);
    buildPresets(s.presets);
    buildExamples($('examples'), s.examples, (p) => { $('prompt').value = p; $('prompt').focus(); });
    buildExamples($('race-examples'), s.examples, (p) => { $('race-prompt').value = p; });
    $('key-box').hidden = true;
  }

  /* Text with `code` spans (the checkpoint's own words): each piece set as text, never as
     markup, the spans in <code>. */
  function showMarkup(el, text) {
    el.replaceChildren(...text.split('`').map((piece, i) => {
      if (i % 2 === 0) return document.createTextNode(piece);
      const code = document.createElement('code');
      code.textContent = piece;
      return code;
    }));
  }

  function buildForm(fields, defaults) {
    const form = $('fields');
    form.replaceChildren();
    for (const f of fields) {
      const row = document.createElement('div');
      row.className = 'field';
      row.dataset.name = f.name;
      row.dataset.kind = f.kind;
      const label = document.createElement('label');
      label.textContent = f.name;
      let input;
      if (f.choices) {
        input = document.createElement('select');
        for (const c of f.choices) input.add(new Option(c, c));
      } else if (f.kind === 'bool') {
        input = document.createElement('input');
        input.type = 'checkbox';
      } else {
        input = document.createElement('input');
        input.type = 'text';
        input.inputMode = f.kind === 'tuple' ? 'text' : 'decimal';
        input.placeholder = f.optional ? 'default' : '';
      }
      input.name = f.name;
      input.title = f.help;
      label.appendChild(input);
      row.appendChild(label);
      if (/beyond the paper/.test(f.help)) {
        const b = document.createElement('span');
        b.className = 'badge';
        b.textContent = 'beyond the paper';
        row.appendChild(b);
      }
      const help = document.createElement('span');
      help.className = 'help';
      help.textContent = f.help + (f.bounds ? ' ' + f.bounds : '');
      row.appendChild(help);
      form.appendChild(row);
    }
    setValues(defaults);
  }

  function setValues(values) {
    for (const [name, v] of Object.entries(values)) {
      const input = $('fields').elements.namedItem(name);
      if (!input) continue;
      if (input.type === 'checkbox') input.checked = Boolean(v);
      else input.value = v === null || v === undefined ? '' : Array.isArray(v) ? v.join(', ') : String(v);
    }
  }

  function buildPresets(presets) {
    const sel = $('preset');
    sel.replaceChildren();
    for (const name of Object.keys(presets)) sel.add(new Option(name, name));
    sel.onchange = () => setValues(presets[sel.value]);
  }

  function buildExamples(box, examples, use) {
    box.replaceChildren();
    for (const [label, prompt] of Object.entries(examples || {})) {
      const b = document.createElement('button');
      b.type = 'button';
      b.className = 'example';
      b.textContent = label;
      b.title = prompt;
      b.onclick = () => use(prompt);
      box.appendChild(b);
    }
  }

  /* The form's values as request fields. A field left empty is not sent (the server's
     value holds); a number field keeps what was typed when it is not a number, so that
     the server's check names the field and says what it takes. */
  function readSettings() {
    const out = {};
    for (const row of $('fields').querySelectorAll('.field')) {
      const input = row.querySelector('input, select');
      const kind = row.dataset.kind;
      if (input.type === 'checkbox') { out[input.name] = input.checked; continue; }
      const raw = input.value.trim();
      if (raw === '') continue;
      if (kind === 'str') out[input.name] = raw;
      else if (kind === 'tuple') out[input.name] = raw.split(/[\s,]+/).filter(Boolean).map(number);
      else out[input.name] = number(raw);
    }
    return out;
  }

  /* A typed number as JSON sends it: an integer past 2^53 (a seed) goes as its digits, as
     a JavaScript number would round it. */
  function number(raw) {
    const n = Number(raw);
    if (/^-?\d+$/.test(raw) && !Number.isSafeInteger(n) && JSON.rawJSON) return JSON.rawJSON(raw);
    return raw !== '' && Number.isFinite(n) ? n : raw;
  }

  function regionLength(s) {
    const unit = s.method === 'refusion' ? s.slot_size * s.serial_blocks
      : s.method === 'mdm' ? s.mdm_block_length : 1;
    const n = Number(s.max_tokens) || state.settings.defaults.max_tokens;
    return Number.isFinite(unit) && unit > 0 ? Math.ceil(n / unit) * unit : n;
  }

  // ------------------------------------------------------------------ one streamed request
  /* Stream a chat completion with slot events into `lane` ({view, stats, text}); resolves
     with the final text and counts. */
  async function run(messages, settings, lane, signal) {
    const body = Object.assign({}, settings, {
      messages: messages,
      stream: true,
      stream_options: { include_slots: true },
    });
    if ($('json-mode').checked) body.response_format = { type: 'json_object' };
    const slotSize = settings.method === 'refusion' ? settings.slot_size : 1;
    lane.view.reset(regionLength(settings), slotSize);
    lane.widths.textContent = '';
    const live = { text: '', nfe: 0, elapsed: 0, final: null, started: performance.now() };
    const resp = await fetch('/v1/chat/completions', {
      method: 'POST', headers: headers(), body: JSON.stringify(body), signal: signal,
    });
    if (!resp.ok) throw await responseError(resp);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data: ')) continue;
          const data = line.slice(6);
          if (data === '[DONE]') continue;
          take(JSON.parse(data), lane, live);
        }
      }
    }
    lane.view.settle();
    lane.widths.textContent = widthsText(live.final, settings);
    return live;
  }

  function take(chunk, lane, live) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.slots) {
      lane.view.add(chunk.slots.events);
      lane.frames.push({ t: chunk.slots.elapsed, events: chunk.slots.events });
      live.nfe = chunk.slots.nfe;
      live.elapsed = chunk.slots.elapsed;
      if (chunk.slots.stats) live.final = chunk.slots.stats;
    }
    for (const c of chunk.choices || []) {
      const piece = c.delta && c.delta.content;
      if (piece) {
        live.text += piece;
        lane.onText(live.text);
      }
    }
    lane.stats.textContent = statsText(lane.view, live);
    lane.step.textContent = Replay.stepLine(lane.view);
  }

  function statsText(view, live) {
    const f = live.final;
    const tokens = f ? f.tokens : view.committed;
    const nfe = f ? f.nfe : live.nfe;
    const secs = f ? f.wall_time : live.elapsed;
    const tps = secs > 0 ? tokens / secs : 0;
    return 'steps ' + (view.step + 1) + ' \u00b7 NFE ' + nfe + ' (forward passes) \u00b7 TPF ' +
      (nfe ? (tokens / nfe).toFixed(2) : '0') + ' \u00b7 ' + tps.toFixed(1) + ' tokens/s \u00b7 ' +
      tokens + ' tokens' + (f ? ' \u00b7 done' : '');
  }

  /* The draft widths a finished ReFusion request drafted at, as the server counted them. */
  function widthsText(f, settings) {
    if (!f) return '';
    const method = settings.method || state.settings.defaults.method;
    if (method !== 'refusion') return 'no drafts: ' + method.toUpperCase() + ' decodes without them';
    const ar = f.ar_blocks ? ' \u00b7 ' + f.ar_blocks + ' block(s) decoded as AR' : '';
    const mean = f.plan_width === null ? 'no drafting steps'
      : 'mean plan width ' + f.plan_width.toFixed(1) + ' (slot_size ' + (settings.slot_size || '?') +
        '), mean infilling window ' + f.infill_window.toFixed(1);
    return 'draft widths: ' + (f.adaptive_widths
      ? 'adaptive (chosen each block from the speed the engine measures): '
      : 'fixed by these settings (the output could depend on them): ') + mean + ar;
  }

  // ------------------------------------------------------------------ chat
  const chatView = new SlotView($('chat-view'), 0, 1);
  const chatLane = {
    view: chatView, stats: $('chat-stats'), step: $('chat-step'), widths: $('chat-widths'), frames: [], onText: null,
  };
  const chatReplay = new Replay($('chat-replay'), [chatLane]);

  function addMessage(role, text) {
    const el = document.createElement('div');
    el.className = 'msg ' + role;
    el.textContent = text;
    $('messages').appendChild(el);
    return el;
  }

  async function send(ev) {
    ev.preventDefault();
    const prompt = $('prompt').value.trim();
    if (!prompt || state.abort) return;
    clearError();
    const settings = readSettings();
    state.history.push({ role: 'user', content: prompt });
    addMessage('user', prompt);
    $('prompt').value = '';
    const answer = addMessage('assistant', '');
    // a single-turn model answers each message on its own
    const messages = state.settings.single_turn ? state.history.slice(-1) : state.history.slice();
    chatLane.onText = (t) => { answer.textContent = t; };
    chatReplay.clear();
    busy(true);
    try {
      const live = await run(messages, settings, chatLane, state.abort.signal);
      state.history.push({ role: 'assistant', content: live.text });
      chatReplay.finished();
      document.body.dataset.chat = 'done';
    } catch (e) {
      state.history.pop();
      answer.remove();
      document.body.dataset.chat = 'error';
      if (e.name !== 'AbortError') showError(e.message);
    } finally {
      busy(false);
    }
  }

  function busy(on) {
    state.abort = on ? new AbortController() : null;
    $('send').disabled = on;
    $('stop').disabled = !on;
    if (on) document.body.dataset.chat = 'running';
  }

  // ------------------------------------------------------------------ race
  function lane(id) {
    const box = $(id);
    const text = box.querySelector('.text');
    return {
      view: new SlotView(box.querySelector('.view'), 0, 1),
      stats: box.querySelector('.stats'),
      step: box.querySelector('.step'),
      widths: box.querySelector('.widths'),
      frames: [],
      text: text,
      onText: (t) => { text.textContent = t; },
    };
  }
  const lanes = { ar: lane('lane-ar'), refusion: lane('lane-refusion') };
  const raceReplay = new Replay($('race-replay'), [lanes.ar, lanes.refusion]);

  async function race(ev) {
    ev.preventDefault();
    const prompt = $('race-prompt').value.trim();
    if (!prompt) return;
    clearError();
    document.body.dataset.race = 'running';
    $('race-verdict').textContent = '';
    const settings = readSettings();
    const messages = [{ role: 'user', content: prompt }];
    for (const l of Object.values(lanes)) { l.text.textContent = ''; l.stats.textContent = ''; }
    raceReplay.clear();
    try {
      const [ar, rf] = await Promise.all([
        run(messages, Object.assign({}, settings, { method: 'ar' }), lanes.ar),
        run(messages, Object.assign({}, settings, { method: 'refusion' }), lanes.refusion),
      ]);
      $('race-verdict').textContent = verdict(ar, rf);
      raceReplay.finished();
      document.body.dataset.race = 'done';
    } catch (e) {
      document.body.dataset.race = 'error';
      showError(e.message);
    }
  }

  function verdict(ar, rf) {
    const a = ar.final, r = rf.final;
    const sampled = r && r.temperature > 0;
    const same = ar.text === rf.text ? 'the same text'
      : r && r.lossless === 'any temperature' && sampled
        ? 'different draws of one distribution (lossless at any temperature: speculative sampling)'
        : 'different texts (these settings are not lossless' + (r && r.lossless ? ' when sampled' : '') + ')';
    if (!a || !r) return same;
    const speed = a.tps > 0 ? (r.tps / a.tps).toFixed(2) + 'x the tokens/s of AR' : '';
    return 'Both wrote ' + same + '; ReFusion: NFE ' + r.nfe + ' against ' + a.nfe + ', ' + speed + '.';
  }

  // ------------------------------------------------------------------ wiring
  function tab(name) {
    $('chat-pane').hidden = name !== 'chat';
    $('race-pane').hidden = name !== 'race';
    $('tab-chat').classList.toggle('active', name === 'chat');
    $('tab-race').classList.toggle('active', name === 'race');
  }

  async function start() {
    try {
      await loadSettings();
    } catch (e) {
      if ($('key-box').hidden || state.key) showError(e.message);  // not the first ask: say why
    }
  }

  // a phone's narrow screen opens on the chat, the settings folded above it
  if (window.matchMedia('(max-width: 900px)').matches) $('settings-box').open = false;
  $('legend').appendChild(SlotView.legend());
  $('chat-form').onsubmit = send;
  $('race-form').onsubmit = race;
  $('prompt').onkeydown = (e) => { if (e.key === 'Enter' && e.ctrlKey) send(e); };
  $('stop').onclick = () => state.abort && state.abort.abort();
  $('clear').onclick = () => {
    state.history = [];
    $('messages').replaceChildren();
    chatView.reset(0, 1);
    chatReplay.clear();
  };
  $('tab-chat').onclick = () => tab('chat');
  $('tab-race').onclick = () => tab('race');
  $('key-use').onclick = () => { state.key = $('key').value.trim() || null; $('key').value = ''; clearError(); start(); };
  $('key').onkeydown = (e) => { if (e.key === 'Enter') $('key-use').click(); };
  start();
})();

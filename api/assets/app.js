// paceline's dashboard: plain JS over the API (README, "The dashboard"), no build step.
//
// Pages are hash routes (#/runs, #/run/<id>, #/budget, #/fleet). Only the page on
// screen polls, and nothing polls while the tab is hidden: one open page costs the
// API about one list (or run) read and, on the budget page, one pacer read a
// second or two. The token lives in sessionStorage and goes out only as an
// Authorization header (never in a URL, so EventSource is not used: the run's
// event stream is read with fetch and a streaming reader). Every value from the
// API is written with textContent, never as HTML.
(function () {
  'use strict';

  const TOKEN_KEY = 'paceline.token';
  const POLL_MS = 1500;
  const BUDGET_MS = 2000;
  const HISTORY_MS = 5000;
  const STATUS_MARK = {
    queued: '○ queued', running: '▶ running', waiting: '‖ waiting', completed: '✓ completed',
    failed: '✗ failed', cancelled: '⊘ cancelled',
  };
  const FINISHED = new Set(['completed', 'failed', 'cancelled']);

  const $ = (sel) => document.querySelector(sel);
  const el = (tag, attrs, ...kids) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const k of kids) if (k !== null && k !== undefined) e.append(k);
    return e;
  };
  const num = (n) => (n === null || n === undefined ? '—' : Number(n).toLocaleString('en-US'));
  const when = (s) => (s ? new Date(s).toLocaleTimeString() : '—');

  // ---- the API -------------------------------------------------------------

  class Unauthorized extends Error {}
  class Forbidden extends Error {}

  function token() { return sessionStorage.getItem(TOKEN_KEY) || ''; }

  function headers() {
    const h = { accept: 'application/json' };
    if (token()) h.authorization = 'Bearer ' + token();
    return h;
  }

  async function api(path, opts) {
    const res = await fetch(path, Object.assign({ headers: headers(), cache: 'no-store' }, opts || {}));
    if (res.status === 401) throw new Unauthorized('the API wants a token');
    const body = await res.json().catch(() => null);
    if (res.status === 403) throw new Forbidden((body && body.error && body.error.message) || 'forbidden');
    if (!res.ok) {
      const msg = (body && body.error && body.error.message) || res.statusText;
      const e = new Error(res.status + ': ' + msg);
      e.status = res.status;
      throw e;
    }
    return body;
  }

  // ---- the token -------------------------------------------------------------

  function askToken(message) {
    stopPage();
    $('#login').hidden = false;
    $('#main').hidden = true;
    $('#login-error').textContent = message || '';
    $('#token-input').value = '';
    $('#token-input').focus();
  }

  $('#token-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const t = $('#token-input').value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    else sessionStorage.removeItem(TOKEN_KEY);
    $('#login').hidden = true;
    $('#main').hidden = false;
    showWho();
    route();
  });
  $('#token-clear').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showWho();
    askToken('Token forgotten.');
  });
  $('#change-token').addEventListener('click', () => askToken(''));

  function showWho() {
    $('#who').textContent = token() ? 'token set' : 'no token';
  }

  // ---- pages and their timers -------------------------------------------------

  let current = null; // { stop() }

  function stopPage() {
    if (current) current.stop();
    current = null;
  }

  function showError(e) {
    if (e instanceof Unauthorized) { askToken('The API answered 401: enter a token.'); return; }
    $('#error').textContent = e ? String(e.message || e) : '';
  }

  // A poller: runs `tick` now and every `ms` while the tab is visible; the
  // next tick starts only after the last one ended (no pile-up on a slow API).
  function poller(ms, tick) {
    let timer = null, stopped = false;
    const run = async () => {
      timer = null;
      if (stopped) return;
      if (!document.hidden) {
        try { await tick(); $('#error').textContent = ''; } catch (e) { showError(e); if (e instanceof Unauthorized) return; }
      }
      if (!stopped) timer = setTimeout(run, ms);
    };
    run();
    return { stop() { stopped = true; if (timer) clearTimeout(timer); }, now: run };
  }

  // Countdowns tick locally: an element with data-until (ms since the epoch) shows the time left.
  setInterval(() => {
    const now = Date.now();
    document.querySelectorAll('[data-until]').forEach((e) => {
      const left = Math.max(0, Number(e.dataset.until) - now);
      e.textContent = (left / 1000).toFixed(1) + ' s';
    });
  }, 200);

  function countdown(untilMs) {
    if (!untilMs) return el('span', { class: 'num', text: '—' });
    const left = Math.max(0, untilMs - Date.now());
    return el('span', { class: 'num countdown', 'data-until': String(untilMs), text: (left / 1000).toFixed(1) + ' s' });
  }

  function route() {
    stopPage();
    $('#error').textContent = '';
    const hash = location.hash || '#/runs';
    const parts = hash.slice(2).split('/');
    const name = parts[0] === 'run' ? 'run' : (['runs', 'budget', 'fleet'].includes(parts[0]) ? parts[0] : 'runs');
    document.querySelectorAll('.page').forEach((p) => { p.hidden = p.id !== 'page-' + name; });
    document.querySelectorAll('nav a').forEach((a) => {
      if (a.dataset.page === name || (name === 'run' && a.dataset.page === 'runs')) a.setAttribute('aria-current', 'page');
      else a.removeAttribute('aria-current');
    });
    if (name === 'runs') current = runsPage();
    else if (name === 'run') current = runPage(decodeURIComponent(parts[1] || ''));
    else if (name === 'budget') current = budgetPage();
    else current = fleetPage();
  }
  window.addEventListener('hashchange', route);
  document.addEventListener('visibilitychange', () => { if (!document.hidden && current && current.now) current.now(); });

  // ---- Runs -------------------------------------------------------------------

  const runsState = { cursors: [null], page: 0 };

  function statusCell(status) {
    return el('span', { class: 'status s-' + status, text: STATUS_MARK[status] || status });
  }

  function runRow(r) {
    const waitUntil = r.status === 'waiting' && r.next_attempt_at ? Date.parse(r.next_attempt_at) : 0;
    const wait = waitUntil ? el('span', {}, countdown(waitUntil), ' ' + (r.wait_reason || '')) : el('span', { text: '—' });
    return el('tr', { 'data-id': r.id, 'data-status': r.status },
      el('td', {}, el('a', { href: '#/run/' + encodeURIComponent(r.id), text: r.id })),
      el('td', { class: 'status-cell' }, statusCell(r.status)),
      el('td', { class: 'm', text: r.mode }),
      el('td', { class: 'm', text: r.model }),
      el('td', { class: 'n num', text: r.turns_completed + '/' + r.max_turns }),
      el('td', { class: 'n num', text: num(r.usage && r.usage.total_tokens) }),
      el('td', { class: 'n' }, wait),
      el('td', { class: 'm num', text: when(r.created_at) }));
  }

  function matches(r, q) {
    if (!q) return true;
    if (r.id.includes(q)) return true;
    return Object.values(r.metadata || {}).some((v) => String(typeof v === 'string' ? v : JSON.stringify(v)).includes(q));
  }

  function runsPage() {
    const tbody = $('#runs-table tbody');
    const tick = async () => {
      const status = $('#f-status').value, mode = $('#f-mode').value, q = $('#f-search').value.trim();
      let runs, more = false;
      if (/^run_[0-9A-Za-z]+$/.test(q)) {
        // An exact id: one read, whatever page it is on.
        try { runs = [await api('/v1/runs/' + encodeURIComponent(q))]; } catch (e) { if (e.status === 404) runs = []; else throw e; }
      } else {
        const params = new URLSearchParams({ limit: '50' });
        if (status) params.set('status', status);
        // The API searches every run of the tenant (id and metadata values), not just this page.
        if (q) params.set('q', q);
        const cursor = runsState.cursors[runsState.page];
        if (cursor) params.set('cursor', cursor);
        const page = await api('/v1/runs?' + params);
        runs = page.data;
        more = page.has_more;
        runsState.cursors[runsState.page + 1] = page.next_cursor;
      }
      const shown = runs.filter((r) => (!mode || r.mode === mode) && (!status || r.status === status) && matches(r, q));
      tbody.replaceChildren(...shown.map(runRow));
      $('#runs-note').textContent = shown.length ? '' : 'No runs here.';
      $('#runs-page').textContent = 'page ' + (runsState.page + 1);
      $('#runs-older').disabled = !more;
      $('#runs-newer').disabled = runsState.page === 0;
    };
    const p = poller(POLL_MS, tick);
    const refresh = () => { runsState.cursors = [null]; runsState.page = 0; p.now(); };
    const onOlder = () => { runsState.page += 1; p.now(); };
    const onNewer = () => { runsState.page = 0; p.now(); };
    const inputs = ['#f-status', '#f-mode', '#f-search'].map((s) => $(s));
    inputs.forEach((i) => i.addEventListener('input', refresh));
    $('#runs-older').addEventListener('click', onOlder);
    $('#runs-newer').addEventListener('click', onNewer);
    return {
      now: p.now,
      stop() {
        p.stop();
        inputs.forEach((i) => i.removeEventListener('input', refresh));
        $('#runs-older').removeEventListener('click', onOlder);
        $('#runs-newer').removeEventListener('click', onNewer);
      },
    };
  }

  // ---- A run ------------------------------------------------------------------

  function fact(dl, label, value) {
    dl.append(el('dt', { text: label }), el('dd', {}, value instanceof Node ? value : el('span', { class: 'num', text: String(value) })));
  }

  const CLIPPED = /\[output clipped: kept the first \d+ of \d+ characters\]/;
  const ELIDED = '[An earlier browser view was elided';

  function contentText(c) {
    if (typeof c === 'string') return c;
    if (Array.isArray(c)) return c.map((p) => p.text || p.output_text || (p.type ? '[' + p.type + ']' : '')).join('');
    return c === undefined || c === null ? '' : JSON.stringify(c);
  }

  function transcriptItem(entry) {
    const it = entry.item || {};
    const li = el('li', { class: 'item' });
    const head = el('p', { class: 'item-head' }, el('span', { class: 'num', text: 'turn ' + entry.turn }), ' ');
    let body = '';
    if (it.type === 'function_call') {
      head.append(el('strong', { text: 'tool call' }), ' ' + (it.name || '') + ' ', el('code', { text: it.call_id || '' }));
      body = it.arguments || '';
      li.classList.add('tool-call');
    } else if (it.type === 'function_call_output') {
      head.append(el('strong', { text: 'tool output' }), ' ', el('code', { text: it.call_id || '' }));
      body = typeof it.output === 'string' ? it.output : JSON.stringify(it.output);
      li.classList.add('tool-output');
      if (CLIPPED.test(body)) { head.append(' ', el('span', { class: 'tag', text: 'CLIPPED' })); li.classList.add('clipped'); }
    } else if (it.type === 'reasoning') {
      head.append(el('strong', { text: 'reasoning' }));
      body = contentText(it.content || it.summary);
    } else {
      head.append(el('strong', { text: it.role || it.type || 'item' }));
      body = contentText(it.content);
    }
    if (body.includes(ELIDED)) { head.append(' ', el('span', { class: 'tag', text: 'ELIDED VIEW' })); li.classList.add('elided'); }
    li.append(head, el('pre', { text: body }));
    return li;
  }

  // Reads the run's SSE stream with fetch (an Authorization header, no token in the URL).
  function follow(id, onEvent, onState) {
    const ctrl = new AbortController();
    let lastId = null, stopped = false;
    const connect = async () => {
      while (!stopped) {
        try {
          const h = headers();
          h.accept = 'text/event-stream';
          if (lastId) h['last-event-id'] = lastId;
          const res = await fetch('/v1/runs/' + encodeURIComponent(id) + '/events', { headers: h, signal: ctrl.signal, cache: 'no-store' });
          if (res.status === 401) { showError(new Unauthorized()); return; }
          if (!res.ok || !res.body) { onState('stream unavailable (' + res.status + ')'); return; }
          onState('connected');
          const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
          let buf = '';
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            buf += value.replace(/\r\n/g, '\n');
            let cut;
            while ((cut = buf.indexOf('\n\n')) >= 0) {
              const frame = buf.slice(0, cut);
              buf = buf.slice(cut + 2);
              const ev = { event: 'message', data: '' };
              for (const line of frame.split('\n')) {
                if (line.startsWith('event:')) ev.event = line.slice(6).trim();
                else if (line.startsWith('data:')) ev.data += line.slice(5).replace(/^ /, '');
                else if (line.startsWith('id:')) ev.id = line.slice(3).trim();
              }
              if (ev.id) lastId = ev.id;
              if (ev.data) onEvent(ev);
            }
          }
          onState('stream ended');
          return; // a finished run's stream replays and closes
        } catch (e) {
          if (stopped) return;
          onState('reconnecting…');
          await new Promise((r) => setTimeout(r, 2000));
        }
      }
    };
    connect();
    return () => { stopped = true; ctrl.abort(); };
  }

  function runPage(id) {
    $('#run-id').textContent = id;
    $('#run-action').textContent = '';
    $('#live-text').textContent = '';
    $('#live-state').textContent = 'not connected';
    $('#transcript').replaceChildren();
    $('#run-facts').replaceChildren();
    let shownTurns = -1, status = null, unfollow = null;
    const live = $('#live-text');

    const loadTranscript = async () => {
      // Every page of it (1 000 items a page).
      const items = [];
      let cursor = null;
      do {
        const page = await api('/v1/runs/' + encodeURIComponent(id) + '/transcript'
          + (cursor ? '?cursor=' + encodeURIComponent(cursor) : ''));
        items.push(...page.items);
        cursor = page.next_cursor;
      } while (cursor);
      $('#transcript').replaceChildren(...items.map(transcriptItem));
    };

    const render = (r) => {
      const dl = el('dl', { class: 'facts', id: 'run-facts' });
      fact(dl, 'Status', statusCell(r.status));
      fact(dl, 'Mode', r.mode);
      fact(dl, 'Model', r.model);
      fact(dl, 'Turns', r.turns_completed + ' of ' + r.max_turns);
      const u = r.usage || {};
      fact(dl, 'Tokens', num(u.input_tokens) + ' in (' + num(u.cached_input_tokens) + ' read from the cache, '
        + num(u.cache_write_tokens) + ' written) · ' + num(u.output_tokens) + ' out · ' + num(u.total_tokens) + ' total');
      fact(dl, 'Cost', r.cost_usd == null ? 'unknown (no price for ' + r.model + ')' : '$' + r.cost_usd.toFixed(4) + ' at list price');
      const p = r.pacing || {};
      fact(dl, 'Pacing', num(p.budget_waits) + ' budget waits · ' + num(p.waited_ms) + ' ms waited · '
        + num(p.rate_limited) + ' rate limited · ' + num(p.retries) + ' retries');
      const waiting = r.status === 'waiting' && r.next_attempt_at;
      fact(dl, 'Waiting for', waiting ? el('span', {}, (r.wait_reason || '?') + ', next attempt in ', countdown(Date.parse(r.next_attempt_at))) : '—');
      fact(dl, 'Error', r.error ? el('span', { class: 'error-text', text: r.error.kind + ': ' + r.error.message }) : '—');
      if (r.webhook) {
        const w = r.webhook;
        const next = w.next_attempt_at ? ', next attempt ' + new Date(w.next_attempt_at).toLocaleString() : '';
        const last = w.last_status ? ', last HTTP ' + w.last_status : (w.last_error ? ', last: ' + w.last_error : '');
        fact(dl, 'Webhook', (w.state || 'sent when the run ends') + ' · ' + num(w.attempts) + ' attempts' + last + next
          + ' · ' + w.url + (w.event_id ? ' (' + w.event_id + ')' : ''));
      }
      fact(dl, 'Trace', r.trace_id || '—');
      fact(dl, 'Created', r.created_at ? new Date(r.created_at).toLocaleString() : '—');
      fact(dl, 'Finished', r.finished_at ? new Date(r.finished_at).toLocaleString() : '—');
      if (r.output_text) fact(dl, 'Output', el('pre', { class: 'output', text: r.output_text }));
      $('#run-facts').replaceWith(dl);
      $('#run-cancel').disabled = FINISHED.has(r.status);
      $('#run-retry').disabled = r.status !== 'failed';
    };

    const tick = async () => {
      let r;
      try {
        r = await api('/v1/runs/' + encodeURIComponent(id));
      } catch (e) {
        if (e.status !== 404) throw e;
        // Gone, or another tenant's: nothing to poll.
        p.stop();
        throw new Error('No run ' + id + ' for this token.');
      }
      render(r);
      if (r.turns_completed !== shownTurns || r.status !== status) {
        shownTurns = r.turns_completed;
        await loadTranscript();
      }
      if (!unfollow && !FINISHED.has(r.status)) startStream();
      if (!unfollow && FINISHED.has(r.status)) $('#live-state').textContent = 'run ' + r.status + ': the transcript below is complete';
      status = r.status;
      if (FINISHED.has(r.status)) p.stop(); // nothing more to poll: a retry restarts it
    };

    // The delivery now running: text from an older one (a holder that lost its
    // lease and had not stopped yet) is not shown.
    let epoch = 0;
    const parse = (s) => { try { return JSON.parse(s); } catch (_) { return {}; } };
    const startStream = () => {
      unfollow = follow(id, (ev) => {
        if (ev.event === 'turn.output_text.delta') {
          const d = parse(ev.data);
          if ((d.epoch || 0) < epoch) return;
          live.append(d.delta || '');
          live.scrollTop = live.scrollHeight;
        } else if (ev.event === 'turn.started') {
          epoch = parse(ev.data).epoch || 0;
          live.textContent = '';
        } else if (/^(turn\.completed|turn\.tool_result|run\.)/.test(ev.event)) {
          p.now();
        }
      }, (s) => { $('#live-state').textContent = s; });
    };

    let p = poller(POLL_MS, tick);
    const act = async (what) => {
      $('#run-action').textContent = what + '…';
      try {
        await api('/v1/runs/' + encodeURIComponent(id) + '/' + what, { method: 'POST' });
        $('#run-action').textContent = what === 'cancel' ? 'cancelled' : 'retried';
        if (what === 'retry') { p.stop(); p = poller(POLL_MS, tick); } else p.now();
      } catch (e) {
        $('#run-action').textContent = String(e.message || e);
        if (e instanceof Unauthorized) showError(e);
      }
    };
    const onCancel = () => act('cancel');
    const onRetry = () => act('retry');
    $('#run-cancel').addEventListener('click', onCancel);
    $('#run-retry').addEventListener('click', onRetry);
    return {
      now: () => p.now(),
      stop() {
        p.stop();
        if (unfollow) unfollow();
        $('#run-cancel').removeEventListener('click', onCancel);
        $('#run-retry').removeEventListener('click', onRetry);
      },
    };
  }

  // ---- Budget -----------------------------------------------------------------

  const charts = new Map(); // budget/model -> uPlot
  window.pacelineCharts = charts; // read by the integration test

  function meter(label, level, limit) {
    const known = limit !== null && limit !== undefined;
    const pct = known && limit > 0 ? Math.max(0, Math.min(100, (100 * level) / limit)) : 0;
    return el('div', { class: 'meter' },
      el('span', { class: 'meter-label', text: label }),
      el('span', { class: 'bar', role: 'img', 'aria-label': label + ' ' + Math.round(pct) + '% left' },
        el('span', { class: 'fill', style: 'width:' + pct.toFixed(1) + '%' })),
      el('span', { class: 'num meter-text', text: known ? num(level) + ' / ' + num(limit) : 'no limit known' }));
  }

  function budgetCard(b, key) {
    const card = el('article', { class: 'budget', 'data-key': key });
    card.append(el('h2', { text: b.budget + ' · ' + b.model }));
    const sh = b.shape || {};
    // A provider with separate input and output buckets (Anthropic) has no combined one.
    if (b.limit_tokens !== null || sh.limit_input_tokens === null || sh.limit_input_tokens === undefined) {
      card.append(meter('Tokens', b.remaining_tokens, b.limit_tokens));
    }
    if (sh.limit_input_tokens !== null && sh.limit_input_tokens !== undefined) card.append(meter('Input', sh.remaining_input_tokens, sh.limit_input_tokens));
    if (sh.limit_output_tokens !== null && sh.limit_output_tokens !== undefined) card.append(meter('Output', sh.remaining_output_tokens, sh.limit_output_tokens));
    card.append(meter('Requests', b.remaining_requests, b.limit_requests));
    const dl = el('dl', { class: 'facts' });
    fact(dl, 'Reserved', num(b.reserved_tokens) + ' tokens · ' + num(b.reserved_requests) + ' requests');
    fact(dl, 'Booked', num(b.booked_tokens) + ' tokens by ' + num(b.waiting_turns) + ' waiting turns');
    fact(dl, 'Full again in', b.reset_in_ms === null ? '—' : countdown(Date.now() + b.reset_in_ms));
    fact(dl, 'Closed by a 429', b.blocked_for_ms > 0 ? countdown(Date.now() + b.blocked_for_ms) : 'no');
    fact(dl, 'Refill', b.shape ? b.shape.refill : '—');
    const lines = b.tenants || (b.tenant ? [b.tenant] : []);
    for (const t of lines) {
      fact(dl, 'Tenant ' + t.tenant, num(t.admitted_tokens) + ' admitted · ' + num(t.waiting_tokens) + ' waiting · ' + num(t.waits) + ' waits');
    }
    card.append(dl);
    card.append(el('div', { class: 'chart', id: 'chart-' + key.replace(/[^A-Za-z0-9_-]/g, '_'), 'data-points': '0' }));
    return card;
  }

  function drawChart(box, h) {
    const key = h.budget + '/' + h.model;
    const xs = h.admitted_tokens.map((_, i) => h.start_s + i);
    const rate = h.admitted_tokens.map(() => h.refill_tokens_per_s);
    const data = [xs, h.admitted_tokens, rate, h.rate_limited, h.waits];
    const width = Math.max(280, box.clientWidth || 600);
    let u = charts.get(key);
    if (!u || u.root.parentNode !== box) {
      if (u) u.destroy();
      box.replaceChildren();
      u = new uPlot({
        width, height: 220,
        series: [
          {},
          { label: 'admitted tokens/s', stroke: '#1f5fbf', width: 1.5, fill: 'rgba(31,95,191,0.12)' },
          { label: 'refill rate (tokens/s)', stroke: '#444', dash: [6, 4], width: 1.5 },
          { label: '429s', stroke: '#b00020', scale: 'count', width: 2 },
          { label: 'waits', stroke: '#a15c00', scale: 'count', dash: [2, 3] },
        ],
        axes: [{}, { label: 'tokens/s' }, { side: 1, scale: 'count', label: 'count', grid: { show: false } }],
        scales: { count: { range: (_, min, max) => [0, Math.max(1, max)] } },
      }, data, box);
      charts.set(key, u);
    } else {
      u.setData(data);
      if (Math.abs(u.width - width) > 8) u.setSize({ width, height: 220 });
    }
    box.dataset.points = String(xs.length);
    box.dataset.admitted = String(h.admitted_tokens.reduce((a, b) => a + b, 0));
  }

  function budgetPage() {
    const root = $('#budgets');
    let histories = new Map();
    const paint = () => {
      for (const [key, h] of histories) {
        const card = root.querySelector('article[data-key="' + CSS.escape(key) + '"]');
        if (card) drawChart(card.querySelector('.chart'), h);
      }
    };
    const cards = async () => {
      const v = await api('/v1/pacer');
      const keys = v.budgets.map((b) => b.budget + '/' + b.model);
      // Replace the numbers card by card; each chart stays where it is (no layout jump).
      const old = new Map([...root.children].map((c) => [c.dataset.key, c]));
      const next = v.budgets.map((b, i) => {
        const fresh = budgetCard(b, keys[i]);
        const prev = old.get(keys[i]);
        if (prev) fresh.replaceChild(prev.querySelector('.chart'), fresh.querySelector('.chart'));
        return fresh;
      });
      root.replaceChildren(...next);
      for (const k of charts.keys()) if (!keys.includes(k)) { charts.get(k).destroy(); charts.delete(k); }
      $('#budget-note').textContent = v.budgets.length ? '' : 'No budget yet: none of this token\'s turns has asked the pacer.';
      paint();
    };
    const history = async () => {
      const v = await api('/v1/pacer/history');
      histories = new Map(v.budgets.map((h) => [h.budget + '/' + h.model, h]));
      paint();
    };
    // Each tenant's day so far (a tenant's token: its own), from GET /v1/usage.
    const spend = async () => {
      const day = new Date().toISOString().slice(0, 10);
      const v = await api('/v1/usage?' + new URLSearchParams({ from: day, to: day, group_by: 'tenant' }));
      const cost = (c) => (c === null || c === undefined ? 'unknown' : '$' + Number(c).toFixed(4));
      $('#spend-table tbody').replaceChildren(...v.data.map((x) => el('tr', { 'data-tenant': x.key },
        el('td', { text: x.key }), el('td', { class: 'n num', text: num(x.calls) }),
        el('td', { class: 'n num', text: num(x.input_tokens) }), el('td', { class: 'n num', text: num(x.cached_input_tokens) }),
        el('td', { class: 'n num', text: num(x.output_tokens) }), el('td', { class: 'n num', text: cost(x.cost_usd) }))));
      $('#spend-note').textContent = v.data.length ? '' : 'No calls answered today.';
    };
    const a = poller(BUDGET_MS, cards);
    const b = poller(HISTORY_MS, history);
    const c = poller(HISTORY_MS, spend);
    return { now() { a.now(); b.now(); c.now(); }, stop() { a.stop(); b.stop(); c.stop(); } };
  }

  // ---- Fleet ------------------------------------------------------------------

  function fleetPage() {
    const queue = async () => {
      const q = await api('/v1/queue');
      const dl = el('dl', { class: 'facts', id: 'queue-facts' });
      fact(dl, 'Whose', q.tenant ? 'tenant ' + q.tenant + ' (its own runs)' : 'the whole queue');
      fact(dl, 'Ready', num(q.ready));
      fact(dl, 'Delayed', num(q.delayed));
      fact(dl, 'In flight', num(q.in_flight));
      fact(dl, 'Dead', num(q.dead));
      fact(dl, 'Next due in', q.next_due_in_ms === null ? '—' : countdown(Date.now() + q.next_due_in_ms));
      $('#queue-facts').replaceWith(dl);
      try {
        const w = await api('/v1/workers');
        $('#workers-note').textContent = w.workers.length ? '' : 'No live workers.';
        $('#workers-table tbody').replaceChildren(...w.workers.map((x) => el('tr', {},
          el('td', { text: x.host }), el('td', { class: 'n num', text: String(x.pid) }),
          el('td', { class: 'n num', text: String(x.concurrency) }), el('td', { class: 'n num', text: String(x.in_flight) }),
          el('td', { class: 'm num', text: when(x.started_at) }), el('td', { class: 'n num', text: when(x.last_heartbeat) }))));
      } catch (e) {
        if (!(e instanceof Forbidden)) throw e;
        $('#workers-note').textContent = 'Operator token needed to list the workers.';
        $('#workers-table tbody').replaceChildren();
      }
      await deadTurns(q.dead);
    };
    // Dead turns (operator): read only while the queue counts some, so an
    // empty dead set costs the page nothing more.
    const deadTurns = async (count) => {
      const body = $('#dead-table tbody');
      if (!count) {
        $('#dead-note').textContent = 'No dead turns.';
        body.replaceChildren();
        return;
      }
      try {
        const d = await api('/v1/dead?limit=50');
        $('#dead-note').textContent = d.has_more ? 'The newest 50.' : '';
        body.replaceChildren(...d.data.map((x) => {
          const retry = el('button', { type: 'button', text: 'Retry', 'aria-label': 'retry run ' + x.run_id });
          retry.addEventListener('click', async () => {
            retry.disabled = true;
            retry.textContent = 'retrying…';
            try {
              await api('/v1/runs/' + encodeURIComponent(x.run_id) + '/retry', { method: 'POST' });
              retry.textContent = 'retried';
            } catch (e) {
              retry.textContent = String(e.message || e);
            }
          });
          const link = el('a', { href: '#/run/' + encodeURIComponent(x.run_id), text: x.run_id });
          return el('tr', {}, el('td', {}, link), el('td', { text: x.tenant || '—' }),
            el('td', { class: 'n num', text: x.turn === null ? '—' : String(x.turn) }),
            el('td', { class: 'm num', text: when(x.died_at) }), el('td', { text: x.reason }), el('td', {}, retry));
        }));
      } catch (e) {
        if (!(e instanceof Forbidden)) throw e;
        $('#dead-note').textContent = num(count) + ' dead; an operator token is needed to list them.';
        body.replaceChildren();
      }
    };
    return poller(BUDGET_MS, queue);
  }

  showWho();
  route();
})();

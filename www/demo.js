// The LES demo page: load a model, generate, show download progress, tokens/s and per-layer charts.
// URL parameters prefill the form: ?model=URL&budget=MiB&backend=cpu|webgpu|auto&prompt=...&n=N&run=1
// (&backing=indexeddb stores the model in IndexedDB instead of OPFS; &mmproj=URL loads a vision
// tower: the chat then takes an image with each message, picked with the image input)
import { createEngine, deleteModel } from './les/index.js';

const $ = (id) => document.getElementById(id);
const state = { engine: null, key: null, busy: false, last: null, error: null, progress: null, messages: [] };
window.les = state; // for tests and the console

function setError(e) {
  state.error = e ? { name: e.name, message: e.message } : null;
  $('error').hidden = !e;
  $('error').textContent = e ? (e.name === 'QuotaExceededError' ? `Storage full: ${e.message}` : `${e.name}: ${e.message}`) : '';
}

function status(s) {
  $('status').textContent = s;
}

function fmtMB(b) {
  return b >= 1e9 ? `${(b / 1e9).toFixed(2)} GB` : `${(b / 1e6).toFixed(1)} MB`;
}

function onProgress(p) {
  state.progress = p;
  if (p.phase === 'download') {
    state.stored = p.loaded;
    $('progress').hidden = false;
    const f = p.total ? p.loaded / p.total : 0;
    $('progress').querySelector('.bar').style.width = `${(100 * f).toFixed(1)}%`;
    $('progress').querySelector('.label').textContent = p.complete ? `stored in ${p.backing ?? 'browser storage'}: ${fmtMB(p.total)}` : `downloading to ${p.backing ?? 'storage'}: ${fmtMB(p.loaded)} / ${fmtMB(p.total)} (${(100 * f).toFixed(0)}%)`;
  } else if (p.phase === 'mmproj') {
    $('progress').hidden = false;
    const f = p.total ? p.loaded / p.total : 0;
    $('progress').querySelector('.bar').style.width = `${(100 * f).toFixed(1)}%`;
    $('progress').querySelector('.label').textContent = `vision tower: ${p.complete ? 'stored' : 'downloading'} ${fmtMB(p.loaded)} / ${fmtMB(p.total)}`;
  } else if (p.phase === 'error') {
    setError(p.error);
    status('The background download stopped; blocks are fetched on demand while generating. Reload to resume.');
  } else if (p.phase === 'load') {
    status(`Loading ${fmtMB(p.total)} model…`);
  }
}

function config() {
  const file = $('model-file').files[0];
  const mmFile = $('mmproj-file').files[0];
  const mmUrl = $('mmproj-url').value.trim();
  return {
    model: file ?? new URL($('model-url').value, location.href).href,
    // A vision tower next to the model (chat messages may then hold images).
    mmproj: mmFile ?? (mmUrl ? new URL(mmUrl, location.href).href : null),
    memoryBudgetMB: Number($('budget').value) || 0,
    backend: $('backend').value,
    backing: new URLSearchParams(location.search).get('backing') ?? 'auto',
    // `?prefetch=0`: on-demand reads only; `?slots=N`: an expert cache of N slots.
    prefetch: new URLSearchParams(location.search).get('prefetch') !== '0',
    expertSlots: Number(new URLSearchParams(location.search).get('slots')) || null,
    // Benchmarks (tests/e2e/ladder.mjs): `?policy=lru`, `?store=phone-4GBps`, `?lanes=N`.
    policy: new URLSearchParams(location.search).get('policy'),
    store: new URLSearchParams(location.search).get('store'),
    ioLanes: Number(new URLSearchParams(location.search).get('lanes')) || 1,
    // `?threads=N`: CPU kernel threads on a cross-origin isolated page (1: the plain build).
    threads: Number(new URLSearchParams(location.search).get('threads')) || null,
    // `?simd=simd128`: the SIMD128 build even where the browser has relaxed SIMD.
    relaxedSimd: new URLSearchParams(location.search).get('simd') !== 'simd128',
  };
}

async function load() {
  const c = config();
  const name = (x) => (x == null || typeof x === 'string' ? x : x.name);
  const key = JSON.stringify([name(c.model), name(c.mmproj), c.memoryBudgetMB, c.backend, c.prefetch, c.expertSlots, c.policy, c.store, c.ioLanes, c.threads, c.relaxedSimd]);
  if (state.engine && state.key === key) return state.engine;
  if (state.engine) await state.engine.unload();
  state.engine = null;
  setError(null);
  status('Starting the engine…');
  const t0 = performance.now();
  state.engine = await createEngine({ ...c, onProgress });
  state.key = key;
  state.messages = []; // a new engine holds no conversation
  const i = state.engine.info;
  const plan = i.plan ? ` | budget ${fmtMB(i.plan.budget)}: dense ${fmtMB(i.plan.dense)}, ${i.plan.slots} expert slots of ${fmtMB(i.plan.expert_bytes_max)} (${((100 * i.plan.slots * i.plan.expert_bytes_max) / Math.max(1, i.plan.total_expert_bytes)).toFixed(0)}% of expert bytes)` : ' | all experts resident';
  const vision = i.vision ? ` | vision tower ${i.vision.projector} (${fmtMB(i.vision.bytes)}): the chat takes images` : '';
  status(`${i.name ?? i.arch}: ${i.n_layer} layers, ${i.n_expert || 'no'} experts (${i.n_expert_used} used), ${fmtMB(i.model_bytes)}${plan}${vision}. Loaded in ${((performance.now() - t0) / 1000).toFixed(1)} s on ${state.engine.backend}.`);
  if (state.engine.loadInfo.gpuError) status($('status').textContent + ` (WebGPU unavailable: ${state.engine.loadInfo.gpuError})`);
  $('m-backend').textContent = state.engine.backend.split(' ')[0];
  $('m-backend').title = state.engine.backend;
  return state.engine;
}

async function run() {
  if (state.busy) return;
  state.busy = true;
  $('run').disabled = true;
  $('stop').disabled = false;
  try {
    const engine = await load();
    const out = $('output');
    const p = document.createElement('span');
    p.className = 'prompt';
    const opts = { max_tokens: Number($('max-tokens').value) || 64, temperature: Number($('temperature').value) || 0 };
    let stream;
    let reply = null;
    const image = $('image').files[0];
    if (image) $('chat').checked = true; // images go through the chat API
    if ($('chat').checked) {
      // The conversation goes with every turn (its images too); the engine runs only what its
      // cache lacks (an image it holds is not encoded again).
      if (!state.messages.length) out.innerHTML = '';
      const text = $('prompt').value;
      const content = image ? [{ type: 'image_url', image_url: { url: image } }, { type: 'text', text }] : text;
      state.messages.push({ role: 'user', content });
      p.textContent = `${state.messages.length > 1 ? '\n' : ''}> `;
      if (image) {
        const img = document.createElement('img');
        img.className = 'thumb';
        img.alt = image.name;
        img.src = URL.createObjectURL(image);
        p.append(img);
        clearImage();
      }
      p.append(`${text}\n`);
      reply = { role: 'assistant', content: '' };
      stream = (async function* () {
        const it = await engine.chat.completions.create({ messages: state.messages, stream: true, ...opts });
        // gpt-oss's reasoning (the harmony analysis channel) is shown apart from its answer.
        for await (const c of it) {
          const d = c.choices[0].delta;
          if (d.reasoning_content) yield [true, d.reasoning_content];
          if (d.content) yield [false, d.content];
        }
      })();
    } else {
      out.innerHTML = '';
      p.textContent = $('prompt').value;
      stream = (async function* () {
        for await (const chunk of engine.generate($('prompt').value, opts)) yield [false, chunk];
      })();
    }
    out.append(p);
    const think = document.createElement('span');
    think.className = 'reasoning';
    const gen = document.createElement('span');
    out.append(think, gen);
    status('Generating…');
    const timer = setInterval(refreshStats, 500);
    try {
      for await (const [reasoning, chunk] of stream) (reasoning ? think : gen).textContent += chunk;
    } finally {
      clearInterval(timer);
    }
    if (reply) {
      reply.content = gen.textContent;
      state.messages.push(reply);
    }
    state.last = engine.lastResult;
    await refreshStats();
    const s = state.last?.stats;
    const img = s?.images ? `; images: ${s.images.image_rows} embedding rows, ${s.images.encoded} pieces encoded in ${(s.images.encode_ms / 1000).toFixed(2)} s` : '';
    if (s) status(`${s.gen_tokens} tokens at ${s.tokens_per_s.toFixed(2)} tokens/s (prompt: ${s.prompt_tokens} tokens, ${s.prompt_reused ?? 0} reused from the cache, in ${(s.prompt_ms / 1000).toFixed(2)} s${img})${state.last.aborted ? ' — stopped' : ''}.`);
  } catch (e) {
    // A turn the engine refused (e.g. an image that does not decode) is not kept.
    if ($('chat').checked && state.messages.at(-1)?.role === 'user') state.messages.pop();
    setError(e);
    status('Failed.');
  } finally {
    state.busy = false;
    $('run').disabled = false;
    $('stop').disabled = true;
  }
}

async function refreshStats() {
  if (!state.engine) return;
  const st = await state.engine.stats();
  state.stats = st;
  const e = st.engine;
  if (!e) return;
  $('m-tps').textContent = e.tokens_per_s ? e.tokens_per_s.toFixed(2) : '–';
  $('m-hit').textContent = e.hit_rate != null ? `${(100 * e.hit_rate).toFixed(0)}%` : 'resident';
  $('m-recall').textContent = e.recall_d1 != null ? `${(100 * e.recall_d1).toFixed(0)}%` : '–';
  $('m-prefetch').textContent = e.stream ? `${e.stream.prefetch_used} / ${e.stream.prefetch_loads}` : '–';
  $('m-prefetch').title = e.reads ?? '';
  $('m-mb').textContent = e.bytes_per_token != null ? (e.bytes_per_token / 1e6).toFixed(1) : '0';
  $('m-stall').textContent = e.stream ? (e.stream.stall_ms / Math.max(1, e.stream.tokens)).toFixed(1) : '0';
  if (e.stream) drawCharts(e.stream.layers);
}

function canvasCtx(c) {
  const dpr = window.devicePixelRatio || 1;
  const w = c.clientWidth, h = Number(c.getAttribute('height'));
  c.width = w * dpr;
  c.height = h * dpr;
  c.style.height = `${h}px`;
  const x = c.getContext('2d');
  x.scale(dpr, dpr);
  x.clearRect(0, 0, w, h);
  return [x, w, h];
}

function bars(canvas, layers, series, title, fmtMax) {
  const [x, w, h] = canvasCtx(canvas);
  const css = getComputedStyle(document.documentElement);
  const top = 16, bottom = 14, n = layers.length;
  const totals = layers.map((l) => series.reduce((a, s) => a + s.get(l), 0));
  const max = Math.max(1e-9, ...totals);
  const bw = w / Math.max(1, n);
  x.fillStyle = css.getPropertyValue('--dim');
  x.font = '11px system-ui';
  x.fillText(`${title} (max ${fmtMax(max)})`, 0, 11);
  layers.forEach((l, i) => {
    let y = h - bottom;
    for (const s of series) {
      const v = s.get(l);
      const bh = ((h - top - bottom) * v) / max;
      x.fillStyle = css.getPropertyValue(s.color);
      x.fillRect(i * bw + 1, y - bh, Math.max(1, bw - 2), bh);
      y -= bh;
    }
  });
  x.fillStyle = css.getPropertyValue('--dim');
  for (let i = 0; i < n; i += Math.ceil(n / 10)) x.fillText(String(i), i * bw + 1, h - 2);
}

function drawCharts(layers) {
  bars($('chart-experts'), layers, [
    { get: (l) => l.hits, color: '--hit' },
    { get: (l) => l.late, color: '--late' },
    { get: (l) => l.misses, color: '--miss' },
  ], 'routed experts per layer', (m) => m.toFixed(0));
  bars($('chart-recall'), layers, [{ get: (l) => (l.pred_routed[0] ? l.pred_tp[0] / l.pred_routed[0] : 0), color: '--recall' }], 'prefetch recall per layer', (m) => `${(100 * m).toFixed(0)}%`);
  bars($('chart-stall'), layers, [{ get: (l) => l.stall_ms, color: '--stall' }], 'stall ms per layer', (m) => m.toFixed(1));
}

function clearImage() {
  $('image').value = '';
  $('image-chip').hidden = true;
  if ($('image-preview').src) URL.revokeObjectURL($('image-preview').src);
  $('image-preview').removeAttribute('src');
}
$('image').onchange = () => {
  const f = $('image').files[0];
  if (!f) return clearImage();
  if ($('image-preview').src) URL.revokeObjectURL($('image-preview').src);
  $('image-preview').src = URL.createObjectURL(f);
  $('image-chip').hidden = false;
  $('chat').checked = true;
};
$('image-clear').onclick = clearImage;

$('load').onclick = () => load().catch((e) => { setError(e); status('Failed.'); });
$('run').onclick = run;
$('stop').onclick = () => state.engine?.abort();
$('new-chat').onclick = async () => {
  if (state.busy) return;
  state.messages = [];
  $('output').innerHTML = '';
  await state.engine?.resetChat();
  status('New conversation.');
};
$('forget').onclick = async () => {
  if (state.engine) await state.engine.unload();
  state.engine = null;
  await deleteModel(new URL($('model-url').value, location.href).href);
  status('Deleted from browser storage.');
};

const q = new URLSearchParams(location.search);
if (q.has('model')) $('model-url').value = q.get('model');
if (q.has('mmproj')) $('mmproj-url').value = q.get('mmproj');
if (q.has('budget')) $('budget').value = q.get('budget');
if (q.has('backend')) $('backend').value = q.get('backend');
if (q.has('prompt')) $('prompt').value = q.get('prompt');
if (q.has('n')) $('max-tokens').value = q.get('n');
if (q.get('chat') === '1') $('chat').checked = true;
if (q.get('run') === '1') run();

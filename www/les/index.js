// LES in the browser: the public API. The engine runs in a dedicated module worker.
//
//   import { createEngine } from 'les-engine';
//   const engine = await createEngine({ model: 'https://host/smolmoe-32x2.les', memoryBudgetMB: 400 });
//   for await (const chunk of engine.generate('The three primary colors are', { max_tokens: 64 })) out.textContent += chunk;

class Rpc {
  constructor(worker) {
    this.worker = worker;
    this.next = 1;
    this.calls = new Map();
    this.listeners = new Set();
    worker.onmessage = (ev) => {
      const m = ev.data;
      if (m.event) {
        for (const l of this.listeners) l(m);
        return;
      }
      const c = this.calls.get(m.id);
      if (!c) return;
      this.calls.delete(m.id);
      if (m.ok) c.resolve(m.result);
      else {
        const e = new Error(m.error.message);
        e.name = m.error.name;
        c.reject(e);
      }
    };
    worker.onerror = (ev) => {
      const e = new Error(ev.message || 'LES worker failed');
      for (const c of this.calls.values()) c.reject(e);
      this.calls.clear();
    };
  }
  call(op, args = {}, transfer = []) {
    const id = this.next++;
    return new Promise((resolve, reject) => {
      this.calls.set(id, { resolve, reject });
      this.worker.postMessage({ id, op, ...args }, transfer);
    });
  }
}

function newWorker(workerUrl) {
  return new Worker(workerUrl ?? new URL('./worker.js', import.meta.url), { type: 'module', name: 'les-engine' });
}

export class Engine {
  constructor(rpc, loaded) {
    this._rpc = rpc;
    this.info = loaded.info;
    this.backend = loaded.backend;
    this.loadInfo = loaded;
    this._lastResult = null;
    this.chat = { completions: { create: (req) => this._chatCreate(req) } };
  }

  /** Async iterator of text chunks. `options`: max_tokens, temperature, top_k, top_p, min_p,
   *  repeat_penalty, seed, ignore_eos. The final result (tokens, stats) is in `engine.lastResult`. */
  async *generate(prompt, options = {}) {
    for await (const m of this._tokens(prompt, options, false)) {
      if (m.text) yield m.text;
    }
  }

  // The worker's token events of one generation (`split`: with the reply's `reasoning` and
  // `content`, split as harmony for gpt-oss).
  async *_tokens(prompt, options, split, images = []) {
    const queue = [];
    let wake = null;
    let result = null;
    let failure = null;
    let id = 0;
    const listener = (m) => {
      if ((m.event === 'token' || m.event === 'started') && m.id === id) {
        queue.push(m);
        wake?.();
      }
    };
    this._rpc.listeners.add(listener);
    id = this._rpc.next; // the id the next call gets
    const done = this._rpc.call('generate', { prompt, options, split, images }).then(
      (r) => { result = r; wake?.(); },
      (e) => { failure = e; wake?.(); },
    );
    try {
      for (;;) {
        while (queue.length) yield queue.shift();
        if (failure) throw failure;
        if (result) break;
        await new Promise((r) => (wake = r));
        wake = null;
      }
      await done;
      while (queue.length) yield queue.shift();
      this._lastResult = result;
    } finally {
      this._rpc.listeners.delete(listener);
    }
  }

  /** Tokens, text and stats of the last finished generation. */
  get lastResult() {
    return this._lastResult;
  }

  /** Forget the cached conversation. Each chat call sends the whole conversation; the engine keeps
   *  its state between calls and runs only the part after the longest prefix it already holds
   *  (the previous turns), so a new turn starts at once. Call this to start over explicitly. */
  resetChat() {
    return this._rpc.call('resetChat');
  }

  async _chatCreate({ messages, stream = false, max_tokens, max_completion_tokens, temperature, top_p, seed, stop, ...rest }) {
    // Content parts: text joined as llama-server joins them, each image a media marker in the
    // text and its file bytes in `images` (in order).
    const flat = await flattenMessages(messages);
    const prompt = await this._rpc.call('chatPrompt', { messages: flat.messages });
    const stops = stop == null ? [] : Array.isArray(stop) ? stop : [stop];
    const options = { max_tokens: max_tokens ?? max_completion_tokens, temperature: temperature ?? 0.7, top_p, seed, stop: stops, ...rest };
    const created = Math.floor(Date.now() / 1000);
    const id = `chatcmpl-les-${created}-${Math.random().toString(36).slice(2, 8)}`;
    const model = this.info.name ?? 'les';
    // gpt-oss (harmony): the analysis channel is `reasoning_content`, the final one `content`
    // (as llama.cpp's server and `les serve` answer).
    if (stream) {
      const self = this;
      const events = this._tokens(prompt, options, true, flat.images);
      // The prompt is taken (its images decoded) before the stream is returned: a request the
      // engine refuses (an image that does not decode) rejects this call, as an HTTP error would.
      await events.next();
      return (async function* () {
        for await (const m of events) {
          const chunk = (delta) => ({ id, object: 'chat.completion.chunk', created, model, choices: [{ index: 0, delta, finish_reason: null }] });
          if (m.reasoning) yield chunk({ reasoning_content: m.reasoning });
          if (m.content) yield chunk({ content: m.content });
        }
        const r = self.lastResult;
        yield { id, object: 'chat.completion.chunk', created, model, choices: [{ index: 0, delta: {}, finish_reason: r?.finishReason ?? 'stop' }], usage: usageOf(r) };
      })();
    }
    let content = '';
    let reasoning = '';
    for await (const m of this._tokens(prompt, options, true, flat.images)) {
      content += m.content ?? '';
      reasoning += m.reasoning ?? '';
    }
    const r = this.lastResult;
    const message = reasoning ? { role: 'assistant', content, reasoning_content: reasoning } : { role: 'assistant', content };
    return {
      id, object: 'chat.completion', created, model,
      choices: [{ index: 0, message, finish_reason: r?.finishReason ?? 'stop' }],
      usage: usageOf(r),
    };
  }

  /** Will it fit, and how fast? `les plan`'s forecast for this model: `{ memoryBudgetMB, nCtx,
   *  store, promptTokens }` (defaults: the budget and context now, this page's storage probed,
   *  512). The hit rate replays the routing seen so far; compute comes from the last generation
   *  (before the first, the speeds are left out). Resolves with the forecast (`fits`, `plan`,
   *  `minimum`, `largest_context`, `hit_rate`, `bytes_per_token`, `decode_tokens_per_s`,
   *  `decode_bound`, `prompt_tokens_per_s`, …). */
  plan({ memoryBudgetMB, nCtx, store, promptTokens } = {}) {
    const options = { memory_budget: memoryBudgetMB == null ? undefined : memoryBudgetMB * 1048576, n_ctx: nCtx, store, prompt_tokens: promptTokens };
    return this._rpc.call('plan', { options });
  }

  /** The memory budget (bytes): `{ budget, minimum, expert_slots, expert_bytes_held }`, or
   *  `null` for a model held whole. */
  memoryBudget() {
    return this._rpc.call('memoryBudget');
  }

  /** Change the memory budget to `mb` MiB (fractions allowed; `'minimum'` for the model's
   *  minimum), also while a generation runs: the expert cache shrinks or may grow again, the
   *  conversation and the output do not change. Rejects below the model's minimum (the message
   *  names it) and changes nothing. The wasm heap never shrinks (WebAssembly memory only grows):
   *  what the cache gives back is reused inside it instead of growing it. Resolves with
   *  `memoryBudget()`'s object. */
  setMemoryBudget(mb) {
    return this._rpc.call('setMemoryBudget', { mb });
  }

  /** Give memory back while the page is hidden or frozen (Page Visibility / Page Lifecycle
   *  events): the budget goes down to the model's minimum, and back to what it was when the page
   *  is shown again. Output does not change. What it frees leaves the page where it lives outside
   *  the wasm heap (a WebGPU expert pool); inside the heap it is reused (the heap never shrinks).
   *  `on = false` stops it. No effect for a model held whole. */
  shrinkWhenHidden(on = true) {
    if (typeof document === 'undefined') return;
    if (this._hidden) {
      document.removeEventListener('visibilitychange', this._hidden.visibility);
      document.removeEventListener('freeze', this._hidden.hide);
      document.removeEventListener('resume', this._hidden.show);
      this._hidden = null;
    }
    if (!on) return;
    // Changes run one after another, so a quick hide/show ends where the page is.
    let chain = Promise.resolve();
    let full = null;
    const run = (f) => (chain = chain.then(f).catch(() => {}));
    const hide = () => run(async () => {
      if (full != null) return;
      const b = await this.memoryBudget();
      if (!b || b.budget <= b.minimum) return;
      await this.setMemoryBudget('minimum');
      full = b.budget;
    });
    const show = () => run(async () => {
      if (full == null) return;
      const mb = full / 1048576;
      full = null;
      await this.setMemoryBudget(mb);
    });
    const visibility = () => (document.visibilityState === 'hidden' ? hide() : show());
    this._hidden = { visibility, hide, show, settled: () => chain };
    document.addEventListener('visibilitychange', visibility);
    document.addEventListener('freeze', hide);
    document.addEventListener('resume', show);
  }

  /** Stop the running generation after the current token. */
  abort() {
    return this._rpc.call('abort');
  }

  /** Engine counters (tokens/s, per-layer hits, misses, recall, stall) and storage counters. */
  stats() {
    return this._rpc.call('stats');
  }

  /** Resolves when the background download of the model has finished. */
  waitForDownload() {
    return this._rpc.call('waitDownload');
  }

  /** Free the model and stop the worker. A generation still running ends with an `AbortError`. */
  async unload() {
    this.shrinkWhenHidden(false);
    try {
      await this._rpc.call('unload');
    } finally {
      this._rpc.worker.terminate();
      const e = new Error('the engine was unloaded');
      e.name = 'AbortError';
      for (const c of this._rpc.calls.values()) c.reject(e);
      this._rpc.calls.clear();
    }
  }
}

function usageOf(r) {
  return r ? { prompt_tokens: r.promptTokens, completion_tokens: r.tokens.length, total_tokens: r.promptTokens + r.tokens.length, prompt_tokens_details: { cached_tokens: r.promptReused ?? 0 } } : undefined;
}

// Where an image goes in a message's text (llama.cpp mtmd's default media marker).
const MARKER = '<__media__>';

/** Messages with content parts made plain: `{messages: [{role, content: string}], images: Uint8Array[]}`. */
async function flattenMessages(messages) {
  if (!Array.isArray(messages)) throw new TypeError('messages must be an array');
  const images = [];
  const out = [];
  for (const m of messages) {
    let content = m?.content ?? '';
    if (Array.isArray(content)) {
      let text = '';
      let afterMarker = false;
      for (const part of content) {
        if (part?.type === 'text') {
          if (typeof part.text !== 'string') throw new TypeError("a text content part needs a string 'text'");
          if (!afterMarker && text) text += '\n';
          text += part.text;
          afterMarker = false;
        } else if (part?.type === 'image_url') {
          // `{url, detail}` (detail ignored), or the image itself in place of the object.
          const src = part.image_url?.url ?? part.image_url;
          if (src == null) throw new TypeError("an image_url content part needs 'image_url.url'");
          images.push(await imageBytes(src));
          text += MARKER;
          afterMarker = true;
        } else {
          throw new TypeError(`content parts of type '${part?.type}' are not supported (text and image_url are)`);
        }
      }
      content = text;
    } else if (typeof content !== 'string') {
      throw new TypeError('message content must be a string or a list of content parts');
    }
    out.push({ role: m.role, content });
  }
  return { messages: out, images };
}

// File bytes per image object: a conversation sends its images again every turn, and an image
// drawn to PNG here must give the same bytes each time (the engine knows an image by its bytes).
const imageCache = new WeakMap();

const isPngOrJpeg = (b) => (b.length >= 8 && b[0] === 0x89 && b[1] === 0x50 && b[2] === 0x4e && b[3] === 0x47) || (b.length >= 3 && b[0] === 0xff && b[1] === 0xd8 && b[2] === 0xff);

const DRAWABLE = ['ImageBitmap', 'HTMLImageElement', 'HTMLCanvasElement', 'OffscreenCanvas', 'VideoFrame', 'HTMLVideoElement', 'SVGImageElement'];
const isA = (x, name) => typeof globalThis[name] === 'function' && x instanceof globalThis[name];

/**
 * An image as PNG or JPEG file bytes (what the engine decodes): a `data:` URL (base64), a
 * `blob:` URL, a Blob / File, an ArrayBuffer or typed array of the file's bytes, an ImageData
 * (RGBA pixels), or anything a canvas draws (ImageBitmap, <img>, <canvas>, OffscreenCanvas,
 * VideoFrame), drawn to an OffscreenCanvas and encoded as PNG. Files in other formats the
 * browser decodes (WebP, GIF, AVIF, BMP) become PNG the same way. Remote URLs are refused.
 */
async function imageBytes(src) {
  if (typeof src === 'string') return fileBytes(await urlBytes(src));
  if (src instanceof ArrayBuffer) return fileBytes(new Uint8Array(src.slice(0)));
  if (ArrayBuffer.isView(src)) return fileBytes(new Uint8Array(src.buffer.slice(src.byteOffset, src.byteOffset + src.byteLength)));
  if (typeof src !== 'object' || src === null) throw new TypeError(`an image must be a data: URL, a Blob, an ImageBitmap or ImageData (got ${src === null ? 'null' : typeof src})`);
  let p = imageCache.get(src);
  if (!p) {
    if (src instanceof Blob) p = src.arrayBuffer().then((b) => fileBytes(new Uint8Array(b)));
    else if (isA(src, 'ImageData')) p = drawPng(src.width, src.height, (x) => x.putImageData(src, 0, 0));
    else if (DRAWABLE.some((n) => isA(src, n))) {
      const w = src.naturalWidth || src.videoWidth || src.displayWidth || src.width;
      const h = src.naturalHeight || src.videoHeight || src.displayHeight || src.height;
      p = drawPng(w, h, (x) => x.drawImage(src, 0, 0, w, h));
    } else throw new TypeError(`an image must be a data: URL, a Blob, an ImageBitmap or ImageData (got ${src.constructor?.name ?? 'an object'})`);
    imageCache.set(src, p);
    p.catch(() => imageCache.delete(src));
  }
  return p;
}

async function urlBytes(url) {
  const scheme = url.slice(0, url.indexOf(':') + 1).toLowerCase();
  if (scheme === 'blob:') return new Uint8Array(await (await fetch(url)).arrayBuffer());
  if (scheme !== 'data:') {
    throw new TypeError("image URLs must be data: URLs (data:image/png;base64,…) or blob: URLs: LES fetches nothing, so remote (http, https) URLs are refused; pass the image itself instead, e.g. `{ type: 'image_url', image_url: { url: await (await fetch(src)).blob() } }`");
  }
  const comma = url.indexOf(',');
  if (comma < 0) throw new TypeError("malformed data: URL (no ',' before the data)");
  if (!url.slice(5, comma).split(';').some((x) => x.trim().toLowerCase() === 'base64')) throw new TypeError('image data: URLs must be base64-encoded (data:image/png;base64,…)');
  let bin;
  try {
    bin = atob(url.slice(comma + 1).replace(/[\t\n\f\r ]/g, ''));
  } catch (e) {
    throw new TypeError(`the image's base64 data is invalid: ${e.message}`);
  }
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// PNG and JPEG go to the engine as they are (it decodes them as llama.cpp does); another format
// the browser decodes is drawn to PNG; bytes nobody decodes go on, for the engine's error.
async function fileBytes(b) {
  if (isPngOrJpeg(b) || typeof createImageBitmap !== 'function') return b;
  let bmp;
  try {
    bmp = await createImageBitmap(new Blob([b]), { premultiplyAlpha: 'none', colorSpaceConversion: 'none' });
  } catch (_) {
    return b;
  }
  try {
    return await drawPng(bmp.width, bmp.height, (x) => x.drawImage(bmp, 0, 0));
  } finally {
    bmp.close();
  }
}

async function drawPng(w, h, draw) {
  if (!(w > 0 && h > 0)) throw new TypeError(`the image is empty (${w}×${h})`);
  if (typeof OffscreenCanvas !== 'function') throw new TypeError('this browser has no OffscreenCanvas: pass images as PNG or JPEG files (a Blob or a data: URL)');
  const c = new OffscreenCanvas(w, h);
  const x = c.getContext('2d');
  draw(x);
  return new Uint8Array(await (await c.convertToBlob({ type: 'image/png' })).arrayBuffer());
}

/**
 * Load a model in a new worker.
 * @param {object} o  { model: URL string | File | FileSystemFileHandle, mmproj (a vision tower,
 *   the same kinds: chat messages may then carry images), memoryBudgetMB (0 = all resident), backend: 'auto' | 'webgpu' | 'cpu', nCtx, backing: 'auto' | 'opfs' | 'indexeddb',
 *   prefetch (default true), prefetchAlways (default false), ioLanes, expertSlots, gpuExpertSlots, threads, relaxedSimd (default true), directReads (default true: with the threaded build the I/O worker reads experts straight into their slots; false: into its own buffer, copied), repack (default true: Q4_0/Q4_1/Q8_0 matrices held in memory interleaved four rows at a time for the relaxed-SIMD kernels, same bits; false: the file's layout), policy, lookahead,
 *   store, onProgress({phase, loaded, total}), workerUrl }
 */
export async function createEngine({ onProgress, workerUrl, ...opts }) {
  const rpc = new Rpc(newWorker(workerUrl));
  if (onProgress) rpc.listeners.add((m) => m.event === 'progress' && onProgress(m));
  try {
    const loaded = await rpc.call('load', opts);
    return new Engine(rpc, loaded);
  } catch (e) {
    rpc.worker.terminate();
    throw e;
  }
}

async function oneShot(op, args, workerUrl) {
  const rpc = new Rpc(newWorker(workerUrl));
  try {
    return await rpc.call(op, args);
  } finally {
    rpc.worker.terminate();
  }
}

/** Models stored in this origin's OPFS: [{key, url, size, storedBytes, backing}]. */
export const listModels = (workerUrl) => oneShot('listModels', {}, workerUrl);
/** Delete a stored model (by its URL). */
export const deleteModel = (url, workerUrl) => oneShot('deleteModel', { url }, workerUrl);
/** {usage, quota} of this origin's storage, in bytes. */
export const storageUsage = (workerUrl) => oneShot('storageUsage', {}, workerUrl);

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
  async *_tokens(prompt, options, split) {
    const queue = [];
    let wake = null;
    let result = null;
    let failure = null;
    let id = 0;
    const listener = (m) => {
      if (m.event === 'token' && m.id === id) {
        queue.push(m);
        wake?.();
      }
    };
    this._rpc.listeners.add(listener);
    id = this._rpc.next; // the id the next call gets
    const done = this._rpc.call('generate', { prompt, options, split }).then(
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
    const prompt = await this._rpc.call('chatPrompt', { messages });
    const stops = stop == null ? [] : Array.isArray(stop) ? stop : [stop];
    const options = { max_tokens: max_tokens ?? max_completion_tokens, temperature: temperature ?? 0.7, top_p, seed, stop: stops, ...rest };
    const created = Math.floor(Date.now() / 1000);
    const id = `chatcmpl-les-${created}-${Math.random().toString(36).slice(2, 8)}`;
    const model = this.info.name ?? 'les';
    // gpt-oss (harmony): the analysis channel is `reasoning_content`, the final one `content`
    // (as llama.cpp's server and `les serve` answer).
    if (stream) {
      const self = this;
      return (async function* () {
        for await (const m of self._tokens(prompt, options, true)) {
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
    for await (const m of this._tokens(prompt, options, true)) {
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

/**
 * Load a model in a new worker.
 * @param {object} o  { model: URL string | File | FileSystemFileHandle, memoryBudgetMB (0 = all
 *   resident), backend: 'auto' | 'webgpu' | 'cpu', nCtx, backing: 'auto' | 'opfs' | 'indexeddb',
 *   prefetch (default true), prefetchAlways (default false), ioLanes, expertSlots, gpuExpertSlots, threads, policy, lookahead,
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

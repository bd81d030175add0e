// The LES engine's dedicated worker. Messages in: {id, op, ...}; out: {id, ok, result | error} and
// events {event: 'progress' | 'token', ...}. One model per worker.
import { CachedModel, FileModel, listModels, deleteModel, storageUsage } from './store.js';
import { AsyncReads } from './io.js';
import { Device } from './device.js';

let ready = null; // the engine's module, once loaded: pkg/ (one thread) or pkg-mt/ (threaded CPU kernels)
let threads = { n: 1, why: '', simd: null };
let wasmMemory = null;

// Whether this browser's WebAssembly has relaxed SIMD: a module whose one function runs
// `i32x4.relaxed_dot_i8x16_i7x16_add_s` on constants validates only where the proposal is shipped
// (Chromium 114+; Firefox and Safari at the time of writing: no).
function hasRelaxedSimd() {
  // v128 = splat(0); relaxed_dot_i8x16_i7x16_add_s(v, v, v): the three operands are three splats.
  const body = [0x00, 0x41, 0x00, 0xfd, 0x11, 0x41, 0x00, 0xfd, 0x11, 0x41, 0x00, 0xfd, 0x11, 0xfd, 0x93, 0x02, 0x0b];
  const m = new Uint8Array([0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, 0x01, 0x05, 0x01, 0x60, 0x00, 0x01, 0x7b,
    0x03, 0x02, 0x01, 0x00, 0x0a, body.length + 2, 0x01, body.length, ...body]);
  try { return WebAssembly.validate(m); } catch { return false; }
}

// Load the engine's wasm. The CPU path on a cross-origin isolated page takes the threaded build
// (pkg-mt: shared memory and a pool of web workers for the CPU kernels); elsewhere the plain build
// (the WebGPU path computes on the GPU; without isolation there is no SharedArrayBuffer).
// Where the browser has relaxed SIMD (and `relaxedSimd` is not false) the pkg*-relaxed build: its
// quantized dots compute the same bits with fewer instructions.
async function loadWasm(cpu, nThreads, relaxedSimd = true) {
  const isolated = !!self.crossOriginIsolated && typeof SharedArrayBuffer === 'function';
  // Default: measured at load. A pool of up to 8 workers starts (at most the cores), then
  // matrix-vector products run on 1, 2, … of them, interleaved (`tuneThreads`), and the kernels
  // keep the fewest threads within 5% of the fastest: a phone's slow cores or a busy machine
  // decide for themselves. The `threads` option skips the measurement.
  const hw = navigator.hardwareConcurrency || 1;
  const want = cpu && isolated ? (nThreads ?? Math.min(hw, 8)) : 1;
  const relaxed = relaxedSimd !== false && hasRelaxedSimd();
  const dir = `./pkg${want > 1 ? '-mt' : ''}${relaxed ? '-relaxed' : ''}/`;
  const m = await import(new URL(`${dir}les.js`, import.meta.url));
  const exports = await m.default({ module_or_path: new URL(`${dir}les_bg.wasm`, import.meta.url) });
  wasmMemory = exports.memory; // shared in the threaded build: the I/O worker reads into it
  let measured = null;
  if (want > 1) {
    await m.initThreadPool(want);
    m.threadPoolReady();
    if (nThreads == null) measured = JSON.parse(m.tuneThreads());
  }
  const n = m.cpuThreads();
  const ms = measured && measured.times_ms.map((t, i) => `${i + 1}: ${t.toFixed(3)}`).join(', ');
  const why = !cpu ? 'WebGPU: the CPU kernels run on the engine\'s thread'
    : !isolated ? 'the page is not cross-origin isolated (COOP/COEP): no shared memory for threads'
    : measured ? `measured at load: ms per 1536x576 matrix-vector product on 1..${want} threads (${ms}); the fewest within 5% of the fastest`
    : want > 1 ? `cross-origin isolated: a pool of ${n} web workers (the threads option)`
    : nThreads ? 'one thread requested' : `navigator.hardwareConcurrency is ${navigator.hardwareConcurrency}`;
  threads = { n, why, simd: m.wasmSimd(), fusedMadd: m.wasmFusedMadd(), measuredMs: measured?.times_ms ?? null };
  return m;
}
let engine = null;
let profiling = false;
let model = null;
let reads = null;
let download = null;
let aborted = false;
let generating = false;

// A failure while reading the model: when storage gave up (quota), report that error, once the
// partial download has been removed; the engine passes reads' errors on as plain messages.
async function storageFailure(e) {
  await model?.discarding;
  return model?.fatal ?? e;
}

function post(msg) {
  postMessage(msg);
}

function errorOf(e) {
  const s = e && e.message ? e.message : String(e);
  return { name: e?.name && e.name !== 'Error' ? e.name : 'LesError', message: s };
}

// A macrotask boundary, so messages (abort, stats) are handled between tokens.
function yieldToEvents() {
  return new Promise((res) => {
    const c = new MessageChannel();
    c.port1.onmessage = () => res();
    c.port2.postMessage(null);
  });
}

// A model (or mmproj) source: a URL is stored in OPFS / IndexedDB (downloaded once, by range);
// a File or FileSystemFileHandle is read in place.
async function openSource(src, opts, what) {
  if (typeof src === 'string') return CachedModel.open(src, opts);
  if (src && typeof src.getFile === 'function') return new FileModel(await src.getFile());
  if (src instanceof Blob) return new FileModel(src);
  throw new TypeError(`${what} must be a URL string, a File or a FileSystemFileHandle`);
}

async function load({ model: src, mmproj = null, memoryBudgetMB = 0, backend = 'auto', nCtx = 2048, backing = 'auto', gpuExpertSlots = null, prefetch = true, prefetchAlways = false, ioLanes = 1, expertSlots = null, policy = null, lookahead = 1, store = null, threads: nThreads = null, relaxedSimd = true, directReads = true, repack = true, ioTimeoutMs = 60000, debugFailReads = 0, debugStallReads = 0, debugProfile = false }) {
  const wantGpu = backend === 'webgpu' || (backend === 'auto' && !!navigator.gpu);
  const { Engine, crc32, deviceProfile, profileOps } = await (ready ??= loadWasm(!wantGpu, nThreads, relaxedSimd));
  // Benchmarks: per-op times of the CPU forward in `stats().profile`.
  profiling = debugProfile;
  profileOps(profiling);
  const onProgress = (p) => post({ event: 'progress', ...p });
  model = await openSource(src, { crc32, onProgress, backing }, 'model');
  if (store && store !== 'disk') {
    // Benchmarks: model reads at the pace of a flash device (the native `--store` profiles).
    const p = deviceProfile(store);
    if (!p) throw new Error(`unknown store profile ${store}`);
    model.device = new Device(JSON.parse(p));
  }
  onProgress({ phase: 'load', loaded: 0, total: model.size });
  const t0 = performance.now();
  const open = async (gpuPool) => {
    // Predicted experts are read asynchronously while the engine computes (io.js). Without
    // shared memory, reads land only when the worker awaits: every layer on WebGPU, but only
    // between tokens on the CPU, too late to pay for the slots they take there.
    reads?.close();
    reads = prefetch && memoryBudgetMB > 0 ? await AsyncReads.create(model, { lanes: ioLanes, failEvery: debugFailReads, memory: directReads ? wasmMemory : null, timeoutMs: ioTimeoutMs, stallAfter: debugStallReads }) : null;
    if (reads?.mode === 'local' && !gpuPool) {
      reads.close();
      reads = null;
    }
    // The GPU run keeps its experts in GPU slots: the budget is split into a small CPU staging
    // cache and the GPU pool, as natively.
    const opts = JSON.stringify({ prefetch, prefetch_always: prefetchAlways, gpu_pool: gpuPool, io_lanes: ioLanes, expert_slots: expertSlots ?? undefined, policy: policy ?? undefined, lookahead, verified_at_rest: model instanceof CachedModel, repack });
    // Reads fill the engine's own memory where the model can (`into`: no buffer per read).
    const read = model.readInto && directReads ? (off, len, into) => model.readInto(off, into, len) !== null || model.readSync(off, len) : (off, len) => model.readSync(off, len);
    return new Engine(read, (off, len) => model.hint(off, len), model.size, memoryBudgetMB * 1048576, nCtx, String(src.name ?? src), opts, reads ?? undefined);
  };
  try {
    engine = await open(wantGpu);
  } catch (e) {
    throw await storageFailure(e);
  }
  const loadMs = performance.now() - t0;
  let backendLine = 'cpu (wasm)';
  let gpuError = null;
  if (wantGpu) {
    try {
      backendLine = await engine.useWebGpu(gpuExpertSlots ?? undefined);
    } catch (e) {
      gpuError = errorOf(e).message;
      if (backend === 'webgpu') throw e;
      // No GPU after all: the CPU cache gets the whole budget again.
      engine.free();
      engine = await open(false);
    }
  }
  // The vision tower: stored like the model, then read whole into the engine (its weights are
  // held in memory, on top of the budget), on whichever backend the engine ended up.
  if (mmproj) {
    const mm = await openSource(mmproj, { crc32, onProgress: (p) => onProgress({ ...p, phase: 'mmproj' }), backing }, 'mmproj');
    try {
      await mm.download();
      engine.loadMmproj((off, len) => mm.readSync(off, len), mm.size);
    } finally {
      mm.close();
    }
  }
  // Keep downloading the rest in the background; generation reads missing blocks on demand.
  if (!model.complete()) {
    const ctl = new AbortController();
    download = {
      ctl,
      promise: model.download(ctl.signal).catch(async (e) => post({ event: 'progress', phase: 'error', error: errorOf(await storageFailure(e)) })),
    };
  }
  return { info: JSON.parse(engine.info()), backend: backendLine, gpuError, loadMs, storage: model.stats, complete: model.complete(), threads };
}

// `split`: a chat reply; each token event also carries `reasoning` and `content`, the reply
// split as harmony (gpt-oss) when it is harmony (HarmonySplit; otherwise content = text).
// `images`: the PNG / JPEG bytes of the images the prompt's media markers stand for (a chat
// with images; the engine encodes those its cache does not hold). A 'started' event follows
// once the prompt is taken.
async function generate({ id, prompt, options, split = false, images = [] }) {
  if (!engine) throw new Error('no model loaded');
  if (generating) throw new Error('a generation is already running');
  generating = true;
  aborted = false;
  const hs = split ? new (await ready).HarmonySplit() : null;
  try {
    let nPrompt;
    if (images?.length) {
      try {
        nPrompt = await engine.beginImages(prompt, images, JSON.stringify(options ?? {}));
      } catch (e) {
        throw await storageFailure(e);
      }
    } else {
      nPrompt = engine.begin(prompt, JSON.stringify(options ?? {}));
    }
    post({ event: 'started', id });
    let text = '';
    const tokens = [];
    for (;;) {
      if (aborted) engine.stop();
      let r;
      try {
        r = await engine.step();
      } catch (e) {
        throw await storageFailure(e);
      }
      if (r.token >= 0) tokens.push(r.token);
      text += r.text;
      const [reasoning, content] = hs ? hs.push(r.text) : [];
      post({ event: 'token', id, token: r.token, text: r.text, reasoning, content });
      if (r.done) break;
      await yieldToEvents();
    }
    if (hs) {
      const [reasoning, content] = hs.finish();
      if (reasoning || content) post({ event: 'token', id, token: -1, text: '', reasoning, content });
    }
    const stats = JSON.parse(engine.stats());
    return { text, tokens, promptTokens: nPrompt, promptReused: stats.prompt_reused ?? 0, finishReason: aborted ? 'abort' : stats.finish_reason ?? 'stop', aborted, stats, reads: reads ? { mode: reads.mode, ...reads.stats } : null, threads };
  } finally {
    hs?.free();
    generating = false;
  }
}

const ops = {
  load,
  generate,
  abort: async () => {
    aborted = true;
    return true;
  },
  stats: async () => ({ engine: engine ? JSON.parse(engine.stats()) : null, profile: profiling ? JSON.parse((await ready).profileTable()) : undefined, threads, storage: model?.stats ?? null, reads: reads ? { mode: reads.mode, ...reads.stats } : null, http: model?.http ? { requests: model.http.requests, bytes: model.http.bytes } : null, complete: model?.complete() ?? null }),
  waitDownload: async () => {
    if (download) await download.promise;
    return { complete: model?.complete() ?? false, storage: model?.stats, http: model?.http ? { requests: model.http.requests, bytes: model.http.bytes } : null };
  },
  chatPrompt: async ({ messages }) => engine.chatPrompt(JSON.stringify(messages)),
  // Tests: a reply given in pieces through HarmonySplit, as generate splits a chat reply.
  debugHarmony: async ({ pieces }) => {
    const hs = new (await (ready ??= loadWasm(true, 1))).HarmonySplit();
    const out = pieces.map((p) => hs.push(p));
    out.push(hs.finish());
    hs.free();
    return out;
  },
  plan: async ({ options }) => {
    if (!engine) throw new Error('no model loaded');
    if (generating) throw new Error('a generation is running');
    return JSON.parse(engine.plan(JSON.stringify(options ?? {})));
  },
  memoryBudget: async () => (engine ? JSON.parse(engine.memoryBudget()) : null),
  setMemoryBudget: async ({ mb }) => {
    if (!engine) throw new Error('no model loaded');
    const bytes = mb === 'minimum' ? JSON.parse(engine.memoryBudget())?.minimum ?? 0 : Number(mb) * 1048576;
    return JSON.parse(engine.setMemoryBudget(bytes));
  },
  resetChat: async () => {
    if (!engine) throw new Error('no model loaded');
    if (generating) throw new Error('a generation is running');
    engine.resetChat();
    return true;
  },
  unload: async () => {
    download?.ctl.abort();
    try {
      engine?.free();
    } catch (e) {
      if (!crashed) throw e; // after a trap the worker is terminated anyway (index.js)
    }
    engine = null;
    reads?.close();
    reads = null;
    model?.close();
    model = null;
    return true;
  },
  // Tests: chunks of a parallel section panic on the pool's workers (threaded build only).
  debugPanicOnAWorker: async () => {
    const m = await ready;
    if (!m?.debugPanicOnAWorker) throw new Error('not the threaded build');
    m.debugPanicOnAWorker();
    return true;
  },
  // Tests: the n-th allocation of at least 64 KiB from now on is refused, once, as a heap that
  // cannot grow would: the allocator gives back its reserve, the engine lowers its budget.
  debugRefuseAlloc: async ({ n }) => {
    (await ready).debugRefuseAlloc(n);
    return true;
  },
  listModels: async () => listModels(),
  deleteModel: async ({ url }) => deleteModel(url),
  storageUsage: async () => storageUsage(),
};

// A trap in the engine's wasm (a Rust panic: the builds abort on panic, and a pool worker's panic
// makes the engine's thread trap too, `par.rs`) leaves the engine unusable: every call in flight
// and every later one fails with `EngineCrashed` instead of waiting forever. A trap inside an
// async step surfaces as an uncaught error or rejection, hence the global listeners.
let crashed = null;
const pending = new Set();
function crash(e) {
  crashed ??= { name: 'EngineCrashed', message: `the engine stopped: ${errorOf(e).message}; create a new engine` };
  for (const id of pending) post({ id, ok: false, error: crashed });
  pending.clear();
}
const isTrap = (e) => e instanceof WebAssembly.RuntimeError;
self.addEventListener('error', (ev) => {
  if (isTrap(ev.error)) {
    ev.preventDefault();
    crash(ev.error);
  }
});
self.addEventListener('unhandledrejection', (ev) => {
  if (isTrap(ev.reason)) {
    ev.preventDefault();
    crash(ev.reason);
  }
});

onmessage = async (ev) => {
  const { id, op } = ev.data;
  pending.add(id);
  try {
    const f = ops[op];
    if (!f) throw new Error(`unknown operation ${op}`);
    if (crashed && op !== 'unload') throw Object.assign(new Error(crashed.message), { name: crashed.name });
    const result = await f(ev.data);
    if (pending.delete(id)) post({ id, ok: true, result });
  } catch (e) {
    if (isTrap(e)) crash(e);
    else if (pending.delete(id)) post({ id, ok: false, error: errorOf(e) });
  }
};

// End-to-end: the demo page in headless Chromium (WebGPU through SwiftShader) against a local
// server with HTTP Range support. References come from the native engine on the same files.
import test from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { startServer } from './server.mjs';
import { launch, runDemo } from './browser.mjs';
import { ROOT, LES, PKG, need, nativeTokens } from './common.mjs';

const SMOLMOE = path.join(ROOT, 'models/smolmoe-32x2.les');
const SMALL = path.join(ROOT, 'models/rand-llama-moe.les');
const PROMPT = 'The three primary colors are';
const SMALL_PROMPT = 'Hello world, this is';

let srv, base;
test.before(async () => {
  need(LES, 'run `cargo build --release --bin les`');
  need(path.join(PKG, 'les_bg.wasm'), 'run `./build.sh web`');
  need(SMOLMOE, 'run `les pack models/smolmoe-32x2.gguf models/smolmoe-32x2.les`');
  need(SMALL, 'run `les pack models/rand-llama-moe.gguf models/rand-llama-moe.les`');
  srv = await startServer();
  base = `http://127.0.0.1:${srv.port}`;
});
test.after(() => srv?.server.close());

const reset = () => fetch(`${base}/__reset`).then((r) => r.json());
const fault = (q) => fetch(`${base}/__fault?${q}`).then((r) => r.json());
const served = () => fetch(`${base}/__stats`).then((r) => r.json());

// SmolMoE-32x2 (1.6 GB) under a 400 MiB budget: the CPU path (wasm) gives the native engine's
// tokens; then, in the same profile, a reload runs from OPFS without a single model request and
// the WebGPU path gives the native wgpu backend's tokens.
test('SmolMoE-32x2 under 400 MiB: CPU and WebGPU paths equal native; reload reads OPFS only', async () => {
  // LES_FULL_TESTS=1 (tools/test_full.sh): the long run; by default fewer tokens (WebGPU runs on
  // SwiftShader and the native reference on lavapipe: the GPU path is the slow one).
  const full = !!process.env.LES_FULL_TESTS;
  const nCpu = full ? 32 : 16, nGpu = full ? 24 : 8;
  const wantCpu = nativeTokens(SMOLMOE, PROMPT, nCpu, ['--memory-budget', '400MiB'], { LES_NO_SIMD: '1' });
  const wantGpu = nativeTokens(SMOLMOE, PROMPT, nGpu, ['--memory-budget', '400MiB', '--backend', 'wgpu']);
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await reset();
    const cpu = await runDemo(page, base, { model: '/models/smolmoe-32x2.les', budget: '400', backend: 'cpu', prompt: PROMPT, n: String(nCpu) });
    assert.equal(cpu.error, null, JSON.stringify(cpu.error));
    assert.equal(cpu.backend, 'cpu (wasm)');
    assert.deepEqual(cpu.last.tokens, wantCpu);
    const plan = await page.evaluate(() => window.les.engine.info.plan);
    // Predicted experts not stored yet were fetched ahead by range (lookahead range fetches).
    const early = await page.evaluate(() => window.les.engine.stats());
    assert.ok(early.storage.hinted > 0, `lookahead range fetches: ${JSON.stringify(early.storage)}`);
    // Generation started before the download reached the blocks it needed.
    assert.ok(early.storage.fetchedOnDemand > 0, `on-demand range fetches: ${JSON.stringify(early.storage)}`);
    assert.ok(plan.budget < fs_size(), 'budget below the model size');
    // The wasm heap holds the budget (dense weights, expert slots, KV cache, scratch), not the model.
    assert.ok(cpu.last.stats.wasm_heap_bytes < 400 * 1048576 + 64 * 1048576, `wasm heap ${cpu.last.stats.wasm_heap_bytes} bytes`);
    const dl = await page.evaluate(() => window.les.engine.waitForDownload());
    assert.equal(dl.complete, true);
    const first = await served();
    assert.ok(first.bytes >= 1643360256 && first.bytes < 1.1 * 1643360256, `downloaded ${first.bytes} bytes once`);

    await reset();
    const gpu = await runDemo(page, base, { model: '/models/smolmoe-32x2.les', budget: '400', backend: 'webgpu', prompt: PROMPT, n: String(nGpu) }, 900_000);
    assert.equal(gpu.error, null, JSON.stringify(gpu.error));
    assert.match(gpu.backend, /^webgpu/);
    assert.deepEqual(gpu.last.tokens, wantGpu);
    assert.equal((await served()).requests, 0, 'the reload read the model from OPFS only');
  } finally {
    await ctx.close();
  }
});

function fs_size() {
  return fs.statSync(SMOLMOE).size;
}

// The seed's family (qwen35moe, and qwen3next: Gated DeltaNet layers between gated attention
// layers): the recurrent state lives in the wasm heap on the CPU path and in GPU buffers on the
// WebGPU path; gpt-oss (sinks, a sliding window of 16 that the 20 tokens run past, YaRN, biased
// MXFP4 experts); smallthinker (the router before attention: each layer names its experts early);
// lfm2moe (short-convolution states, a dense first layer, a biased router).
// Experts streamed from a 10-slot cache. Tokens equal the native engine's on each path.
for (const arch of ['qwen35moe', 'qwen3next', 'gpt-oss', 'smallthinker', 'lfm2moe']) {
  test(`${arch} streamed: CPU and WebGPU paths equal native`, async () => {
    const model = path.join(ROOT, `models/rand-${arch}.les`);
    need(model, `run \`les pack models/rand-${arch}.gguf models/rand-${arch}.les\``);
    const n = arch === 'gpt-oss' ? 20 : 8;
    const wantCpu = nativeTokens(model, SMALL_PROMPT, n, ['--memory-budget', '1GiB'], { LES_NO_SIMD: '1' });
    const wantGpu = nativeTokens(model, SMALL_PROMPT, n, ['--memory-budget', '1GiB', '--backend', 'wgpu']);
    const ctx = await launch();
    try {
      const page = await ctx.newPage();
      for (const [backend, want] of [['cpu', wantCpu], ['webgpu', wantGpu]]) {
        const r = await runDemo(page, base, { model: `/models/rand-${arch}.les`, budget: '64', slots: '10', backend, prompt: SMALL_PROMPT, n: String(n) }, 600_000);
        assert.equal(r.error, null, JSON.stringify(r.error));
        assert.deepEqual(r.last.tokens, want, `${backend} path vs native`);
        if (backend === 'webgpu') {
          // WebGPU's calls per decode token (issue 55): one mapAsync per MoE layer (lfm2moe's
          // dense first layer has none) and one for the logits, one compute pass per submit at
          // most, no clearBuffer.
          const g = r.last.stats.gpu;
          const info = await page.evaluate(() => window.les.engine.info);
          assert.ok(g && g.decode_forwards > 0, JSON.stringify(g));
          assert.equal(g.per_token.readbacks, info.n_moe_layer + 1, JSON.stringify(g.per_token));
          assert.equal(g.per_token.clears, 0, JSON.stringify(g.per_token));
          assert.ok(g.per_token.passes <= g.per_token.submits, JSON.stringify(g.per_token));
        }
      }
    } finally {
      await ctx.close();
    }
  });
}

test('a download cut off midway resumes where it stopped and completes', async () => {
  const size = fs.statSync(SMALL).size;
  const want = nativeTokens(SMALL, SMALL_PROMPT, 16, ['--memory-budget', '1GiB'], { LES_NO_SIMD: '1' });
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await reset();
    // The header and the 16 MB dense part arrive; the connection dies during the experts.
    await fault(`cut=${17_000_000}`);
    await page.goto(`${base}/?model=/models/rand-llama-moe.les&budget=0&backend=cpu`);
    await page.click('#load');
    await page.waitForFunction(() => window.les.error || window.les.progress?.phase === 'error', null, { timeout: 120_000 });
    const cut = await served();
    assert.ok(cut.bytes < size, `only part was served (${cut.bytes} of ${size})`);
    const stored = await page.evaluate(() => window.les.stored ?? 0);
    await fault('cut=0');
    await reset();
    const r = await runDemo(page, base, { model: '/models/rand-llama-moe.les', budget: '0', backend: 'cpu', prompt: SMALL_PROMPT, n: '16' });
    assert.equal(r.error, null, JSON.stringify(r.error));
    assert.deepEqual(r.last.tokens, want);
    const dl = await page.evaluate(() => window.les.engine.waitForDownload());
    assert.equal(dl.complete, true);
    const resumed = await served();
    assert.ok(stored > 0, 'something was stored before the cut');
    assert.ok(resumed.bytes <= size - stored + 1_000_000, `resume fetched ${resumed.bytes} bytes; ${stored} of ${size} were already stored`);
  } finally {
    await ctx.close();
  }
});

test('a corrupted block is detected by its checksum and fetched again', async () => {
  const want = nativeTokens(SMALL, SMALL_PROMPT, 16, ['--memory-budget', '1GiB'], { LES_NO_SIMD: '1' });
  // Flip a byte inside the dense block (its CRC-32 is in the bundle header).
  const head = fs.readFileSync(SMALL).subarray(0, 128);
  const denseOff = Number(head.readBigUInt64LE(48));
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await reset();
    await fault(`corrupt=${denseOff + 12345}`);
    const r = await runDemo(page, base, { model: '/models/rand-llama-moe.les', budget: '0', backend: 'cpu', prompt: SMALL_PROMPT, n: '16' });
    assert.equal(r.error, null, JSON.stringify(r.error));
    assert.deepEqual(r.last.tokens, want);
    const st = await page.evaluate(() => window.les.engine.stats());
    assert.equal(st.storage.checksumFailures, 1);
    const dense = (await served()).ranges.filter(([, s]) => s === denseOff);
    assert.equal(dense.length, 2, 'the dense block was fetched twice');
  } finally {
    await ctx.close();
  }
});

// The engine's reads fill its own memory (`CachedModel.readInto` with a view of the wasm heap). A
// unit not stored yet is fetched and its CRC-32 checked by the engine's wasm first, which may grow
// the wasm memory and so detach that view: then readInto says so (null) and the engine reads a
// fresh copy. Here the check detaches the view itself; bytes compared with the file's.
test('reads into the engine memory: a view detached while a missing unit is fetched falls back to a copy', async () => {
  const bytes = fs.readFileSync(SMALL);
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await page.goto(`${base}/index.html`);
    const r = await page.evaluate(async (base) => {
      const src = `
        import { CachedModel } from '${base}/les/store.js';
        // zlib's CRC-32 (the bundle's block checksums)
        const T = new Uint32Array(256).map((_, n) => { let c = n; for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1; return c >>> 0; });
        const crc = (b) => { let c = ~0; for (const x of b) c = T[(c ^ x) & 255] ^ (c >>> 8); return ~c >>> 0; };
        onmessage = async () => {
          try {
            let detach = null;
            const m = await CachedModel.open('${base}/models/rand-llama-moe.les', { backing: 'opfs', crc32: (b) => { detach?.(); detach = null; return crc(b); } });
            const u = m.units[m.units.length - 1];
            const stored = m.bits[m.units.length - 1];
            const len = Math.min(4096, u.end - u.start);
            const out = new Uint8Array(new ArrayBuffer(len));
            detach = () => out.buffer.transfer();
            const first = m.readInto(u.start, out, len);
            const out2 = new Uint8Array(len);
            const second = m.readInto(u.start, out2, len);
            const copy = m.readSync(u.start, len);
            postMessage({ start: u.start, len, stored, firstNull: first === null, detached: out.byteLength === 0, secondFilled: second === out2, out2: Array.from(out2), copy: Array.from(copy), stats: m.stats });
          } catch (e) { postMessage({ error: String(e) }); }
        };`;
      const w = new Worker(URL.createObjectURL(new Blob([src], { type: 'text/javascript' })), { type: 'module' });
      return await new Promise((res) => { w.onmessage = (e) => res(e.data); w.onerror = (e) => res({ error: e.message }); w.postMessage(0); });
    }, base);
    assert.equal(r.error, undefined, r.error);
    assert.equal(r.stored, 0, 'the unit was not stored before the read');
    assert.ok(r.detached && r.firstNull, 'a detached view is reported, not left unfilled');
    assert.equal(r.stats.fetchedOnDemand, 1);
    const want = Array.from(bytes.subarray(r.start, r.start + r.len));
    assert.ok(r.secondFilled);
    assert.deepEqual(r.out2, want);
    assert.deepEqual(r.copy, want);
  } finally {
    await ctx.close();
  }
});

test('IndexedDB storage (where OPFS is missing): same tokens, and a reload reads IndexedDB only', async () => {
  const want = nativeTokens(SMALL, SMALL_PROMPT, 16, ['--memory-budget', '1GiB'], { LES_NO_SIMD: '1' });
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const q = { model: '/models/rand-llama-moe.les', budget: '0', backend: 'cpu', prompt: SMALL_PROMPT, n: '16', backing: 'indexeddb' };
    let r = await runDemo(page, base, q);
    assert.equal(r.error, null, JSON.stringify(r.error));
    assert.equal(r.progress.backing, 'indexeddb');
    assert.deepEqual(r.last.tokens, want);
    assert.equal((await page.evaluate(() => window.les.engine.waitForDownload())).complete, true);
    await reset();
    r = await runDemo(page, base, q);
    assert.equal(r.error, null, JSON.stringify(r.error));
    assert.deepEqual(r.last.tokens, want);
    assert.equal((await served()).requests, 0, 'the reload read IndexedDB only');
  } finally {
    await ctx.close();
  }
});

test('JS API: abort stops a generation; chat streaming and non-streaming agree; harmony replies split; stats; cache management', async () => {
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const r = await runDemo(page, base, { model: '/models/rand-llama-moe.les', budget: '0', backend: 'cpu', prompt: SMALL_PROMPT, n: '2' });
    assert.equal(r.error, null, JSON.stringify(r.error));
    const out = await page.evaluate(async () => {
      const e = window.les.engine;
      let chunks = 0;
      for await (const _ of e.generate('Once upon a time', { max_tokens: 500, ignore_eos: true })) {
        if (++chunks === 3) e.abort();
      }
      const aborted = e.lastResult;
      const messages = [{ role: 'user', content: 'Name a color.' }];
      let streamed = '';
      let last = null;
      for await (const c of await e.chat.completions.create({ messages, stream: true, max_tokens: 12, temperature: 0 })) {
        streamed += c.choices[0].delta.content ?? '';
        last = c;
      }
      const whole = await e.chat.completions.create({ messages, max_tokens: 12, temperature: 0 });
      const stats = await e.stats();
      // A harmony (gpt-oss) reply in pieces cut inside its tokens, split as chat replies are
      // (llama.cpp tests/test-chat.cpp's GPT-OSS case).
      const pieces = ['<|chan', 'nel|>analysis<|mess', "age|>I'm\nthink", 'ing<|en', "d|><|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?<|ret", 'urn|>'];
      const parts = await e._rpc.call('debugHarmony', { pieces });
      const harmony = [parts.map((p) => p[0]).join(''), parts.map((p) => p[1]).join('')];
      return { aborted: aborted.aborted, n: aborted.tokens.length, streamed, whole, finish: last.choices[0].finish_reason, usage: last.usage, stats, harmony };
    });
    assert.deepEqual(out.harmony, ["I'm\nthinking", "Hello, world!\nWhat's up?"]);
    assert.equal(out.aborted, true);
    assert.ok(out.n >= 3 && out.n < 10, `stopped after ${out.n} tokens`);
    assert.equal(out.whole.object, 'chat.completion');
    assert.equal(out.whole.choices[0].message.content, out.streamed);
    assert.equal(out.usage.completion_tokens, out.whole.usage.completion_tokens);
    assert.ok(['stop', 'length'].includes(out.finish));
    assert.equal(out.stats.engine.gen_tokens, out.whole.usage.completion_tokens);
    assert.equal(out.stats.engine.stream.layers.length, 4);
    // The memory budget changed while a generation runs (issue 39 item 2): down to the minimum
    // after 3 tokens, back up after 6; tokens and logits equal an unchanged run's, and a budget
    // below the minimum is refused with nothing changed.
    const mem = await page.evaluate(async () => {
      const e = window.les.engine;
      const b0 = await e.memoryBudget();
      const run = async (change) => {
        await e.resetChat();
        let i = 0;
        const seen = [];
        for await (const _ of e.generate('The capital of France is', { max_tokens: 10, temperature: 0, ignore_eos: true })) {
          i++;
          if (change && i === 3) seen.push(await e.setMemoryBudget('minimum'));
          if (change && i === 6) seen.push(await e.setMemoryBudget(b0.budget / 1048576));
        }
        return { fnv: e.lastResult.stats.logits_fnv, tokens: e.lastResult.tokens, seen };
      };
      const plain = await run(false);
      const changed = await run(true);
      let refused = null;
      try {
        await e.setMemoryBudget((b0.minimum - 1) / 1048576);
      } catch (x) {
        refused = String(x.message ?? x);
      }
      return { b0, plain, changed, refused, after: await e.memoryBudget(), info: e.info };
    });
    assert.equal(mem.plain.tokens.length, 10);
    assert.deepEqual(mem.changed.tokens, mem.plain.tokens);
    assert.equal(mem.changed.fnv, mem.plain.fnv, 'logits changed with the budget');
    const [low, high] = mem.changed.seen;
    assert.equal(low.budget, mem.b0.minimum);
    assert.equal(low.expert_slots, mem.info.n_expert_used + 1);
    assert.ok(low.expert_bytes_held < mem.b0.expert_bytes_held, JSON.stringify(mem));
    assert.deepEqual([high.budget, high.expert_slots], [mem.b0.budget, mem.b0.expert_slots]);
    assert.match(mem.refused, /minimum/);
    assert.deepEqual(mem.after.budget, mem.b0.budget);
    // An allocation the wasm heap refuses (issue 39 item 2): the allocator gives back its reserve,
    // the generation goes on with the same tokens and logits, and the engine lowers its budget by
    // an eighth and takes a new reserve.
    const oom = await page.evaluate(async () => {
      const e = window.les.engine;
      const before = await e.memoryBudget();
      await e.resetChat();
      await e._rpc.call('debugRefuseAlloc', { n: 3 });
      for await (const _ of e.generate('The capital of France is', { max_tokens: 10, temperature: 0, ignore_eos: true }));
      const r = { before, fnv: e.lastResult.stats.logits_fnv, tokens: e.lastResult.tokens, after: await e.memoryBudget() };
      await e.setMemoryBudget(before.budget / 1048576);
      return r;
    });
    assert.deepEqual(oom.tokens, mem.plain.tokens);
    assert.equal(oom.fnv, mem.plain.fnv, 'logits changed after a refused allocation');
    assert.ok(oom.before.reserve_bytes > 0, JSON.stringify(oom));
    assert.equal(oom.after.reserve_releases, oom.before.reserve_releases + 1, JSON.stringify(oom));
    assert.ok(oom.after.budget < oom.before.budget && oom.after.reserve_bytes > 0, JSON.stringify(oom));
    // engine.plan() (issue 39 item 1): the forecast at the budget now fits with the engine's
    // slots and gives speeds from the last generation; below the minimum it does not fit.
    const fc = await page.evaluate(async (below) => {
      const e = window.les.engine;
      return { now: await e.plan({ store: 'phone-4GBps', promptTokens: 64 }), below: await e.plan({ memoryBudgetMB: below }) };
    }, (mem.b0.minimum - 1) / 1048576);
    assert.equal(fc.now.fits, true, JSON.stringify(fc.now));
    assert.equal(fc.now.plan.slots, mem.b0.expert_slots);
    assert.equal(fc.now.minimum, mem.b0.minimum);
    assert.ok(fc.now.decode_tokens_per_s > 0 && fc.now.prompt_tokens_per_s > 0, JSON.stringify(fc.now));
    assert.match(fc.now.hit_rate_source, /recorded run/);
    assert.equal(fc.below.fits, false);
    assert.match(fc.below.why, /minimum/);
    // engine.shrinkWhenHidden(): the page hidden → the minimum; shown again → the budget before.
    const vis = await page.evaluate(async () => {
      const e = window.les.engine;
      const set = async (state) => {
        Object.defineProperty(document, 'visibilityState', { value: state, configurable: true });
        document.dispatchEvent(new Event('visibilitychange'));
        await (e._hidden?.settled() ?? Promise.resolve());
        return (await e.memoryBudget()).budget;
      };
      e.shrinkWhenHidden();
      const hidden = await set('hidden');
      const shown = await set('visible');
      e.shrinkWhenHidden(false);
      const after = await set('hidden');
      return { hidden, shown, after };
    });
    assert.deepEqual(vis, { hidden: mem.b0.minimum, shown: mem.b0.budget, after: mem.b0.budget });
    // Cache management: list, usage, delete.
    const cache = await page.evaluate(async () => {
      const m = await import('/les/index.js');
      const before = await m.listModels();
      const usage = await m.storageUsage();
      await window.les.engine.unload();
      await m.deleteModel('/models/rand-llama-moe.les');
      return { before, usage, after: await m.listModels() };
    });
    assert.equal(cache.before.length, 1);
    assert.match(cache.before[0].url, /rand-llama-moe\.les$/);
    assert.equal(cache.before[0].size, fs.statSync(SMALL).size);
    assert.ok(cache.usage.usage > 0 && cache.usage.quota > cache.usage.usage);
    assert.deepEqual(cache.after, []);
  } finally {
    await ctx.close();
  }
});

test('a full storage quota is shown to the user and leaves nothing behind', async () => {
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await page.goto(`${base}/`);
    const cdp = await ctx.newCDPSession(page);
    await cdp.send('Storage.overrideQuotaForOrigin', { origin: base, quotaSize: 4 * 1048576 });
    await page.goto(`${base}/?model=/models/rand-llama-moe.les&budget=0&backend=cpu&prompt=hi&n=4&run=1`);
    await page.waitForFunction(() => window.les.error, null, { timeout: 60_000 });
    const shown = await page.textContent('#error');
    assert.match(shown, /Storage full/);
    assert.equal(await page.isVisible('#error'), true);
    const left = await page.evaluate(async () => {
      const root = await navigator.storage.getDirectory();
      const names = [];
      try {
        const d = await root.getDirectoryHandle('les-models');
        for await (const [n] of d.entries()) names.push(n);
      } catch (_) {}
      return names;
    });
    assert.deepEqual(left, []);
  } finally {
    await ctx.close();
  }
});

// The demo's chat keeps its conversation: the second turn sends both turns and the engine runs only
// what follows the first turn's cached tokens; "New chat" (engine.resetChat()) starts over.
test('chat keeps its state: the second turn reuses the first turn, New chat starts over', async () => {
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const r1 = await runDemo(page, base, { model: '/models/rand-llama-moe.les', budget: '0', backend: 'cpu', prompt: 'Hello there', n: '6', chat: '1' });
    assert.equal(r1.error, null, JSON.stringify(r1.error));
    const turn = async (text) => {
      await page.fill('#prompt', text);
      const before = await page.evaluate(() => window.les.messages.length);
      await page.click('#run');
      await page.waitForFunction((n) => !window.les.busy && window.les.messages.length === n + 2, before, { timeout: 120_000 });
      return page.evaluate(() => window.les.last);
    };
    const first = r1.last;
    assert.equal(first.promptReused, 0);
    const second = await turn('Tell me more');
    assert.equal(await page.evaluate(() => window.les.messages.length), 4);
    // Everything the first turn fed (its prompt and reply but the last token) is reused.
    assert.ok(second.promptReused >= first.promptTokens, `reused ${second.promptReused} of ${second.promptTokens}; first prompt ${first.promptTokens}`);
    assert.ok(second.promptTokens > second.promptReused);
    assert.match(await page.textContent('#status'), /reused from the cache/);
    await page.click('#new-chat');
    await page.waitForFunction(() => window.les.messages.length === 0);
    const fresh = await turn('Hello there');
    assert.equal(fresh.promptReused, 0, 'after New chat nothing is reused');
    assert.deepEqual(fresh.tokens, first.tokens, 'a new conversation repeats the first reply');
  } finally {
    await ctx.close();
  }
});

// Lookahead Expert Scheduling in the browser (www/les/io.js, src/wasm/io.rs): on a cross-origin
// isolated page an I/O worker reads predicted experts into shared memory while the engine
// computes (with threads, straight into the expert slots of the shared wasm memory). The policy is the native one, so only timing changes: at caches of 10%, 30% and 60% of
// the expert bytes the logits of every step are bit-identical with prefetch on and off, and the
// tokens equal the native engine's (portable kernels).
test('lookahead in the browser: experts prefetched by an I/O worker, logits equal with prefetch on and off at 10/30/60% of expert bytes', async () => {
  const n = 12;
  const want = nativeTokens(SMALL, SMALL_PROMPT, n, ['--memory-budget', '1GiB'], { LES_NO_SIMD: '1' });
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const q = { model: '/models/rand-llama-moe.les', budget: '64', backend: 'cpu', prompt: SMALL_PROMPT, n: String(n) };
    // Store the model (asynchronous reads serve stored bytes only).
    let r = await runDemo(page, base, { ...q, n: '1' });
    assert.equal(r.error, null, JSON.stringify(r.error));
    await page.evaluate(() => window.les.engine.waitForDownload());
    const info = await page.evaluate(() => window.les.engine.info);
    const all = info.n_layer * info.n_expert;
    let prefetched = 0, used = 0;
    for (const f of [0.1, 0.3, 0.6]) {
      const slots = String(Math.max(info.n_expert_used + 1, Math.round(f * all)));
      // Two threads: the threaded build's wasm memory is shared, so the I/O worker reads
      // straight into the expert slots; one thread: into its own lanes, copied at each layer.
      const on = await runDemo(page, base, { ...q, slots, prefetch: '1', threads: '2' });
      const off = await runDemo(page, base, { ...q, slots, prefetch: '0', threads: '1' });
      for (const x of [on, off]) assert.equal(x.error, null, JSON.stringify(x.error));
      assert.equal((await page.evaluate(() => window.les.engine.info)).plan.slots, Number(slots));
      assert.deepEqual(on.last.tokens, want, `${f}: prefetch on vs native`);
      assert.deepEqual(off.last.tokens, want, `${f}: prefetch off vs native`);
      assert.equal(on.last.stats.logits_fnv, off.last.stats.logits_fnv, `${f}: logits differ with prefetch on and off`);
      assert.match(on.last.stats.reads, /asynchronous reads \(shared, into the slots/);
      assert.equal(on.last.reads.mode, 'shared');
      assert.equal(on.last.reads.failed, 0);
      assert.equal(on.last.reads.direct, on.last.reads.completed, JSON.stringify(on.last.reads));
      assert.equal(off.last.stats.stream.prefetch_loads, 0);
      assert.equal(off.last.reads, null);
      prefetched += on.last.stats.stream.prefetch_loads;
      used += on.last.stats.stream.prefetch_used;
      assert.ok(on.last.reads.completed > 0 && on.last.reads.bytes > 0, JSON.stringify(on.last.reads));
      if (f > 0.5) {
        // One thread: reads copied from the I/O worker's lanes, the same logits. The demo page
        // shows the prefetched experts the router used (of those loaded).
        const onPage = await runDemo(page, base, { ...q, slots, prefetch: '1', threads: '1' });
        assert.equal(onPage.error, null);
        assert.equal(onPage.last.stats.logits_fnv, off.last.stats.logits_fnv, `${f}: logits differ with reads copied`);
        assert.match(onPage.last.stats.reads, /asynchronous reads \(shared, 1 lanes/);
        assert.ok(onPage.last.reads.completed > 0 && onPage.last.reads.direct === 0, JSON.stringify(onPage.last.reads));
        await page.waitForFunction(() => /^\d+ \/ \d+$/.test(document.getElementById('m-prefetch').textContent), null, { timeout: 30_000 });
        const [usedShown, loadedShown] = (await page.textContent('#m-prefetch')).split(' / ').map(Number);
        assert.ok(usedShown > 0 && usedShown <= loadedShown, `demo shows ${usedShown} / ${loadedShown}`);
      }
    }
    // Prefetched experts were loaded and the router used some of them. Whether they raise the hit
    // rate depends on when the worker's reads land (a loaded machine delays them), so that is
    // measured by the browser ladder (tests/e2e/ladder.mjs), not asserted here.
    assert.ok(prefetched > 0 && used > 0, `prefetches loaded ${prefetched}, used ${used}`);
  } finally {
    await ctx.close();
  }
});

// Without cross-origin isolation there is no shared memory: on WebGPU the engine's worker starts
// the reads itself and takes them in at its awaits (every layer's readback); the GPU pool holds the
// budget's experts behind a small CPU staging cache. At caches of 10%, 30% and 60% of the expert
// bytes, logits equal with prefetch on and off, and tokens equal the native wgpu exact path's.
test('lookahead without cross-origin isolation: reads land at the WebGPU awaits, logits unchanged at 10/30/60%', async () => {
  const plain = await startServer(0, { isolated: false });
  const url = `http://127.0.0.1:${plain.port}`;
  const n = 8;
  const want = nativeTokens(SMALL, SMALL_PROMPT, n, ['--memory-budget', '1GiB', '--backend', 'wgpu']);
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const q = { model: '/models/rand-llama-moe.les', budget: '64', backend: 'webgpu', prompt: SMALL_PROMPT, n: String(n) };
    let r = await runDemo(page, url, { ...q, n: '1', backend: 'cpu' });
    assert.equal(r.error, null, JSON.stringify(r.error));
    assert.equal(await page.evaluate(() => self.crossOriginIsolated), false);
    await page.evaluate(() => window.les.engine.waitForDownload());
    const info = await page.evaluate(() => window.les.engine.info);
    const all = info.n_layer * info.n_expert;
    for (const f of [0.1, 0.3, 0.6]) {
      const slots = String(Math.max(info.n_expert_used + 1, Math.round(f * all)));
      const on = await runDemo(page, url, { ...q, slots, prefetch: '1' }, 600_000);
      const off = await runDemo(page, url, { ...q, slots, prefetch: '0' }, 600_000);
      for (const x of [on, off]) assert.equal(x.error, null, JSON.stringify(x.error));
      assert.match(on.backend, /^webgpu/);
      const plan = (await page.evaluate(() => window.les.engine.info)).plan;
      assert.ok(plan.gpu_slots > 0, `a GPU pool under the budget: ${JSON.stringify(plan)}`);
      if (f > 0.5) assert.ok(plan.gpu_slots < plan.slots, `budget split into staging + GPU pool: ${JSON.stringify(plan)}`);
      assert.deepEqual(on.last.tokens, want, `${f}: prefetch on vs native wgpu`);
      assert.deepEqual(off.last.tokens, want, `${f}: prefetch off vs native wgpu`);
      assert.equal(on.last.stats.logits_fnv, off.last.stats.logits_fnv, `${f}: logits differ with prefetch on and off`);
      assert.equal(on.last.reads?.mode, 'local');
      assert.equal(on.last.reads.failed, 0);
    }
  } finally {
    await ctx.close();
    plain.server.close();
  }
});

// Wasm threads (www/les/pkg-mt): on a cross-origin isolated page the CPU kernels run on a pool of
// web workers; each op is split into the same chunks whatever the thread count, so the logits are
// bit-identical to one thread's (and to the native portable kernels' tokens). Without isolation
// the plain build runs one thread and says why.
test('wasm threads: a pool of web workers on isolated pages, same logits as one thread; one thread otherwise; relaxed-SIMD and SIMD128 builds alike', async () => {
  const n = 12;
  const want = nativeTokens(SMALL, SMALL_PROMPT, n, ['--memory-budget', '1GiB'], { LES_NO_SIMD: '1' });
  const plain = await startServer(0, { isolated: false });
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const q = { model: '/models/rand-llama-moe.les', budget: '64', backend: 'cpu', prompt: SMALL_PROMPT, n: String(n) };
    const one = await runDemo(page, base, { ...q, threads: '1' });
    const two = await runDemo(page, base, { ...q, threads: '2' });
    for (const x of [one, two]) assert.equal(x.error, null, JSON.stringify(x.error));
    assert.equal(one.last.threads.n, 1);
    assert.equal(two.last.threads.n, 2);
    assert.equal(two.last.stats.cpu_threads, 2);
    assert.match(two.last.threads.why, /cross-origin isolated/);
    assert.deepEqual(one.last.tokens, want);
    assert.deepEqual(two.last.tokens, want);
    assert.equal(two.last.stats.logits_fnv, one.last.stats.logits_fnv, 'logits differ between 1 and 2 threads');
    // No `threads`: measured at load (a pool of up to 8, at most the cores, timed on 1, 2, …).
    const auto = await runDemo(page, base, q);
    assert.equal(auto.error, null, JSON.stringify(auto.error));
    const hw = await page.evaluate(() => navigator.hardwareConcurrency);
    assert.equal(auto.last.threads.measuredMs.length, Math.min(hw, 8), JSON.stringify(auto.last.threads));
    assert.ok(auto.last.threads.measuredMs.every((t) => t > 0), JSON.stringify(auto.last.threads));
    assert.ok(auto.last.threads.n >= 1 && auto.last.threads.n <= Math.min(hw, 8));
    assert.equal(auto.last.stats.cpu_threads, auto.last.threads.n);
    assert.match(auto.last.threads.why, /measured at load/);
    assert.equal(two.last.threads.measuredMs, null, 'measured although threads were given');
    assert.equal(auto.last.stats.logits_fnv, one.last.stats.logits_fnv, 'logits differ with the measured thread count');
    // Chromium has relaxed SIMD: the default is the relaxed build; `relaxedSimd: false` the other.
    assert.equal(one.last.threads.simd, 'relaxed-simd');
    assert.equal(two.last.threads.simd, 'relaxed-simd');
    for (const t of ['1', '2']) {
      const plainSimd = await runDemo(page, base, { ...q, threads: t, simd: 'simd128' });
      assert.equal(plainSimd.error, null, JSON.stringify(plainSimd.error));
      assert.equal(plainSimd.last.threads.simd, 'simd128');
      assert.deepEqual(plainSimd.last.tokens, want);
      assert.equal(plainSimd.last.stats.logits_fnv, one.last.stats.logits_fnv, `logits differ between the builds (${t} threads)`);
    }
    const alone = await runDemo(page, `http://127.0.0.1:${plain.port}`, { ...q, threads: '2' });
    assert.equal(alone.error, null, JSON.stringify(alone.error));
    assert.equal(alone.last.threads.n, 1);
    assert.match(alone.last.threads.why, /not cross-origin isolated/);
    assert.equal(alone.last.stats.logits_fnv, one.last.stats.logits_fnv);
  } finally {
    await ctx.close();
    plain.server.close();
  }
});

// A generation stopped while prefetches are in flight leaves no half-read expert behind: the
// next run in the same engine (its cache holds whatever the stopped one loaded or had in flight)
// gives the same logits as the first, uninterrupted one.
// The threaded build aborts on panic: a kernel that panics on a pool worker traps that worker, and
// its chunk never completes. The engine's thread must fail too (par.rs's panic hook), and the
// engine answer that call and every later one with EngineCrashed, not wait forever.
test('wasm threads: a kernel panicking on a pool worker ends in an error, not a hang', async () => {
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await page.goto(`${base}/index.html`);
    const r = await page.evaluate(async () => {
      const { createEngine } = await import('/les/index.js');
      const e = await createEngine({ model: '/models/rand-llama-moe.les', backend: 'cpu', threads: 2 });
      const err = (x) => ({ name: x.name, message: x.message });
      const first = await Promise.race([
        e._rpc.call('debugPanicOnAWorker').then(() => ({ name: 'none' }), err),
        new Promise((res) => setTimeout(() => res({ name: 'timeout' }), 60_000)),
      ]);
      if (first.name === 'timeout') {
        e._rpc.worker.terminate();
        return { threads: e.loadInfo.threads, first, after: null };
      }
      let after = { name: 'none' };
      try {
        for await (const _ of e.generate('Hello', { max_tokens: 2 }));
      } catch (x) {
        after = err(x);
      }
      await e.unload();
      return { threads: e.loadInfo.threads, first, after };
    });
    assert.equal(r.threads.n, 2, JSON.stringify(r.threads));
    assert.equal(r.first.name, 'EngineCrashed', JSON.stringify(r.first));
    assert.match(r.first.message, /trapped|unreachable|panicked/);
    assert.equal(r.after?.name, 'EngineCrashed', JSON.stringify(r.after));
  } finally {
    await ctx.close();
  }
});

test('lookahead: abort while prefetches are in flight, the next run is bit-identical', async () => {
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const q = { model: '/models/rand-llama-moe.les', budget: '64', backend: 'cpu', prompt: SMALL_PROMPT, n: '1', slots: '10' };
    let r = await runDemo(page, base, q);
    assert.equal(r.error, null, JSON.stringify(r.error));
    await page.evaluate(() => window.les.engine.waitForDownload());
    r = await runDemo(page, base, q); // a fresh engine over the stored model
    const out = await page.evaluate(async (prompt) => {
      const e = window.les.engine;
      const run = async (abortAt) => {
        let k = 0;
        for await (const _ of e.generate(prompt, { max_tokens: 12, temperature: 0, ignore_eos: true })) if (++k === abortAt) e.abort();
        const x = e.lastResult;
        return { fnv: x.stats.logits_fnv, tokens: x.tokens, prefetched: x.stats.stream.prefetch_loads, submitted: x.reads?.submitted ?? 0 };
      };
      const ref = await run(0);
      await e.resetChat();
      const cut = await run(2);
      await e.resetChat();
      const after = await run(0);
      return { ref, cut, after };
    }, SMALL_PROMPT);
    assert.ok(out.cut.tokens.length < out.ref.tokens.length, JSON.stringify(out.cut));
    assert.ok(out.ref.submitted > 0, 'prefetches were read asynchronously');
    assert.deepEqual(out.after.tokens, out.ref.tokens);
    assert.equal(out.after.fnv, out.ref.fnv, 'logits after an aborted run differ');
  } finally {
    await ctx.close();
  }
});

// A failed prefetch read costs nothing (the expert is read on demand if the router picks it), an
// I/O worker that stops answering is given up on (`ioTimeoutMs`) without changing the output,
// and unloading an engine while its prefetches are in flight ends the generation with an
// AbortError; a new engine over the same stored model then gives the first run's logits.
test('lookahead: failed prefetch reads cost nothing; a hung I/O worker is given up; unload with prefetches in flight', async () => {
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    const q = { model: '/models/rand-llama-moe.les', budget: '64', backend: 'cpu', prompt: SMALL_PROMPT, n: '1' };
    const r = await runDemo(page, base, q);
    assert.equal(r.error, null, JSON.stringify(r.error));
    await page.evaluate(() => window.les.engine.waitForDownload());
    await page.evaluate(() => window.les.engine.unload());
    const out = await page.evaluate(async (prompt) => {
      const { createEngine } = await import('/les/index.js');
      const open = (extra) => createEngine({ model: '/models/rand-llama-moe.les', memoryBudgetMB: 64, backend: 'cpu', expertSlots: 10, ...extra });
      const opts = { max_tokens: 12, temperature: 0, ignore_eos: true };
      const run = async (e) => {
        for await (const _ of e.generate(prompt, opts));
        const x = e.lastResult;
        return { fnv: x.stats.logits_fnv, tokens: x.tokens, failures: x.stats.stream.load_failures, failed: x.reads?.failed ?? 0, submitted: x.reads?.submitted ?? 0 };
      };
      let e = await open({});
      const ref = await run(e);
      await e.unload();
      e = await open({ debugFailReads: 2 });
      const failing = await run(e);
      let k = 0, err = null;
      try {
        for await (const _ of e.generate(prompt, opts)) if (++k === 2) await e.unload();
      } catch (x) {
        err = x.name;
      }
      // An I/O worker that stops answering at its third read: the engine blocks on that read
      // (when it needs the expert, or gives its slot away, or unloads) at most 1.5 s, then stops
      // the worker and reads for itself. The logits stay the same and unloading ends.
      e = await open({ debugStallReads: 3, ioTimeoutMs: 1500 });
      const stalled = await run(e);
      stalled.submitted = e.lastResult.reads?.submitted;
      const t0 = performance.now();
      await e.unload();
      stalled.unloadMs = performance.now() - t0;
      e = await open({});
      const after = await run(e);
      await e.unload();
      return { ref, failing, after, err, stalled };
    }, SMALL_PROMPT);
    assert.ok(out.stalled.submitted >= 3, `the stalled read was never submitted: ${JSON.stringify(out.stalled)}`);
    assert.ok(out.stalled.unloadMs < 10000, `unloading waited ${out.stalled.unloadMs} ms for a hung I/O worker`);
    assert.equal(out.stalled.fnv, out.ref.fnv, 'a stopped I/O worker changed the logits');
    assert.deepEqual(out.stalled.tokens, out.ref.tokens);
    assert.ok(out.ref.submitted > 0, 'prefetches were read asynchronously');
    assert.ok(out.failing.failed > 0 && out.failing.failures > 0, JSON.stringify(out.failing));
    assert.equal(out.failing.fnv, out.ref.fnv, 'failed prefetches changed the logits');
    assert.equal(out.err, 'AbortError');
    assert.equal(out.after.fnv, out.ref.fnv);
    assert.deepEqual(out.after.tokens, out.ref.tokens);
  } finally {
    await ctx.close();
  }
});

// Images (issue 36): a MiniCPM-V 4.6-style vision tower (rand-minicpmv-mmproj) beside its
// qwen35 text tower (rand-qwen35-vl), through the JS chat API: square_224.png as a data: URL with
// "Describe" gives llama-mtmd-cli's greedy tokens (tests/data/vision/refs.json; the first 8, all
// rows of which have top-2 margins above 0.1) on the CPU path and on the WebGPU path (the vision
// tower encodes on the GPU too); the same image again encodes nothing; a truncated PNG rejects
// the call with the decoder's error. CPU path also: the image as a Blob and as an ImageBitmap, a
// remote URL refused, and the demo page's image picker.
test('images: square_224.png + "Describe" through chat.completions equals llama.cpp on the CPU and WebGPU paths; bad images reject', async () => {
  const vl = path.join(ROOT, 'models/rand-qwen35-vl.gguf');
  const mm = path.join(ROOT, 'models/rand-minicpmv-mmproj.gguf');
  for (const f of [vl, mm]) need(f, 'run `tools/build_models.sh small`');
  const dir = path.join(ROOT, 'tests/data/vision');
  const run = JSON.parse(fs.readFileSync(path.join(dir, 'refs.json'), 'utf8')).runs.qwen35.find((r) => r.name === 'square_224');
  const N = 8;
  // Greedy may part from llama.cpp only at a row whose top-2 margin is below 0.1.
  const low = run.rows.slice(0, N).findIndex((r) => r.margin < 0.1);
  const want = run.generated.slice(0, low < 0 ? N : low);
  const dataUrl = (f) => `data:image/png;base64,${fs.readFileSync(path.join(dir, f)).toString('base64')}`;
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await page.goto(`${base}/`);
    const out = await page.evaluate(async ({ png, bad, N }) => {
      const { createEngine } = await import('/les/index.js');
      const res = {};
      for (const backend of ['cpu', 'webgpu']) {
        const e = await createEngine({ model: '/models/rand-qwen35-vl.gguf', mmproj: '/models/rand-minicpmv-mmproj.gguf', backend, memoryBudgetMB: 0, nCtx: 256 });
        const ask = (url, extra = {}) => e.chat.completions.create({ messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url } }, { type: 'text', text: 'Describe' }] }], max_tokens: N, temperature: 0, ...extra });
        const caught = async (f) => {
          try {
            await f();
            return 'resolved';
          } catch (x) {
            return { name: x.name, message: x.message };
          }
        };
        const last = () => ({ tokens: e.lastResult.tokens, reused: e.lastResult.promptReused, images: e.lastResult.stats.images });
        const r = { backend: e.backend, vision: e.info.vision };
        const first = await ask(png);
        r.first = { content: first.choices[0].message.content, usage: first.usage, ...last() };
        let streamed = '';
        for await (const c of await ask(png, { stream: true })) streamed += c.choices[0].delta.content ?? '';
        r.again = { streamed, ...last() };
        r.bad = await caught(() => ask(bad));
        r.badStream = await caught(() => ask(bad, { stream: true }));
        if (backend === 'cpu') {
          const blob = await (await fetch(png)).blob();
          await ask(blob);
          r.blob = last();
          await ask(await createImageBitmap(blob));
          r.bitmap = last();
          r.remote = await caught(() => ask('https://example.com/cat.png'));
        }
        // Text alone still works after a refused image.
        r.text = (await e.chat.completions.create({ messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2, temperature: 0 })).choices[0].message.content;
        await e.unload();
        res[backend] = r;
      }
      return res;
    }, { png: dataUrl('square_224.png'), bad: dataUrl('bad_truncated.png'), N });
    for (const [backend, r] of Object.entries(out)) {
      const at = `${backend} path`;
      assert.match(r.backend, backend === 'cpu' ? /^cpu/ : /^webgpu/, at);
      assert.equal(r.vision.projector, 'minicpmv4_6');
      assert.deepEqual(r.first.tokens.slice(0, want.length), want, `${at} vs llama-mtmd-cli`);
      if (want.length === N) assert.ok(r.first.content && run.text.startsWith(r.first.content), `${at}: ${JSON.stringify(r.first.content)} vs llama.cpp's ${JSON.stringify(run.text)}`);
      assert.equal(r.first.usage.prompt_tokens, run.n_tokens_total, at);
      assert.deepEqual(r.first.images, { ...r.first.images, image_rows: 16, encoded: 1 }, at);
      // The same conversation again: everything but the last token reused, the image not encoded.
      assert.equal(r.again.streamed, r.first.content, at);
      assert.deepEqual(r.again.tokens, r.first.tokens, at);
      assert.equal(r.again.reused, run.n_tokens_total - 1, at);
      assert.equal(r.again.images.encoded, 0, at);
      for (const b of [r.bad, r.badStream]) {
        assert.equal(b.name, 'LesError', `${at}: ${JSON.stringify(b)}`);
        assert.match(b.message, /the image could not be decoded/, at);
      }
      assert.equal(typeof r.text, 'string');
    }
    const cpu = out.cpu;
    // A Blob of the same bytes is the same image (known by its bytes: nothing encoded again).
    assert.deepEqual(cpu.blob.tokens, cpu.first.tokens);
    assert.equal(cpu.blob.images.encoded, 0);
    // An ImageBitmap, drawn to PNG: the same pixels, so the same tokens.
    assert.deepEqual(cpu.bitmap.tokens, cpu.first.tokens);
    assert.equal(cpu.remote.name, 'TypeError');
    assert.match(cpu.remote.message, /fetches nothing/);

    // The demo page: the image picker, its thumbnail in the conversation, the reply.
    await page.goto(`${base}/?model=/models/rand-qwen35-vl.gguf&mmproj=/models/rand-minicpmv-mmproj.gguf&budget=0&backend=cpu&chat=1&prompt=Describe&n=${N}`);
    await page.setInputFiles('#image', path.join(dir, 'square_224.png'));
    await page.click('#run');
    await page.waitForFunction(() => (!window.les.busy && window.les.messages.length === 2) || window.les.error, null, { timeout: 120_000 });
    const demo = await page.evaluate(() => ({ error: window.les.error, tokens: window.les.last?.tokens, thumbs: document.querySelectorAll('#output img.thumb').length, status: document.getElementById('status').textContent }));
    assert.equal(demo.error, null, JSON.stringify(demo.error));
    assert.deepEqual(demo.tokens, cpu.first.tokens);
    assert.equal(demo.thumbs, 1);
    assert.match(demo.status, /images: 16 embedding rows/);
  } finally {
    await ctx.close();
  }
});

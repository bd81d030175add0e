// Browser benchmarks (BENCHMARKS.md, "Browser"): node tests/e2e/bench.mjs [n_tokens] [--io-only]
//  1. OPFS read throughput (FileSystemSyncAccessHandle in a worker) against native file reads
//     (pread through Node's fs) of the same expert-sized blocks of the same model, page cache warm.
//  2. Decode tokens/s of SmolMoE-32x2 under 400 MiB: browser WebGPU (SwiftShader) and CPU (wasm)
//     against the native engine (wgpu on lavapipe, and the CPU), same machine, same run.
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer } from './server.mjs';
import { launch, runDemo } from './browser.mjs';
import { ROOT, LES } from './common.mjs';

const n = process.argv[2] ?? '32';
const model = path.join(ROOT, 'models/smolmoe-32x2.les');
const prompt = 'The three primary colors are';
const size = fs.statSync(model).size;
const BLOCK = 1658880; // one SmolMoE-32x2 expert (gate + up + down) in bytes
const READS = 400;
// The same pseudo-random 4 KiB-aligned offsets for both readers.
const offsets = Array.from({ length: READS }, (_, i) => Math.floor((((i * 2654435761) >>> 0) / 4294967296) * ((size - BLOCK) / 4096)) * 4096);

// LES's own native reader (FileSource, pread), same offsets.
function lesReads(cold = false) {
  const f = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'les-bench-')), 'offsets.txt');
  fs.writeFileSync(f, offsets.join('\n'));
  if (cold) dropCaches();
  return Number(execFileSync(path.join(ROOT, 'target/release/examples/read_bench'), [model, String(BLOCK), f, ...(cold ? ['cold'] : [])]).toString().trim());
}

// Cold reads need an empty page cache: root only (`/proc/sys/vm/drop_caches`).
function dropCaches() {
  execFileSync('sync');
  fs.writeFileSync('/proc/sys/vm/drop_caches', '3');
}
let canDrop = true;
try { fs.accessSync('/proc/sys/vm/drop_caches', fs.constants.W_OK); } catch (_) { canDrop = false; }

function nativeReads() {
  const fd = fs.openSync(model, 'r');
  const buf = Buffer.alloc(BLOCK);
  for (const o of offsets.slice(0, 50)) fs.readSync(fd, buf, 0, BLOCK, o); // warm
  const t0 = performance.now();
  for (const o of offsets) fs.readSync(fd, buf, 0, BLOCK, o);
  const ms = performance.now() - t0;
  fs.closeSync(fd);
  return (READS * BLOCK) / 1e6 / (ms / 1000);
}

function nativeDecode(extra, env = {}) {
  const p = spawnSync(LES, ['run', '--model', model, '--memory-budget', '400MiB', '--prompt', prompt, '-n', n, '--temp', '0', '--ignore-eos', ...extra], { env: { ...process.env, ...env } });
  const err = p.stderr.toString();
  const m = /decode (\d+) tokens, ([\d.]+) tokens\/s/.exec(err);
  return Number(m[2]);
}

const { server, port } = await startServer();
const base = `http://127.0.0.1:${port}`;
const ctx = await launch();
const rows = [];
try {
  const page = await ctx.newPage();
  // Store the model in OPFS (one full run, then wait for the download).
  let r = await runDemo(page, base, { model: '/models/smolmoe-32x2.les', budget: '400', backend: 'cpu', prompt, n: '4' });
  if (r.error) throw new Error(JSON.stringify(r.error));
  await page.evaluate(() => window.les.engine.waitForDownload());
  await page.evaluate(() => window.les.engine.unload());
  const opfsRead = (warm) => page.evaluate(async ({ offsets, BLOCK, warm }) => {
    const src = `onmessage = async (e) => {
      const { offsets, BLOCK, warm } = e.data;
      const root = await (await navigator.storage.getDirectory()).getDirectoryHandle('les-models');
      let dir = null;
      for await (const [name, h] of root.entries()) if (name.startsWith('smolmoe-32x2.les')) dir = h;
      const fh = await (await dir.getFileHandle('data')).createSyncAccessHandle({ mode: 'read-only' }).catch(() => dir.getFileHandle('data').then((f) => f.createSyncAccessHandle()));
      const buf = new Uint8Array(BLOCK);
      for (const o of offsets.slice(0, warm)) fh.read(buf, { at: o });
      let got = 0;
      const t0 = performance.now();
      for (const o of offsets) got += fh.read(buf, { at: o });
      const ms = performance.now() - t0;
      fh.close();
      if (got !== offsets.length * BLOCK) throw new Error('short OPFS reads: ' + got);
      postMessage((offsets.length * BLOCK) / 1e6 / (ms / 1000));
    };`;
    const w = new Worker(URL.createObjectURL(new Blob([src], { type: 'text/javascript' })));
    const res = new Promise((ok) => (w.onmessage = (e) => ok(e.data)));
    w.postMessage({ offsets, BLOCK, warm });
    return res;
  }, { offsets, BLOCK, warm });
  const opfs = await opfsRead(50);
  const nat = nativeReads();
  const les = lesReads();
  if (canDrop) {
    dropCaches();
    const opfsCold = await opfsRead(0);
    const lesCold = lesReads(true);
    console.log(`| random ${(BLOCK / 1048576).toFixed(2)} MiB reads (${READS}), page cache dropped | OPFS sync handle (Chromium worker) ${opfsCold.toFixed(0)} MB/s | LES FileSource (pread) ${lesCold.toFixed(0)} MB/s | | OPFS / LES ${(opfsCold / lesCold).toFixed(2)} |`);
  }
  console.log(`| random ${(BLOCK / 1048576).toFixed(2)} MiB reads (${READS}), page cache warm | OPFS sync handle (Chromium worker) ${opfs.toFixed(0)} MB/s | LES FileSource (pread) ${les.toFixed(0)} MB/s | Node fs.readSync ${nat.toFixed(0)} MB/s | OPFS / LES ${(opfs / les).toFixed(2)} |`);

  for (const backend of process.argv.includes('--io-only') ? [] : ['cpu', 'webgpu']) {
    r = await runDemo(page, base, { model: '/models/smolmoe-32x2.les', budget: '400', backend, prompt, n }, 1_800_000);
    if (r.error) throw new Error(JSON.stringify(r.error));
    rows.push([`browser ${backend === 'cpu' ? 'CPU (wasm SIMD128, 1 thread)' : 'WebGPU (SwiftShader)'}`, r.last.stats.tokens_per_s, r.last.stats.hit_rate]);
    console.log(`| ${rows.at(-1)[0]} | ${rows.at(-1)[1].toFixed(2)} tokens/s |`);
    await page.evaluate(() => window.les.engine.unload());
  }
} finally {
  await ctx.close();
  server.close();
}
if (!process.argv.includes('--io-only')) {
rows.push(['native CPU (AVX2, 2 threads)', nativeDecode(['--backend', 'cpu'])]);
rows.push(['native CPU (portable kernels, 1 thread)', nativeDecode(['--backend', 'cpu', '-t', '1'], { LES_NO_SIMD: '1' })]);
rows.push(['native wgpu (lavapipe)', nativeDecode(['--backend', 'wgpu'])]);
for (const [name, tps] of rows.slice(2)) console.log(`| ${name} | ${tps.toFixed(2)} tokens/s |`);
}

// The browser ladder (issue 16; BENCHMARKS.md "Browser ladder"): on-demand → + lookahead →
// + next-use eviction → + bundle, in headless Chromium with the model in OPFS, beside the native
// `les bench ladder` on the same files, budget and device profile, interleaved and repeated.
//
//   node tests/e2e/ladder.mjs [--store phone-4GBps|phone-1.5GBps|laptop-nvme|disk] [--backend cpu|webgpu]
//                             [-n 24] [--repeat 2] [--budget 400] [--threads 1] [--lanes N]
// --threads: CPU threads on both sides (the browser's threaded build when > 1).
//
// Every rung runs in a fresh worker (a cold expert cache), decode-only figures (after the
// prompt's step), as the native ladder counts them. The page is cross-origin isolated (the test
// server sends COOP/COEP), so prefetches go through the I/O worker and the modelled device is
// shared by both workers (www/les/device.js).
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer } from './server.mjs';
import { launch, runDemo } from './browser.mjs';
import { ROOT, LES, need } from './common.mjs';

const arg = (name, dflt) => {
  const i = process.argv.indexOf(name);
  return i > 0 ? process.argv[i + 1] : dflt;
};
const store = arg('--store', 'phone-4GBps');
const backend = arg('--backend', 'cpu');
const n = Number(arg('-n', backend === 'cpu' ? '24' : '8'));
const repeat = Number(arg('--repeat', '2'));
const budget = arg('--budget', '400');
const threads = arg('--threads', '1');
const lanes = arg('--lanes', null); // asynchronous prefetch reads in flight (default: the engine's)
const GGUF = 'smolmoe-32x2.gguf', BUNDLE = 'smolmoe-32x2.les';
for (const f of [GGUF, BUNDLE]) need(path.join(ROOT, 'models', f), 'run `./build.sh models` and `les pack`');
need(LES, 'run `cargo build --release --bin les`');
// The native ladder's first prompt.
const prompt = fs.readFileSync(path.join(ROOT, 'tests/fixtures/prompts.txt'), 'utf8').split('\n').find((l) => l.trim());

const RUNGS = [
  ['on-demand', GGUF, '0', 'lru'],
  ['+ lookahead', GGUF, '1', 'lru'],
  ['+ next-use eviction', GGUF, '1', 'next-use'],
  ['+ bundle', BUNDLE, '1', 'next-use'],
];

function native() {
  const out = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'les-ladder-')), 'ladder.json');
  execFileSync(LES, ['bench', 'ladder', '--model', path.join(ROOT, 'models', GGUF), '--bundle', path.join(ROOT, 'models', BUNDLE), '--memory-budget', `${budget}MiB`, '--store', store, '-t', threads, '-n', String(n), '--n-prompts', '1', '--prompts', path.join(ROOT, 'tests/fixtures/prompts.txt'), '--no-resident', '--backend', backend === 'cpu' ? 'cpu' : 'wgpu', '--stats-json', out], { stdio: ['ignore', 'ignore', 'inherit'] });
  const rep = JSON.parse(fs.readFileSync(out, 'utf8'));
  return Object.fromEntries(rep.rungs.map((r) => [r.name, { tps: r.tokens_per_s, hit: r.hit_rate, mb: r.mb_read_per_token, stall: r.stall_ms_per_token }]));
}

const { server, port } = await startServer();
const base = `http://127.0.0.1:${port}`;
const ctx = await launch();
const browser = {}, nat = {};
const push = (o, k, v) => (o[k] ??= []).push(v);
let reads = null;
try {
  const page = await ctx.newPage();
  // Store both files in OPFS.
  for (const f of [GGUF, BUNDLE]) {
    const r = await runDemo(page, base, { model: `/models/${f}`, budget, backend: 'cpu', prompt, n: '1' });
    if (r.error) throw new Error(JSON.stringify(r.error));
    await page.evaluate(() => window.les.engine.waitForDownload());
  }
  for (let rep = 0; rep < repeat; rep++) {
    for (const [name, file, prefetch, policy] of RUNGS) {
      const q = { model: `/models/${file}`, budget, backend, prompt, n: String(n), prefetch, policy, ...(store === 'disk' ? {} : { store }), ...(lanes ? { lanes } : {}), threads };
      const r = await runDemo(page, base, q, 3_600_000);
      if (r.error) throw new Error(`${name}: ${JSON.stringify(r.error)}`);
      const s = r.last.stats;
      const steps = Math.max(1, s.gen_tokens - 1);
      push(browser, name, { tps: s.tokens_per_s, hit: s.hit_rate, mb: s.decode.bytes_read / steps / 1e6, stall: s.decode.stall_ms / steps });
      if (prefetch === '1') reads = r.last.stats.reads;
      process.stderr.write(`browser ${name}: ${s.tokens_per_s.toFixed(2)} tok/s\n`);
    }
    for (const [k, v] of Object.entries(native())) push(nat, k, v);
  }
} finally {
  await ctx.close();
  server.close();
}

const mean = (xs, f) => xs.reduce((a, x) => a + f(x), 0) / xs.length;
const sd = (xs, f) => {
  const m = mean(xs, f);
  return Math.sqrt(xs.reduce((a, x) => a + (f(x) - m) ** 2, 0) / Math.max(1, xs.length - 1));
};
const cpu = fs.readFileSync('/proc/cpuinfo', 'utf8').match(/model name\s*:\s*(.*)/)?.[1] ?? os.cpus()[0]?.model;
console.log(`SmolMoE-32x2 at ${budget} MiB, store ${store}, ${backend === 'cpu' ? `browser CPU (wasm, ${threads} thread(s)) vs native CPU -t ${threads}` : 'browser WebGPU (SwiftShader) vs native wgpu (lavapipe)'}, ${n} tokens, ${repeat} interleaved runs, ${cpu}; browser reads: ${reads}`);
console.log('| rung | browser tok/s | × on-demand | hit rate | MB/token | stall ms/token | native tok/s | × on-demand | hit rate | MB/token | stall ms/token |');
console.log('|---|---|---|---|---|---|---|---|---|---|---|');
const b0 = mean(browser['on-demand'], (x) => x.tps), n0 = mean(nat['on-demand'], (x) => x.tps);
for (const [name] of RUNGS) {
  const b = browser[name], v = nat[name];
  const bt = mean(b, (x) => x.tps), nt = mean(v, (x) => x.tps);
  console.log(`| ${name} | ${bt.toFixed(2)} ± ${sd(b, (x) => x.tps).toFixed(2)} | ${(bt / b0).toFixed(2)} | ${(100 * mean(b, (x) => x.hit)).toFixed(1)}% | ${mean(b, (x) => x.mb).toFixed(1)} | ${mean(b, (x) => x.stall).toFixed(1)} | ${nt.toFixed(2)} ± ${sd(v, (x) => x.tps).toFixed(2)} | ${(nt / n0).toFixed(2)} | ${(100 * mean(v, (x) => x.hit)).toFixed(1)}% | ${mean(v, (x) => x.mb).toFixed(1)} | ${mean(v, (x) => x.stall).toFixed(1)} |`);
}

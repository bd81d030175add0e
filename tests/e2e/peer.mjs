// The browser peer benchmark (issue 38; BENCHMARKS.md "Browser: LES vs wllama"): wllama (llama.cpp
// compiled to wasm, npm @wllama/wllama, pinned below) and LES in the same headless Chromium, on the
// same cross-origin isolated origin, the same GGUF and prompt, greedy, alternating A B A B, at each
// thread count.
//   node tests/e2e/peer.mjs [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--n 64]
//                           [--rounds 3] [--threads 1,2] [--simd128] [--long]
//                           [--budget-bundle models/smolmoe-32x2.les --budget 400]
// --budget-bundle models/X.les --budget MB adds LES streaming that bundle under a memory budget
// (what wllama, which holds the whole file in memory, cannot do) to the rotation.
// --simd128 adds LES's SIMD128 build (createEngine({relaxedSimd: false})) to the rotation beside
// LES's default build (relaxed SIMD where the browser has it) and prints their ratio too.
// Installs @wllama/wllama@WLLAMA into tests/e2e/node_modules (`npm install --no-save`) when it is
// missing. Each round and engine: a fresh engine loads the model (both keep the file in their
// browser storage after the first round, so later loads are warm), runs the prompt and decodes n
// tokens greedily with end-of-generation ignored. Prints per round and the medians: load ms, prompt
// tokens/s and decode tokens/s as each engine reports them (LES: `lastResult.stats`; wllama: the
// response's `timings`, llama.cpp's own), the LES/wllama ratios, and whether the texts agree.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer } from './server.mjs';
import { launch } from './browser.mjs';
import { ROOT, need, LONG_PROMPT, SHORT_PROMPT } from './common.mjs';

const WLLAMA = '3.13.0';
const arg = (name, def) => {
  const i = process.argv.indexOf(`--${name}`);
  return i < 0 ? def : process.argv[i + 1];
};
const model = arg('model', 'models/SmolLM2-135M-Instruct.Q4_1.gguf');
const n = Number(arg('n', '64'));
const rounds = Number(arg('rounds', '3'));
const threads = arg('threads', '1,2').split(',').map(Number);
const bundle = arg('budget-bundle', null);
const budget = Number(arg('budget', '0'));
const engines = ['les', 'wllama', ...(process.argv.includes('--simd128') ? ['les-simd128'] : []), ...(bundle ? ['les-budget'] : [])];
if (bundle) need(path.resolve(ROOT, bundle), 'run les pack');
// --long: a ~200-token prompt (a paragraph, then the same question), so prompt tokens/s measure
// prompt processing rather than per-call overhead.
const prompt = (process.argv.includes('--long') ? LONG_PROMPT : '') + SHORT_PROMPT;
need(path.resolve(ROOT, model), 'run ./build.sh models (or tools/fetch_models.sh)');
if (!model.startsWith('models/')) throw new Error('--model must be under models/ (served at /models/)');
need(path.join(ROOT, 'www/les/pkg-mt/les_bg.wasm'), 'run ./build.sh web');

const E2E = path.join(ROOT, 'tests/e2e');
const wdir = path.join(E2E, 'node_modules/@wllama/wllama');
const installed = fs.existsSync(path.join(wdir, 'package.json')) && JSON.parse(fs.readFileSync(path.join(wdir, 'package.json'))).version;
if (installed !== WLLAMA) execFileSync('npm', ['install', '--no-save', `@wllama/wllama@${WLLAMA}`], { cwd: E2E, stdio: 'inherit' });

// One origin serving both: /les/ (www/les), /wllama/ (the package's esm build), /models/.
const site = fs.mkdtempSync(path.join(os.tmpdir(), 'les-peer-'));
fs.symlinkSync(path.join(ROOT, 'www/les'), path.join(site, 'les'));
fs.symlinkSync(path.join(wdir, 'esm'), path.join(site, 'wllama'));
fs.writeFileSync(path.join(site, 'index.html'), '<!doctype html><meta charset="utf-8"><title>LES vs wllama</title>');

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};

async function les(page, t, relaxedSimd = true, budgeted = false) {
  return page.evaluate(async ({ url, t, prompt, n, relaxedSimd, budget }) => {
    const t0 = performance.now();
    const { createEngine } = await import('/les/index.js');
    const e = await createEngine({ model: url, backend: 'cpu', memoryBudgetMB: budget, nCtx: 512, threads: t, relaxedSimd });
    await e.waitForDownload();
    const load = performance.now() - t0;
    let text = '';
    for await (const s of e.generate(prompt, { max_tokens: n, temperature: 0, ignore_eos: true })) text += s;
    const s = e.lastResult.stats;
    const threads = (await e.stats()).threads;
    await e.unload();
    return { load, text, prompt_tps: (s.prompt_tokens / s.prompt_ms) * 1000, decode_tps: s.tokens_per_s, tokens: s.gen_tokens, threads };
  }, { url: `/${budgeted ? bundle : model}`, t, prompt, n, relaxedSimd, budget: budgeted ? budget : 0 });
}

async function wllama(page, t) {
  return page.evaluate(async ({ url, t, prompt, n }) => {
    const t0 = performance.now();
    const { Wllama } = await import('/wllama/index.js');
    const w = new Wllama({ default: '/wllama/wasm/wllama.wasm' });
    await w.loadModelFromUrl(new URL(url, location.href).href, { n_threads: t, n_ctx: 512 });
    const load = performance.now() - t0;
    const r = await w.createCompletion({ prompt, max_tokens: n, temperature: 0, temp: 0, ignore_eos: true });
    const threads = w.getNumThreads();
    await w.exit();
    const tm = r.timings;
    return { load, text: r.choices[0].text, prompt_tps: tm.prompt_per_second, decode_tps: tm.predicted_per_second, tokens: tm.predicted_n, threads };
  }, { url: `/${model}`, t, prompt, n });
}

const { server, port } = await startServer(0, { root: site });
const ctx = await launch();
const table = [];
try {
  const page = await ctx.newPage();
  page.on('console', (m) => process.env.VERBOSE && console.error('page:', m.text()));
  await page.goto(`http://127.0.0.1:${port}/`);
  if (!(await page.evaluate(() => crossOriginIsolated))) throw new Error('the page is not cross-origin isolated');
  for (const t of threads) {
    const runs = Object.fromEntries(engines.map((e) => [e, []]));
    for (let r = 0; r < rounds; r++) {
      // A B A B (A B C, B C A, ... with --simd128): the first engine rotating round by round.
      const order = engines.map((_, i) => engines[(i + r) % engines.length]);
      for (const who of order) {
        const x = who === 'wllama' ? await wllama(page, t) : await les(page, t, who !== 'les-simd128', who === 'les-budget');
        runs[who].push(x);
        console.error(`threads ${t} round ${r} ${who}: load ${x.load.toFixed(0)} ms, prompt ${x.prompt_tps.toFixed(1)} t/s, decode ${x.decode_tps.toFixed(2)} t/s (${x.tokens} tokens, threads ${JSON.stringify(x.threads)}) ${JSON.stringify(x.text.slice(0, 60))}`);
      }
    }
    const m = (who, k) => median(runs[who].map((x) => x[k]));
    const same = runs.les.every((x, i) => x.text === runs.wllama[i].text);
    const simd128 = runs['les-simd128'] ? { prompt: m('les-simd128', 'prompt_tps'), decode: m('les-simd128', 'decode_tps'), same: runs['les-simd128'].every((x, i) => x.text === runs.les[i].text), simd: runs.les[0].threads.simd } : null;
    const budgeted = runs['les-budget'] ? { load: m('les-budget', 'load'), prompt: m('les-budget', 'prompt_tps'), decode: m('les-budget', 'decode_tps') } : null;
    table.push({ t, budgeted, les: { load: m('les', 'load'), prompt: m('les', 'prompt_tps'), decode: m('les', 'decode_tps') }, wllama: { load: m('wllama', 'load'), prompt: m('wllama', 'prompt_tps'), decode: m('wllama', 'decode_tps') }, simd128, same, lesText: runs.les[0].text, wllamaText: runs.wllama[0].text });
  }
} finally {
  await ctx.close();
  server.close();
  fs.rmSync(site, { recursive: true, force: true });
}
console.log(`\n${model}, ${n} tokens greedy, ${rounds} rounds alternating, medians (wllama ${WLLAMA})\n`);
console.log('| threads | LES load (ms) | wllama load (ms) | LES prompt (t/s) | wllama prompt (t/s) | prompt LES/wllama | LES decode (t/s) | wllama decode (t/s) | decode LES/wllama | same text |');
console.log('|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|');
for (const r of table) {
  console.log(`| ${r.t} | ${r.les.load.toFixed(0)} | ${r.wllama.load.toFixed(0)} | ${r.les.prompt.toFixed(1)} | ${r.wllama.prompt.toFixed(1)} | ${(r.les.prompt / r.wllama.prompt).toFixed(2)}× | ${r.les.decode.toFixed(2)} | ${r.wllama.decode.toFixed(2)} | ${(r.les.decode / r.wllama.decode).toFixed(2)}× | ${r.same ? 'yes' : 'no'} |`);
  if (!r.same) console.log(`  LES: ${JSON.stringify(r.lesText)}\n  wllama: ${JSON.stringify(r.wllamaText)}`);
}
if (table[0]?.simd128) {
  console.log(`\nLES's default build (${table[0].simd128.simd}) against its SIMD128 build, same rounds\n`);
  console.log('| threads | prompt default (t/s) | prompt SIMD128 (t/s) | prompt ratio | decode default (t/s) | decode SIMD128 (t/s) | decode ratio | same text |');
  console.log('|---:|---:|---:|---:|---:|---:|---:|---|');
  for (const r of table) {
    const b = r.simd128;
    console.log(`| ${r.t} | ${r.les.prompt.toFixed(1)} | ${b.prompt.toFixed(1)} | ${(r.les.prompt / b.prompt).toFixed(2)}× | ${r.les.decode.toFixed(2)} | ${b.decode.toFixed(2)} | ${(r.les.decode / b.decode).toFixed(2)}× | ${b.same ? 'yes' : 'no'} |`);
  }
}
if (table[0]?.budgeted) {
  console.log(`\nLES streaming ${bundle} under ${budget} MiB against wllama holding ${model}, same rounds\n`);
  console.log('| threads | LES load (ms) | LES prompt (t/s) | prompt / wllama | LES decode (t/s) | decode / wllama |');
  console.log('|---:|---:|---:|---:|---:|---:|');
  for (const r of table) {
    const b = r.budgeted;
    console.log(`| ${r.t} | ${b.load.toFixed(0)} | ${b.prompt.toFixed(1)} | ${(b.prompt / r.wllama.prompt).toFixed(2)}× | ${b.decode.toFixed(2)} | ${(b.decode / r.wllama.decode).toFixed(2)}× |`);
  }
}

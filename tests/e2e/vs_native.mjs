// Browser CPU decode against native `les run` on the same machine (issue 38's goal: ≥ 0.5× at the
// same thread count), and the thread counts against each other (the default's evidence): each
// round runs every thread count, browser and native alternating; medians.
//   node tests/e2e/vs_native.mjs [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--budget 0]
//                                [--threads 1,2] [--rounds 3] [--n 64] [--store phone-4GBps]
//                                [--copy-reads]
// The browser runs `createEngine({threads: T})` (the default build: relaxed SIMD where Chromium
// has it; a fresh engine per round, the model warm in OPFS) on a cross-origin isolated page; `--budget MB` streams experts from OPFS (a
// `.les` bundle) as native `--memory-budget MB` streams them from the file. Native: `$LES_BIN_DIR/les`
// (default target/release), `-t T`. Prints decode tokens/s of both and the ratio, and whether the
// greedy tokens agree (the wasm build computes the native portable kernels' bits; native x86 takes
// its AVX2 kernels, so texts may part where margins are close). `--copy-reads` (with `--budget`)
// adds a browser run whose I/O worker reads into its own buffer, copied into the slots when taken
// (`createEngine({directReads: false})`), to the rotation: the threaded build's direct reads
// against the copy, same rounds.
import { spawnSync } from 'node:child_process';
import path from 'node:path';
import { startServer } from './server.mjs';
import { launch } from './browser.mjs';
import { ROOT, LES, need } from './common.mjs';

const arg = (name, def) => {
  const i = process.argv.indexOf(`--${name}`);
  return i < 0 ? def : process.argv[i + 1];
};
const model = arg('model', 'models/SmolLM2-135M-Instruct.Q4_1.gguf');
const budget = Number(arg('budget', '0'));
const threads = arg('threads', '1,2').split(',').map(Number);
const rounds = Number(arg('rounds', '3'));
const n = arg('n', '64');
const store = arg('store', null);
const copyReads = process.argv.includes('--copy-reads');
const prompt = 'The three primary colors are';
need(path.resolve(ROOT, model), 'run ./build.sh models');
need(LES, 'build les (cargo build --release --bin les)');

function native(t) {
  const extra = budget ? ['--memory-budget', `${budget}MiB`] : [];
  if (store) extra.push('--store', store);
  const p = spawnSync(LES, ['run', '--model', path.resolve(ROOT, model), '--prompt', prompt, '-n', n, '--temp', '0', '--ignore-eos', '--backend', 'cpu', '-t', String(t), ...extra]);
  const m = /decode (\d+) tokens, ([\d.]+) tokens\/s/.exec(p.stderr.toString());
  if (!m) throw new Error(`les run: ${p.stderr.toString().slice(-400)}`);
  return Number(m[2]);
}

const { server, port } = await startServer();
const base = `http://127.0.0.1:${port}`;
const ctx = await launch();
const table = [];
try {
  const page = await ctx.newPage();
  await page.goto(`${base}/index.html`);
  const browser = (t, directReads = true) => page.evaluate(async ({ url, budget, t, prompt, n, store, directReads }) => {
    const { createEngine } = await import('/les/index.js');
    const e = await createEngine({ model: url, backend: 'cpu', memoryBudgetMB: budget, nCtx: 512, threads: t, directReads, ...(store ? { store } : {}) });
    await e.waitForDownload?.();
    for await (const _ of e.generate(prompt, { max_tokens: Number(n), temperature: 0, ignore_eos: true }));
    const reads = e.lastResult.reads;
    const r = { tps: e.lastResult.stats.tokens_per_s, simd: e.lastResult.threads.simd, n: e.lastResult.threads.n, direct: reads ? `${reads.direct} of ${reads.completed} reads direct` : 'no reads' };
    await e.unload();
    return r;
  }, { url: `/${model}`, budget, t, prompt, n, store, directReads });
  await browser(threads[0]); // stores the model in OPFS
  // Every round runs each thread count (rotating their order), browser and native alternating.
  const per = () => Object.fromEntries(threads.map((t) => [t, []]));
  const runs = { browser: per(), native: per(), copy: per() };
  const who0 = copyReads ? ['browser', 'native', 'copy'] : ['browser', 'native'];
  let simd = null;
  for (let r = 0; r < rounds; r++) {
    for (const t of threads.map((_, i) => threads[(i + r) % threads.length])) {
      for (const who of who0.map((_, i) => who0[(i + r) % who0.length])) {
        let note = '';
        if (who === 'native') runs.native[t].push(native(t));
        else {
          const x = await browser(t, who === 'browser');
          if (x.n !== t) throw new Error(`the browser ran ${x.n} threads, not ${t}`);
          runs[who][t].push(x.tps);
          simd = x.simd;
          note = ` (${x.direct})`;
        }
        console.error(`round ${r} threads ${t} ${who}: ${runs[who][t].at(-1).toFixed(2)} tokens/s${note}`);
      }
    }
  }
  const med = (xs) => [...xs].sort((x, y) => x - y)[Math.floor(xs.length / 2)];
  for (const t of threads) table.push({ t, browser: med(runs.browser[t]), native: med(runs.native[t]), copy: copyReads ? med(runs.copy[t]) : null, simd });
} finally {
  await ctx.close();
  server.close();
}
console.log(`\n${model}${budget ? `, ${budget} MiB budget` : ', resident'}${store ? `, ${store}` : ''}, ${n} tokens greedy, ${rounds} rounds alternating, medians\n`);
const copyHead = copyReads ? ' browser, copied reads (t/s) | browser / copied |' : '';
console.log(`| threads | browser decode (t/s) | native decode (t/s) | browser / native | browser vs 1st thread count |${copyHead} browser build |`);
console.log(`|---:|---:|---:|---:|---:|${copyReads ? '---:|---:|' : ''}---|`);
for (const r of table) {
  const copy = copyReads ? ` ${r.copy.toFixed(2)} | ${(r.browser / r.copy).toFixed(2)}× |` : '';
  console.log(`| ${r.t} | ${r.browser.toFixed(2)} | ${r.native.toFixed(2)} | ${(r.browser / r.native).toFixed(2)}× | ${(r.browser / table[0].browser).toFixed(2)}× |${copy} ${r.simd} |`);
}

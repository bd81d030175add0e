// A/B of two `createEngine` option sets in one browser (headless Chromium; LES_BROWSER=firefox
// for Firefox ESR): the same build, the same model, rotating A B / B A round by round, a fresh
// engine per run, greedy. Prints prompt and decode tokens/s medians of each, B / A with the
// per-round decode ratios, and whether every run gave the same text.
//   node tests/e2e/ab_options.mjs --a '{"repack":false}' [--b '{}'] [--model models/X.gguf]
//        [--threads 1,2] [--rounds 6] [--n 64] [--budget MB] [--long]
// --long: peer.mjs's ~115-token paragraph before the question (prompt tokens/s).
import { startServer } from './server.mjs';
import { launch } from './browser.mjs';
import { LONG_PROMPT, SHORT_PROMPT } from './common.mjs';

const arg = (name, def) => { const i = process.argv.indexOf(`--${name}`); return i < 0 ? def : process.argv[i + 1]; };
const A = JSON.parse(arg('a', '{}'));
const B = JSON.parse(arg('b', '{}'));
const model = arg('model', 'models/SmolLM2-135M-Instruct.Q4_1.gguf');
const threads = arg('threads', '1,2').split(',').map(Number);
const rounds = Number(arg('rounds', '6'));
const n = Number(arg('n', '64'));
const budget = Number(arg('budget', '0'));
const prompt = (process.argv.includes('--long') ? LONG_PROMPT : '') + SHORT_PROMPT;

const { server, port } = await startServer();
const ctx = await launch();
const page = await ctx.newPage();
await page.goto(`http://127.0.0.1:${port}/index.html`);
const run = (opts, t) => page.evaluate(async ({ opts, url, t, n, budget, prompt }) => {
  const { createEngine } = await import('/les/index.js');
  const e = await createEngine({ model: url, backend: 'cpu', nCtx: 512, threads: t, memoryBudgetMB: budget, ...opts });
  let text = '';
  for await (const c of e.generate(prompt, { max_tokens: n, temperature: 0, ignore_eos: true })) text += c;
  const st = e.lastResult.stats;
  const r = { prompt: (st.prompt_tokens / st.prompt_ms) * 1000, decode: st.tokens_per_s, text };
  await e.unload();
  return r;
}, { opts, url: `/${model}`, t, n, budget, prompt });
const median = (xs) => { const s = [...xs].sort((a, b) => a - b); return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2; };
try {
  await run(B, threads[0]); // warm: the model stored in OPFS
  console.log(`${model}, ${n} tokens greedy, ${rounds} rounds rotating, medians; A = ${JSON.stringify(A)}, B = ${JSON.stringify(B)}\n`);
  console.log('| threads | prompt A (t/s) | prompt B | B / A | decode A (t/s) | decode B | B / A | decode B / A per round | same text |');
  console.log('|---:|---:|---:|---:|---:|---:|---:|---|---|');
  for (const t of threads) {
    const res = { A: [], B: [] };
    for (let r = 0; r < rounds; r++) {
      for (const who of r % 2 ? ['B', 'A'] : ['A', 'B']) {
        const x = await run(who === 'A' ? A : B, t);
        res[who].push(x);
        console.error(`threads ${t} round ${r} ${who}: prompt ${x.prompt.toFixed(1)}, decode ${x.decode.toFixed(2)} t/s`);
      }
    }
    const m = (who, k) => median(res[who].map((x) => x[k]));
    const per = res.B.map((x, i) => (x.decode / res.A[i].decode).toFixed(2)).join(', ');
    const same = [...res.A, ...res.B].every((x) => x.text === res.A[0].text);
    console.log(`| ${t} | ${m('A', 'prompt').toFixed(1)} | ${m('B', 'prompt').toFixed(1)} | ${(m('B', 'prompt') / m('A', 'prompt')).toFixed(2)}× | ${m('A', 'decode').toFixed(2)} | ${m('B', 'decode').toFixed(2)} | **${(m('B', 'decode') / m('A', 'decode')).toFixed(2)}×** | ${per} | ${same ? 'yes' : 'no'} |`);
  }
} finally {
  await ctx.close();
  server.close();
}
